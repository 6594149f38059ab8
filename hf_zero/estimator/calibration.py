"""Hook for checking the estimator against measured training runs.

Nothing here measures: the engine does not exist yet. When it does, a run records its peaks
(the CUDA allocator's ``max_memory_allocated()`` per rank, the node's peak resident host memory, the bytes in
the NVMe swap folder) into a :class:`MeasuredMemory`, and :func:`compare_with_measurement` says how
far each tier's estimate was off. A GPU integration test can then assert the ratios stay within a
band and, where they do not, the constants in ``memory.py`` (the activation coefficients, the
stage-3 buffer count) are the ones to revisit.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_zero.estimator.memory import Row

__all__ = ["MeasuredMemory", "MeasurementComparison", "compare_with_measurement"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredMemory:
    """Peak memory observed in a real run of one configuration (same units as a :class:`Row`)."""

    gpu_bytes: int
    """Peak allocated on the busiest GPU (the allocator's ``max_memory_allocated``; not ``reserved``)."""
    cpu_bytes: int | None = None
    """Peak host memory of one node attributable to training (RSS minus the idle baseline)."""
    nvme_bytes: int | None = None
    """Bytes in the node's NVMe swap folder at the end of a step."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasurementComparison:
    """Estimate divided by measurement per tier (1.0 = exact, > 1 = the estimate is conservative)."""

    gpu_ratio: float
    cpu_ratio: float | None
    nvme_ratio: float | None

    def within(self, low: float, high: float) -> bool:
        """Whether every measured tier's ratio lies in ``[low, high]``."""
        ratios = [r for r in (self.gpu_ratio, self.cpu_ratio, self.nvme_ratio) if r is not None]
        return all(low <= r <= high for r in ratios)


def compare_with_measurement(row: Row, measured: MeasuredMemory) -> MeasurementComparison:
    """How the estimate of ``row`` compares with a run of the same configuration.

    Example:
        >>> from hf_zero.estimator.choices import ZeroChoice
        >>> from hf_zero.estimator.terms import Breakdown
        >>> row = Row(choice=ZeroChoice(2), speed_rank=2, gpu=Breakdown(params=100), cpu=Breakdown(),
        ...     nvme=Breakdown(), fits=True)
        >>> compare_with_measurement(row, MeasuredMemory(gpu_bytes=80)).gpu_ratio
        1.25
    """

    def ratio(estimated: int, observed: int | None) -> float | None:
        if observed is None:
            return None
        if observed <= 0:
            return float("inf") if estimated > 0 else 1.0
        return estimated / observed

    gpu = ratio(row.gpu_bytes, measured.gpu_bytes)
    assert gpu is not None  # gpu_bytes is required
    return MeasurementComparison(
        gpu_ratio=gpu,
        cpu_ratio=ratio(row.cpu_bytes, measured.cpu_bytes),
        nvme_ratio=ratio(row.nvme_bytes, measured.nvme_bytes),
    )
