"""What the estimator compares: training precisions (bytes per parameter) and ZeRO configurations
(stage and offload devices), with the configurations in the order "the fastest that fits" tries them.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_zero.estimator.constants import (
    ADAM_K,
    ADAM_K_FP32,
    BYTES_PER_GRAD_16BIT,
    BYTES_PER_GRAD_FP32,
    BYTES_PER_PARAM_16BIT,
    BYTES_PER_PARAM_FP32,
    FP32_ACTIVATION_FACTOR,
    OFFLOAD_DEVICES,
    OffloadDevice,
)

__all__ = ["PRECISIONS", "SPEED_ORDER", "Precision", "ZeroChoice", "is_valid_choice"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Precision:
    """Bytes per parameter of one training precision."""

    name: str
    param_bytes: int
    grad_bytes: int
    optimizer_k: int
    """K: optimizer-state bytes per trainable parameter (fp32 master included when there is one)."""
    activation_factor: int
    """Multiplier on the 16-bit activation formula."""


PRECISIONS: dict[str, Precision] = {
    "bf16": Precision(name="bf16", param_bytes=BYTES_PER_PARAM_16BIT, grad_bytes=BYTES_PER_GRAD_16BIT, optimizer_k=ADAM_K, activation_factor=1),
    "fp16": Precision(name="fp16", param_bytes=BYTES_PER_PARAM_16BIT, grad_bytes=BYTES_PER_GRAD_16BIT, optimizer_k=ADAM_K, activation_factor=1),
    "fp32": Precision(name="fp32", param_bytes=BYTES_PER_PARAM_FP32, grad_bytes=BYTES_PER_GRAD_FP32, optimizer_k=ADAM_K_FP32, activation_factor=FP32_ACTIVATION_FACTOR),
}
"""Training precisions by ``--dtype`` name; bf16 and fp16 are the paper's mixed precision."""


@dataclass(frozen=True, slots=True)
class ZeroChoice:
    """One ZeRO configuration: a stage and where optimizer state and parameters live."""

    stage: int
    offload_optimizer: OffloadDevice = "none"
    offload_param: OffloadDevice = "none"

    def label(self) -> str:
        """Short name for tables, e.g. ``ZeRO-3 + optimizer cpu + params nvme``."""
        parts = [f"ZeRO-{self.stage}"]
        if self.offload_optimizer != "none":
            parts.append(f"optimizer {self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"params {self.offload_param}")
        return " + ".join(parts)


def is_valid_choice(choice: ZeroChoice) -> bool:
    """Whether DeepSpeed's config allows it: optimizer offload at stages 1-3, parameter offload at stage 3.

    DeepSpeed itself runs NVMe optimizer offload only at stage 3 (ZeRO-Infinity); hf_zero's own
    offload backend is per optimizer shard, so stages 1 and 2 are listed with NVMe too.
    """
    if choice.stage not in (0, 1, 2, 3):
        return False
    if choice.offload_optimizer not in OFFLOAD_DEVICES or choice.offload_param not in OFFLOAD_DEVICES:
        return False
    if choice.stage == 0 and choice.offload_optimizer != "none":
        return False
    return choice.stage == 3 or choice.offload_param == "none"


SPEED_ORDER: tuple[ZeroChoice, ...] = (
    # No offload: higher stages add communication (stage 3 moves 1.5x the data of stages 0-2).
    ZeroChoice(0),
    ZeroChoice(1),
    ZeroChoice(2),
    ZeroChoice(3),
    # Optimizer on the host: a CPU Adam step and gradient copies over PCIe every step.
    ZeroChoice(1, "cpu"),
    ZeroChoice(2, "cpu"),
    ZeroChoice(3, "cpu"),
    # Parameters on the host too: every forward and backward fetches every shard over PCIe.
    ZeroChoice(3, "none", "cpu"),
    ZeroChoice(3, "cpu", "cpu"),
    # NVMe: disk bandwidth (a few GB/s) is below PCIe, so anything on NVMe comes last.
    ZeroChoice(1, "nvme"),
    ZeroChoice(2, "nvme"),
    ZeroChoice(3, "nvme"),
    ZeroChoice(3, "none", "nvme"),
    ZeroChoice(3, "nvme", "cpu"),
    ZeroChoice(3, "cpu", "nvme"),
    ZeroChoice(3, "nvme", "nvme"),
)
"""Every valid configuration, fastest first: the order in which "the fastest that fits" is chosen.
The order is a rule of thumb (no measurement); see docs/estimator.md."""
