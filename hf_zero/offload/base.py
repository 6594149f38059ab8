"""What every offload backend shares: byte accounting per tier, host allocation, and errors that
reach every rank.

An offload backend owns memory the engine cannot classify by ``tensor.device`` alone: on a machine
without a GPU the "accelerator" *is* the CPU, so a host buffer and a parameter look the same. Each
backend therefore reports the bytes it holds per tier itself (:class:`TierReport`), and the engine
adds them to what it counts for the tensors no backend claims (``ZeroEngine.memory_report``).

Faults (a full disk, a deleted swap file, memory that cannot be pinned) happen on one rank while the
others carry on into the next collective and would wait there until the process-group timeout.
:func:`agree_on_error` is the one place where ranks compare notes: every backend calls it at its
synchronisation points (construction, the optimizer step, state-dict calls), so that a fault ends
with one clear :class:`OffloadError` on every rank instead of a hang.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from hf_zero.distributed import device as accel
from hf_zero.distributed.collectives import agree_on_error as _agree_on_error

__all__ = [
    "KINDS",
    "TIERS",
    "GradientOwner",
    "OffloadBackend",
    "OffloadError",
    "TierReport",
    "agree_on_error",
    "alloc_host",
    "empty_report",
    "merge_reports",
    "nbytes",
]

logger = logging.getLogger("hf_zero")

KINDS = ("params", "grads", "optimizer_state")
"""What the memory report counts (the ZeRO paper's three model states)."""
TIERS = ("accelerator", "host", "nvme")
"""Where bytes live: the device the engine computes on, host RAM, files under ``nvme_path``."""

TierReport = dict[str, dict[str, int]]
"""``{kind: {tier: bytes}}`` with every kind of :data:`KINDS` and tier of :data:`TIERS`."""


class OffloadError(RuntimeError):
    """An offload backend cannot go on; the message names the path or the config setting at fault."""


def empty_report() -> TierReport:
    return {kind: {tier: 0 for tier in TIERS} for kind in KINDS}


def merge_reports(into: TierReport, other: TierReport) -> TierReport:
    """Add ``other`` into ``into`` (in place) and return it."""
    for kind, tiers in other.items():
        for tier, value in tiers.items():
            into.setdefault(kind, {}).setdefault(tier, 0)
            into[kind][tier] += int(value)
    return into


def nbytes(t: torch.Tensor | None) -> int:
    """Bytes of ``t``'s elements (its local shard for a DTensor); 0 for None."""
    if t is None:
        return 0
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


@runtime_checkable
class OffloadBackend(Protocol):
    """A component that keeps part of the training state off the accelerator."""

    def memory_report(self) -> TierReport:
        """Bytes this backend holds, per kind and tier, on this rank."""

    def claimed_params(self) -> set[int]:
        """``id()`` of the parameters whose bytes (and gradients' bytes) :meth:`memory_report`
        already counts, so that the engine does not count them a second time."""

    def close(self) -> None:
        """Release buffers, threads and files (idempotent)."""


@runtime_checkable
class GradientOwner(Protocol):
    """An optimizer that moves gradients off the parameters as backward produces them.

    The engine's overflow check, gradient norm and clipping work on ``param.grad``; when an
    offloaded optimizer has already moved the gradients to host buffers (and freed the device
    copies), the engine asks it instead.
    """

    def unscale_grads_(self, inv_scale: float) -> None:
        """Multiply every gradient this rank holds by ``inv_scale`` (fp16 loss-scale removal)."""

    def grads_have_inf_or_nan(self, held_in: torch.dtype | None = None) -> bool:
        """Whether any gradient this rank holds is not finite, or would round to inf in ``held_in``
        (this rank only, no collective)."""

    def total_grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The global gradient norm over all ranks (a collective: every rank must call it)."""

    def clip_grads_with_norm_(self, max_norm: float, total_norm: torch.Tensor) -> None:
        """Scale the gradients by ``max_norm / (total_norm + 1e-6)`` when that is below 1."""


def _pin_available() -> bool:
    return accel.pin_available()


def alloc_host(
    numel: int,
    dtype: torch.dtype,
    *,
    pin: bool,
    setting: str,
    align: int = 0,
) -> torch.Tensor:
    """A zero-filled 1-D host tensor, page-locked when ``pin`` is true and a GPU is present.

    Pinned (page-locked) memory lets device<->host copies run asynchronously by DMA; without a GPU
    there is nothing to pin for, so ``pin`` is ignored there.

    Args:
        numel: number of elements.
        dtype: element type.
        pin: the config's ``pin_memory``.
        setting: the config key that asked for pinning, for the error message.
        align: when > 0, the returned tensor's address is a multiple of ``align`` bytes (direct
            I/O needs page-aligned buffers); the allocation is over-sized by ``align`` bytes.

    Raises:
        OffloadError: pinning failed (``cudaHostAlloc`` refused: too much locked memory, or the
            ``ulimit -l`` limit); the message names ``setting``.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    extra = max(0, align)
    pin = pin and _pin_available()
    try:
        raw = _allocate(numel * itemsize + extra, pin)
    except (RuntimeError, MemoryError) as exc:
        what = "pin" if pin else "allocate"
        raise OffloadError(
            f"could not {what} {format_bytes(numel * itemsize + extra)} of host memory ({exc}); "
            + (f"set {setting}=false, or lower the buffer sizes (sub_group_size, buffer_count)"
               if pin else "lower the buffer sizes (sub_group_size, buffer_count) or add host memory")
        ) from exc
    start = 0
    if extra:
        start = (-raw.data_ptr()) % align
    return raw[start : start + numel * itemsize].view(dtype)


def format_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``: sizes in messages."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def _allocate(nbytes_: int, pin: bool) -> torch.Tensor:
    """Raw byte allocation; a function of its own so tests can simulate a pinning failure."""
    if not pin:
        return torch.zeros(nbytes_, dtype=torch.uint8)
    return accel.pinned_empty(nbytes_).zero_()


def agree_on_error(error: BaseException | None, what: str, *, group: dist.ProcessGroup | None = None) -> None:
    """:func:`hf_zero.distributed.collectives.agree_on_error` raising :class:`OffloadError` on the
    ranks that did not fail."""
    _agree_on_error(error, what, error_type=OffloadError, group=group)


def first_error(errors: Iterable[BaseException | None]) -> BaseException | None:
    for e in errors:
        if e is not None:
            return e
    return None
