"""Which dtype each parameter is stored in while training: fp32 masters for what the optimizer
updates, the loaded dtype for what it never touches.

A 16-bit checkpoint (``from_pretrained(..., dtype="auto")`` of a bf16 model) gives bf16
parameters. Stepping an optimizer on them loses every update smaller than half a bf16 ulp of
the weight (at lr 1e-6 most of them), so trainable parameters are kept in fp32 at every stage,
as DeepSpeed's bf16/fp16 optimizers keep fp32 masters:

- stages 0/1 keep fp32 parameters and run the forward under autocast (the compute is 16 bit);
- stages 2/3 keep fp32 *shards* and let FSDP2 all-gather them cast to the compute dtype.

Frozen parameters (a LoRA base model) are never updated and need no master copy. They keep the
dtype they were loaded in, with two exceptions:

- stages 2/3 in 16-bit compute store them in the compute dtype: FSDP2 casts every parameter to it
  for the forward anyway, so the numbers are the same and an fp32 frozen weight costs half;
- in fp32 compute, when trainable parameters were 16 bit too (a bf16 model trained without
  ``--bf16``), frozen 16-bit parameters follow them to fp32: the model computes in one dtype, as
  it would without hf_zero's masters (there is no autocast to mix them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["MasterCast", "cast_to_master_dtypes"]

_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True, slots=True)
class MasterCast:
    """What :func:`cast_to_master_dtypes` changed: element counts by what happened."""

    upcast_trainable: int = 0
    """Trainable elements loaded in 16 bit, now fp32 masters."""
    frozen_to_compute: int = 0
    """Frozen elements stored in the 16-bit compute dtype (stages 2/3)."""
    frozen_upcast: int = 0
    """Frozen 16-bit elements upcast to fp32 with their trainable neighbours (fp32 compute)."""

    def describe(self) -> str | None:
        """One log line, or None when nothing was cast."""
        parts = []
        if self.upcast_trainable:
            parts.append(f"{self.upcast_trainable:,} trainable 16-bit elements get fp32 master weights")
        if self.frozen_to_compute:
            parts.append(f"{self.frozen_to_compute:,} frozen elements are stored in the compute dtype")
        if self.frozen_upcast:
            parts.append(f"{self.frozen_upcast:,} frozen 16-bit elements follow them to fp32 (fp32 compute)")
        return "; ".join(parts) or None


def cast_to_master_dtypes(
    model: nn.Module, compute_dtype: torch.dtype, *, frozen_in_compute_dtype: bool
) -> MasterCast:
    """Cast ``model``'s floating-point parameters in place to the dtypes they train in.

    Parameter objects are kept (``param.data`` is replaced), so tied weights and an optimizer
    built before this call still refer to them.

    Args:
        model: the model, before it is wrapped or sharded.
        compute_dtype: the dtype of the forward/backward (fp32, bf16 or fp16).
        frozen_in_compute_dtype: store frozen parameters in a 16-bit ``compute_dtype`` (stages
            2/3, where FSDP2 casts them to it for every forward anyway).

    Returns:
        The counts of what was cast, for the start-up log.

    Example::

        >>> model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")   # bf16 weights
        >>> cast_to_master_dtypes(model, torch.bfloat16, frozen_in_compute_dtype=False)
        >>> {p.dtype for p in model.parameters()}
        {torch.float32}
    """
    # parameters() lists a tied weight once.
    params = [p for p in model.parameters() if p.is_floating_point()]
    compute_is_half = compute_dtype in _HALF
    # fp32 compute of a 16-bit model: no autocast would reconcile fp32 masters with 16-bit frozen
    # neighbours in the same matmul, so the whole model computes in fp32.
    frozen_follow = not compute_is_half and any(p.requires_grad and p.dtype in _HALF for p in params)
    counts = {"upcast_trainable": 0, "frozen_to_compute": 0, "frozen_upcast": 0}
    with torch.no_grad():
        for p in params:
            if p.requires_grad:
                target, kind = torch.float32, "upcast_trainable"
            elif frozen_in_compute_dtype and compute_is_half:
                target, kind = compute_dtype, "frozen_to_compute"
            elif frozen_follow and p.dtype in _HALF:
                target, kind = torch.float32, "frozen_upcast"
            else:
                continue
            if p.dtype != target:
                if kind == "upcast_trainable" and p.dtype not in _HALF:
                    kind = None  # e.g. float64 -> fp32: not worth a log line
                p.data = p.data.to(target)
                if kind is not None:
                    counts[kind] += p.numel()
    return MasterCast(**counts)
