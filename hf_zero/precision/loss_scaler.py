"""fp16 loss scaling as a pure state machine.

The scaler knows nothing of ranks or collectives: the engine multiplies the loss by
``loss_scale``, checks the accumulated (still scaled) gradients with :func:`grads_have_inf_or_nan`,
all-reduces that flag across ranks, hands the agreed ``overflow`` to ``update_scale`` and unscales.
A step with an overflow is skipped (no optimizer step, no scheduler step).

What counts as an overflow follows DeepSpeed, whose fp16 gradients accumulate over micro-steps in
fp16 (``data_types.grad_accum_dtype`` defaults to the model dtype at every ZeRO stage, with or
without offload) and are checked for inf/nan once, at the accumulation boundary. hf_zero accumulates
in fp32, so it asks the equivalent question of its fp32 sum: does it hold an inf/nan, or a value
that fp16 cannot hold (``held_in=torch.float16``)? Judging each micro-step instead would let a sum
of four in-range quarter gradients through where one batch of the same size overflows.

:class:`DynamicLossScaler` reproduces ``DynamicLossScaler.update_scale`` in DeepSpeed's
``deepspeed/runtime/fp16/loss_scaler.py`` (microsoft/DeepSpeed) step for step, including its
iteration bookkeeping, so a run shows the same scale sequence as under DeepSpeed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from hf_zero.config.schema import FP16Config

__all__ = [
    "LossScaler",
    "DynamicLossScaler",
    "StaticLossScaler",
    "build_loss_scaler",
    "grads_have_inf_or_nan",
    "rounds_to_inf_from",
]


class LossScaler(Protocol):
    """What the engine needs from a loss scaler."""

    dynamic: bool

    @property
    def loss_scale(self) -> float: ...

    def update_scale(self, overflow: bool) -> float: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class StaticLossScaler:
    """A fixed loss scale (``fp16.loss_scale > 0``), or 1.0 when nothing is scaled (bf16/fp32).

    Args:
        scale: The loss scale.
    """

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        if scale <= 0:
            raise ValueError(f"a static loss scale must be > 0, got {scale}")
        self.cur_scale = float(scale)

    @property
    def loss_scale(self) -> float:
        """The factor the loss is multiplied by before backward."""
        return self.cur_scale

    def update_scale(self, overflow: bool) -> float:
        """No change, whatever ``overflow`` is (DeepSpeed's static ``LossScaler``).

        Returns:
            The (unchanged) loss scale.
        """
        return self.cur_scale

    def state_dict(self) -> dict[str, Any]:
        """``{"cur_scale": scale}``, for information: a static scale comes from the config."""
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Accept a saved state and keep the configured scale (the config is the source of truth)."""

    def __repr__(self) -> str:
        return f"StaticLossScaler(scale={self.cur_scale})"


class DynamicLossScaler:
    """DeepSpeed's dynamic loss scaler: back off on overflow, grow after a quiet window.

    On ``update_scale(overflow)``, with ``cur_iter`` counting calls::

        overflow:      if delayed_shift == 1 or cur_hysteresis == 1:
                           scale = max(scale / scale_factor, min_scale)
                       else:
                           cur_hysteresis -= 1          (tolerate this overflow)
                       last_overflow_iter = cur_iter
        no overflow:   if consecutive_hysteresis: cur_hysteresis = delayed_shift
                       if (cur_iter - last_overflow_iter) % scale_window == 0:
                           if not consecutive_hysteresis: cur_hysteresis = delayed_shift
                           scale *= scale_factor
        cur_iter += 1

    ``last_overflow_iter`` starts at -1, so without overflows the scale first doubles on the
    ``scale_window``-th call. Hysteresis is refilled only when the scale grows, unless
    ``consecutive_hysteresis`` refills it on every overflow-free step.

    Args:
        init_scale: Starting scale (``2 ** fp16.initial_scale_power``).
        scale_factor: Growth/back-off factor.
        scale_window: Overflow-free steps between growths (``fp16.loss_scale_window``).
        min_scale: Floor of the scale (``fp16.min_loss_scale``).
        delayed_shift: Overflows tolerated before backing off (``fp16.hysteresis``).
        consecutive_hysteresis: Refill hysteresis on every overflow-free step.
        raise_error_at_min_scale: Raise instead of skipping when an overflow happens with the scale
            already at ``min_scale`` and no hysteresis left. DeepSpeed's class defaults to True
            and its config cannot change it; hf_zero defaults to False (keep training, keep skipping).

    Example::

        >>> s = DynamicLossScaler(init_scale=2.0**16, scale_window=1000, delayed_shift=2)
        >>> s.update_scale(True)    # first overflow eats one unit of hysteresis
        65536.0
        >>> s.update_scale(True)    # second one halves the scale
        32768.0
    """

    dynamic = True

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        delayed_shift: int = 1,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = False,
    ) -> None:
        if init_scale <= 0 or min_scale <= 0:
            raise ValueError(f"loss scales must be > 0, got init_scale={init_scale}, min_scale={min_scale}")
        if scale_factor <= 1:
            raise ValueError(f"scale_factor must be > 1, got {scale_factor}")
        if scale_window < 1:
            raise ValueError(f"scale_window (fp16.loss_scale_window) must be >= 1, got {scale_window}")
        if delayed_shift < 1:
            raise ValueError(f"delayed_shift (fp16.hysteresis) must be >= 1, got {delayed_shift}")
        self.cur_scale = float(init_scale)
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.delayed_shift = int(delayed_shift)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = self.delayed_shift

    @property
    def loss_scale(self) -> float:
        """The factor the loss is multiplied by before backward."""
        return self.cur_scale

    def update_scale(self, overflow: bool) -> float:
        """Advance one optimizer step.

        Args:
            overflow: Whether any rank found an inf/nan gradient this step (already agreed across
                ranks by the caller).

        Returns:
            The loss scale for the next step.

        Raises:
            RuntimeError: ``raise_error_at_min_scale`` is set and the scale cannot go lower.
        """
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise RuntimeError(
                        "fp16 loss scale is already at min_loss_scale "
                        f"({self.min_scale}) and the gradients still overflow"
                    )
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1
        return self.cur_scale

    def state_dict(self) -> dict[str, Any]:
        """The changing state: scale, iteration counters and remaining hysteresis.

        Hyper-parameters (window, factor, floor, hysteresis) are not saved: on resume they come
        from the config, so they can be changed between runs.
        """
        return {
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.cur_scale = float(state_dict["cur_scale"])
        self.cur_iter = int(state_dict["cur_iter"])
        self.last_overflow_iter = int(state_dict["last_overflow_iter"])
        self.cur_hysteresis = int(state_dict["cur_hysteresis"])

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaler(scale={self.cur_scale}, window={self.scale_window}, "
            f"min={self.min_scale}, hysteresis={self.cur_hysteresis}/{self.delayed_shift})"
        )


def build_loss_scaler(fp16: FP16Config, enabled: bool) -> StaticLossScaler | DynamicLossScaler:
    """The loss scaler for a run.

    Args:
        fp16: The ``fp16`` section.
        enabled: Whether the run computes in fp16 (the engine decides; ``fp16.enabled`` may have
            been ``"auto"``).

    Returns:
        ``DynamicLossScaler`` when ``enabled`` and ``fp16.loss_scale == 0``; ``StaticLossScaler``
        with ``fp16.loss_scale`` when it is > 0; ``StaticLossScaler(1.0)`` (``dynamic`` False, no
        scaling) when not ``enabled`` (bf16 and fp32 need no scaling).

    Raises:
        ValueError: ``fp16.loss_scale`` is negative.
    """
    if not enabled:
        return StaticLossScaler(1.0)
    if fp16.loss_scale < 0:
        raise ValueError(f"fp16.loss_scale={fp16.loss_scale} must be 0 (dynamic) or > 0 (static)")
    if fp16.loss_scale > 0:
        return StaticLossScaler(fp16.loss_scale)
    return DynamicLossScaler(
        init_scale=2.0**fp16.initial_scale_power,
        scale_factor=2.0,
        scale_window=fp16.loss_scale_window,
        min_scale=fp16.min_loss_scale,
        delayed_shift=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
        raise_error_at_min_scale=False,
    )


def rounds_to_inf_from(dtype: torch.dtype) -> float:
    """The smallest magnitude that rounds to inf when cast to ``dtype`` (round to nearest even).

    Half an ulp above ``finfo(dtype).max``: a tie between the largest finite value (odd mantissa,
    all ones) and the next power of two goes to the even one, infinity. 65520.0 for fp16.
    """
    info = torch.finfo(dtype)
    top_binade = 2.0 ** math.floor(math.log2(info.max))
    return float(info.max) + top_binade * float(info.eps) / 2


def grads_have_inf_or_nan(tensors: Iterable[torch.Tensor | None], *,
                          held_in: torch.dtype | None = None) -> torch.Tensor:
    """Whether any of this rank's gradients holds an inf or a nan.

    Only local data is read: for a DTensor, its local shard. The caller all-reduces the result
    (any rank overflowing means every rank skips the step).

    Args:
        tensors: Gradients (None entries are skipped), plain tensors or DTensors.
        held_in: Also count a value as an overflow when it would round to inf in this dtype: the
            engine passes fp16 for gradients it accumulated in fp32 where DeepSpeed keeps an fp16
            sum (see the module docstring).

    Returns:
        A 0-dim bool tensor, on the device of the first gradient (CPU if there is none); computing
        it does not synchronize with the device.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.numel():
            by_device.setdefault(local.device, []).append(local)
    if not by_device:
        return torch.zeros((), dtype=torch.bool)
    limit = rounds_to_inf_from(held_in) if held_in is not None else None
    flags = []
    for device_tensors in by_device.values():
        # The max-abs of a tensor is inf if it holds an inf and nan if it holds a nan: one fused
        # reduction per device instead of an isfinite() mask per tensor. (The max of fp32 values
        # is exact, so comparing it with the fp16 limit decides as an fp16 cast would.)
        amax = torch.stack([n.float() for n in torch._foreach_norm(device_tensors, ord=float("inf"))])
        bad = ~torch.isfinite(amax)
        if limit is not None:
            bad = bad | (amax >= limit)
        flags.append(bad.any())
    first = flags[0]
    return torch.stack([f.to(first.device) for f in flags]).any()
