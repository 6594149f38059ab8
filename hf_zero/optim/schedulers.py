"""DeepSpeed's learning-rate schedules (``scheduler`` section) as torch ``LRScheduler`` objects.

The formulas and the step semantics are DeepSpeed's (``deepspeed/runtime/lr_schedules.py`` in
microsoft/DeepSpeed: ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle``,
``LRRangeTest``). DeepSpeed counts ``last_batch_iteration``: -1 at construction, and each
``step()`` adds one and then sets the learning rate for that iteration. Its engine steps the
scheduler once after every optimizer step that was not skipped for an fp16 overflow. So:

* at construction the optimizer gets the schedule's starting value (``warmup_min_lr``, 0.0 for
  WarmupCosineLR, ``cycle_min_lr``, ``lr_range_test_min_lr``); the first optimizer step uses it;
* after the n-th ``step()``, ``last_batch_iteration == n - 1`` and the lr is ``f(n - 1)``.

Here torch's ``last_epoch`` counts ``step()`` calls (torch's own constructor makes one), so
``last_batch_iteration == last_epoch - 1``; it is exposed under DeepSpeed's name too.

This follows DeepSpeed's code as of its 2026 fixes: WarmupCosineLR starts every param group at
0.0 (PR #7969) and holds ``cos_min_ratio`` past ``total_num_steps`` (PR #8142); WarmupLR without
``warmup_max_lr`` warms up to each group's own lr (PRs #7360, #8171); OneCycle's stair counts
quantize the cycle (PR #8179). Deliberate differences from DeepSpeed, where its code does something
plainly unintended:

* OneCycle leaves ``betas[1]`` as the optimizer had it; DeepSpeed overwrites it with 0.99.
* An unknown ``warmup_type`` is an error; DeepSpeed warns and uses ``log``.

Like DeepSpeed, OneCycle cycles momentum only for optimizers with ``betas`` in their defaults
(Adam, AdamW, Lion, Lamb); for SGD it warns and cycles the lr alone.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from hf_zero.config.schema import (
    AUTO,
    LRRangeTestParams,
    OneCycleParams,
    SchedulerConfig,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
)

__all__ = [
    "steps_on_metrics",
    "build_scheduler",
    "DeepSpeedLRScheduler",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "OneCycle",
    "LRRangeTest",
    "SCHEDULER_TYPES",
]

WARMUP_LOG = "log"
WARMUP_LINEAR = "linear"


class DeepSpeedLRScheduler(LRScheduler):
    """Base class: a closed-form schedule indexed by DeepSpeed's ``last_batch_iteration``.

    Subclasses set their attributes, then call ``super().__init__(optimizer)``, and implement
    :meth:`lr_at` (and :meth:`initial_lrs` when the value before the first step is special).

    ``state_dict()`` holds only the position (DeepSpeed's ``{"last_batch_iteration": n}``, plus the
    last lrs), so the schedule's shape comes from the config on resume, as in DeepSpeed; a
    DeepSpeed scheduler state dict loads as well.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer, last_epoch=-1)

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's counter: -1 before the first ``step()``, then 0, 1, 2, ..."""
        return self.last_epoch - 1

    def lr_at(self, batch_iteration: int) -> list[float]:
        """The lr of each param group once ``last_batch_iteration == batch_iteration >= 0``."""
        raise NotImplementedError

    def initial_lrs(self) -> list[float]:
        """The lr of each param group at construction (``last_batch_iteration == -1``)."""
        return self.lr_at(0)

    def get_lr(self) -> list[float]:
        it = self.last_batch_iteration
        return self.initial_lrs() if it < 0 else self.lr_at(it)

    def step(self, epoch: int | None = None) -> None:
        """Advance one batch and set the optimizer's lrs for it (call after ``optimizer.step()``).

        Args:
            epoch: Not supported (DeepSpeed's ``step(batch_iteration)`` and torch's deprecated
                ``step(epoch)`` disagree by one); must be None.
        """
        if epoch is not None:
            raise TypeError(f"{type(self).__name__}.step() takes no argument; got {epoch!r}")
        super().step()

    def state_dict(self) -> dict[str, Any]:
        """The position in the schedule: ``{"last_batch_iteration": n, "last_lr": [...]}``."""
        return {"last_batch_iteration": self.last_batch_iteration, "last_lr": list(self._last_lr)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the position saved by :meth:`state_dict` (or by a DeepSpeed scheduler).

        Like torch and DeepSpeed, this does not touch the optimizer's lrs: they come back with the
        optimizer's own state dict, and the next ``step()`` sets them from the schedule.
        """
        self.last_epoch = int(state_dict["last_batch_iteration"]) + 1
        self._step_count = self.last_epoch + 1
        if "last_lr" in state_dict:
            self._last_lr = list(state_dict["last_lr"])


def _n_groups(optimizer: torch.optim.Optimizer) -> int:
    return len(optimizer.param_groups)


def _warmup_gamma(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Warmup fraction in [0, 1] at ``iteration < warmup_num_steps`` (DeepSpeed ``_get_gamma``)."""
    if warmup_type == WARMUP_LOG:
        # inverse_log_warm_up * log(iteration + 1): 0 at iteration 0, 1 at warmup_num_steps - 1.
        return (1.0 / math.log(warmup_num_steps)) * math.log(iteration + 1)
    return iteration / warmup_num_steps


def _check_steps(name: str, value: Any, minimum: int) -> int:
    """An integer step count >= minimum (DeepSpeed rejects None and negative counts too)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < minimum:
        raise ValueError(f"scheduler.params.{name}={value!r} must be an integer >= {minimum}")
    return int(value)


def _check_warmup_type(warmup_type: str) -> str:
    if warmup_type not in (WARMUP_LOG, WARMUP_LINEAR):
        raise ValueError(f"scheduler.params.warmup_type={warmup_type!r} must be 'log' or 'linear'")
    return warmup_type


class WarmupLR(DeepSpeedLRScheduler):
    """Warm up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold.

    With ``it = last_batch_iteration`` and ``W = max(2, warmup_num_steps)`` (DeepSpeed clamps W so
    that ``log(W) > 0``)::

        lr = min + (max - min) * log(it + 1) / log(W)     if it < W  (warmup_type "log")
        lr = min + (max - min) * it / W                   if it < W  (warmup_type "linear")
        lr = max                                          otherwise

    and ``lr = warmup_min_lr`` at construction.

    Args:
        optimizer: The optimizer whose param groups get the lr.
        warmup_min_lr: Starting lr.
        warmup_max_lr: lr after warmup; None means each param group's lr when the scheduler is
            built (DeepSpeed's WarmupLR default since PR #7360).
        warmup_num_steps: Warmup length in optimizer steps, >= 0 (values below 2 act as 2).
        warmup_type: ``"log"`` or ``"linear"``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG,
    ) -> None:
        self.min_lr = float(warmup_min_lr)
        if warmup_max_lr is None:
            self.max_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        else:
            self.max_lrs = [float(warmup_max_lr)] * _n_groups(optimizer)
        self.warmup_num_steps = max(2, _check_steps("warmup_num_steps", warmup_num_steps, minimum=0))
        self.warmup_type = _check_warmup_type(warmup_type)
        super().__init__(optimizer)

    def _gamma(self, it: int) -> float:
        if it < self.warmup_num_steps:
            return _warmup_gamma(it, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def lr_at(self, batch_iteration: int) -> list[float]:
        gamma = self._gamma(batch_iteration)
        return [self.min_lr + (max_lr - self.min_lr) * gamma for max_lr in self.max_lrs]

    def initial_lrs(self) -> list[float]:
        return [self.min_lr] * len(self.max_lrs)


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`, then linear decay to 0 at ``total_num_steps``.

    After warmup (``it >= W``)::

        lr = min + (max - min) * max(0, (T - it) / max(1, T - W))

    so the lr is ``max`` at ``it == W``, ``min`` at ``it == T`` and stays there. (DeepSpeed decays
    towards ``warmup_min_lr``, not 0, when that is non-zero; so does this.)

    Args:
        optimizer: The optimizer whose param groups get the lr.
        total_num_steps: Total optimizer steps ``T``.
        warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type: As for :class:`WarmupLR`,
            except that ``warmup_max_lr`` defaults to 0.001 (DeepSpeed's WarmupDecayLR default).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float | None = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG,
    ) -> None:
        self.total_num_steps = _check_steps("total_num_steps", total_num_steps, minimum=0)
        if self.total_num_steps < max(2, _check_steps("warmup_num_steps", warmup_num_steps, minimum=0)):
            warnings.warn(
                f"WarmupDecayLR: total_num_steps {total_num_steps} is less than warmup_num_steps "
                f"{warmup_num_steps}",
                stacklevel=2,
            )
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)

    def _gamma(self, it: int) -> float:
        if it < self.warmup_num_steps:
            return _warmup_gamma(it, self.warmup_num_steps, self.warmup_type)
        return max(0.0, (self.total_num_steps - it) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(DeepSpeedLRScheduler):
    """Warm up a *ratio* of the optimizer's lr, then cosine-decay it to ``cos_min_ratio``.

    The ratio multiplies each group's lr as it was when the scheduler was built. With
    ``W = max(2, warmup_num_steps)`` and ``T = total_num_steps``::

        it < W:  ratio = warmup_min_ratio + (1 - warmup_min_ratio) * g,
                 g = log(it + 1) / log(W) ("log") or it / W ("linear")
        it >= W: progress = min(1, (it - W + 1) / (T - W))
                 ratio = cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * progress)) / 2

    and the lr is 0.0 at construction, for every group. Past ``T`` (and when ``T <= W``) the ratio
    stays at ``cos_min_ratio``, as in DeepSpeed since PR #8142 (before it, the cosine ran on and the
    lr rose again, or ``T == W`` divided by zero).

    The base lrs are read from the optimizer when the scheduler is built, so build it before
    loading a checkpoint into the optimizer (whose lrs are then mid-schedule), as in DeepSpeed.

    Args:
        optimizer: The optimizer whose param groups get the lr.
        total_num_steps: Total optimizer steps ``T``.
        warmup_min_ratio: Ratio at the start of warmup.
        warmup_num_steps: Warmup length (values below 2 act as 2).
        cos_min_ratio: Ratio at the end of the cosine.
        warmup_type: ``"log"`` or ``"linear"``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG,
    ) -> None:
        self.total_num_steps = _check_steps("total_num_steps", total_num_steps, minimum=0)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.warmup_num_steps = max(2, _check_steps("warmup_num_steps", warmup_num_steps, minimum=0))
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_type = _check_warmup_type(warmup_type)
        if self.total_num_steps < self.warmup_num_steps:
            warnings.warn(
                f"WarmupCosineLR: total_num_steps {total_num_steps} is less than warmup_num_steps "
                f"{warmup_num_steps}",
                stacklevel=2,
            )
        # DeepSpeed's org_lrs: the groups' lrs now, before anything is changed.
        self.org_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        super().__init__(optimizer)

    def lr_ratio(self, it: int) -> float:
        """The multiplier of the original lr at ``last_batch_iteration == it >= 0``."""
        if it < self.warmup_num_steps:
            g = _warmup_gamma(it, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + g * (1.0 - self.warmup_min_ratio)
        real_last_step = it - self.warmup_num_steps + 1
        real_total_steps = self.total_num_steps - self.warmup_num_steps
        progress = min(1.0, real_last_step / real_total_steps) if real_total_steps > 0 else 1.0
        ratio = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)

    def lr_at(self, batch_iteration: int) -> list[float]:
        ratio = self.lr_ratio(batch_iteration)
        return [lr * ratio for lr in self.org_lrs]

    def initial_lrs(self) -> list[float]:
        return [0.0] * len(self.org_lrs)


# Positions that land exactly on a stair boundary can come out a hair below it in floating point
# (e.g. 2.9999999999999996 stairs); this keeps them on their stair. Far below one step at any size.
_STAIR_EPS = 1e-9


def _stair(position: float, stairs: int) -> float:
    """``position`` in [0, 1] rounded down to the start of its stair (``stairs`` equal stairs)."""
    return min(1.0, math.floor(position * stairs + _STAIR_EPS) / stairs)


class OneCycle(DeepSpeedLRScheduler):
    """One triangular lr cycle (and an inverse momentum cycle), then decay.

    With ``S1 = cycle_first_step_size``, ``S2 = cycle_second_step_size or S1``, ``N = S1 + S2``
    and ``b = last_batch_iteration + 1``::

        x = b / N - floor(b / N)             (position in the cycle, in [0, 1))
        s = x / (S1 / N)                     if x <= S1 / N (rising)
          = (x - 1) / (S1 / N - 1)           otherwise      (falling)
        lr  = cycle_min_lr + (cycle_max_lr - cycle_min_lr) * s
        mom = cycle_max_mom - (cycle_max_mom - cycle_min_mom) * s

    while ``last_batch_iteration < N``; after that, with ``d = last_batch_iteration - N + 1``::

        lr  = cycle_min_lr / (1 + decay_lr_rate * d / decay_step_size)
        mom = cycle_max_mom * (1 + decay_mom_rate * d / decay_step_size)

    (lr stays ``cycle_min_lr`` / mom stays ``cycle_max_mom`` when ``decay_step_size`` or the rate is
    0). At construction lr is ``cycle_min_lr`` and mom ``cycle_min_mom`` (DeepSpeed's choice; its
    curve would give ``cycle_max_mom`` there). The momentum is written to ``betas[0]`` and only for
    optimizers whose defaults have ``betas``, as DeepSpeed does.

    Stairs: with ``cycle_first_stair_count = n > 0`` the rising half is cut into ``n`` stairs of
    ``S1 / n`` steps, and lr/mom keep the value of the start of the current stair
    (``s = floor(n * p) / n`` with ``p = x / (S1 / N)`` the position in the half); likewise for
    the falling half with ``cycle_second_stair_count`` (which defaults to the first count):
    ``s = 1 - floor(n * p) / n``. 0 keeps the half continuous. DeepSpeed ignored the stair counts
    until PR #8179; this follows that PR's tests (n equal to the half's length is the continuous
    schedule again; the counts act on their own half only).

    Args:
        optimizer: The optimizer whose param groups get lr (and betas).
        cycle_min_lr, cycle_max_lr: lr bounds of the cycle.
        decay_lr_rate: Post-cycle lr decay rate.
        cycle_first_step_size: Steps of the rising half.
        cycle_second_step_size: Steps of the falling half (None: same as the first).
        cycle_first_stair_count: Stairs in the rising half (0: continuous).
        cycle_second_stair_count: Stairs in the falling half (None: same as the first).
        decay_step_size: Interval of the post-cycle decay (0: no decay).
        cycle_momentum: Cycle ``betas[0]`` inversely to the lr.
        cycle_min_mom, cycle_max_mom: Momentum bounds.
        decay_mom_rate: Post-cycle momentum decay rate.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cycle_min_lr: float,
        cycle_max_lr: float,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
    ) -> None:
        # A zero-length first half would divide by zero; a zero-length second half is fine.
        first = float(_check_steps("cycle_first_step_size", cycle_first_step_size, minimum=1))
        if cycle_second_step_size is None:
            second = first
        else:
            second = float(_check_steps("cycle_second_step_size", cycle_second_step_size, minimum=0))
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = _check_steps("cycle_first_stair_count", cycle_first_stair_count, minimum=0)
        self.second_stair_count = (
            self.first_stair_count
            if cycle_second_stair_count is None
            else _check_steps("cycle_second_stair_count", cycle_second_stair_count, minimum=0)
        )
        self.decay_step_size = decay_step_size
        self.min_lr = float(cycle_min_lr)
        self.max_lr = float(cycle_max_lr)
        self.decay_lr_rate = float(decay_lr_rate)
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(self.decay_lr_rate, 0)
        self.min_mom = float(cycle_min_mom)
        self.max_mom = float(cycle_max_mom)
        self.decay_mom_rate = float(decay_mom_rate)
        self.skip_mom_decay = math.isclose(decay_step_size, 0) or math.isclose(self.decay_mom_rate, 0)
        self.cycle_momentum = cycle_momentum
        if cycle_momentum and "betas" not in optimizer.defaults:
            warnings.warn(
                f"OneCycle: cycle_momentum is disabled because {type(optimizer).__name__} has no "
                "betas (DeepSpeed does the same)",
                stacklevel=2,
            )
            self.cycle_momentum = False
        self._groups = _n_groups(optimizer)
        super().__init__(optimizer)

    def _scale_factor(self, it: int) -> float:
        batch_iteration = it + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            if self.first_stair_count:
                return _stair(x / self.step_ratio, self.first_stair_count)
            return x / self.step_ratio
        if self.second_stair_count:
            return 1.0 - _stair((x - self.step_ratio) / (1.0 - self.step_ratio), self.second_stair_count)
        return (x - 1) / (self.step_ratio - 1)

    def lr_at(self, batch_iteration: int) -> list[float]:
        if batch_iteration < self.total_size:
            lr = self.min_lr + (self.max_lr - self.min_lr) * self._scale_factor(batch_iteration)
        elif self.skip_lr_decay:
            lr = self.min_lr
        else:
            decay_interval = (batch_iteration - self.total_size + 1) / self.decay_step_size
            lr = self.min_lr / (1 + self.decay_lr_rate * decay_interval)
        return [lr] * self._groups

    def initial_lrs(self) -> list[float]:
        return [self.min_lr] * self._groups

    def momentum_at(self, batch_iteration: int) -> float:
        """``betas[0]`` at ``last_batch_iteration == batch_iteration`` (-1: at construction)."""
        if batch_iteration < 0:
            return self.min_mom
        if batch_iteration < self.total_size:
            return self.max_mom - (self.max_mom - self.min_mom) * self._scale_factor(batch_iteration)
        if self.skip_mom_decay:
            return self.max_mom
        decay_interval = (batch_iteration - self.total_size + 1) / self.decay_step_size
        return self.max_mom * (1 + self.decay_mom_rate * decay_interval)

    def step(self, epoch: int | None = None) -> None:
        """Advance one batch and set lr (and ``betas[0]`` when cycling momentum)."""
        super().step(epoch)
        if self.cycle_momentum:
            mom = self.momentum_at(self.last_batch_iteration)
            for group in self.optimizer.param_groups:
                group["betas"] = (mom, group["betas"][1])


class LRRangeTest(DeepSpeedLRScheduler):
    """Grow the lr from ``lr_range_test_min_lr`` to find the largest lr that still trains.

    With ``b = last_batch_iteration + 1``::

        lr = min_lr * (1 + step_rate * b / step_size)            (continuous)
        lr = min_lr * (1 + step_rate * floor(b / step_size))     (staircase)

    and ``lr = min_lr`` at construction.

    Args:
        optimizer: The optimizer whose param groups get the lr.
        lr_range_test_min_lr: Starting lr.
        lr_range_test_step_size: Steps per increase.
        lr_range_test_step_rate: Increase per interval, as a multiple of the starting lr.
        lr_range_test_staircase: Increase in steps instead of continuously.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        lr_range_test_min_lr: float = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
    ) -> None:
        self.min_lr = float(lr_range_test_min_lr)
        self.step_size = _check_steps("lr_range_test_step_size", lr_range_test_step_size, minimum=1)
        self.step_rate = float(lr_range_test_step_rate)
        self.staircase = lr_range_test_staircase
        self._groups = _n_groups(optimizer)
        super().__init__(optimizer)

    def lr_at(self, batch_iteration: int) -> list[float]:
        interval = float(batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [self.min_lr * (1 + self.step_rate * interval)] * self._groups

    def initial_lrs(self) -> list[float]:
        return [self.min_lr] * self._groups


SCHEDULER_TYPES: dict[str, tuple[type[DeepSpeedLRScheduler], type]] = {
    "WarmupLR": (WarmupLR, WarmupLRParams),
    "WarmupDecayLR": (WarmupDecayLR, WarmupDecayLRParams),
    "WarmupCosineLR": (WarmupCosineLR, WarmupCosineLRParams),
    "OneCycle": (OneCycle, OneCycleParams),
    "LRRangeTest": (LRRangeTest, LRRangeTestParams),
}
"""DeepSpeed scheduler ``type`` -> (scheduler class, params dataclass)."""


def build_scheduler(cfg: SchedulerConfig, optimizer: torch.optim.Optimizer) -> DeepSpeedLRScheduler:
    """Build the scheduler a DeepSpeed ``scheduler`` section describes, and set the starting lr.

    Call ``step()`` on it after each optimizer step that was taken (not after skipped fp16
    overflow steps), as DeepSpeed's engine does.

    Args:
        cfg: The section: ``type`` is DeepSpeed's class name (``WarmupLR``, ``WarmupDecayLR``,
            ``WarmupCosineLR``, ``OneCycle``, ``LRRangeTest``; case is ignored) and ``params`` the
            matching dataclass with every value resolved.
        optimizer: The optimizer to drive; its param groups' lrs are set at once.

    Returns:
        A ``torch.optim.lr_scheduler.LRScheduler`` subclass (:class:`DeepSpeedLRScheduler`).

    Raises:
        ValueError: unknown ``type``, ``params`` of the wrong kind, or a param still ``"auto"``.

    Example::

        >>> cfg = SchedulerConfig(type="WarmupLR", params=WarmupLRParams(warmup_max_lr=3e-4,
        ...                                                              warmup_num_steps=100))
        >>> sched = build_scheduler(cfg, optimizer)   # optimizer lr is now warmup_min_lr
    """
    by_lower = {name.lower(): name for name in SCHEDULER_TYPES}
    name = by_lower.get(cfg.type.lower())
    if name is None:
        raise ValueError(
            f"scheduler.type={cfg.type!r} is not supported; use one of {', '.join(SCHEDULER_TYPES)}"
        )
    cls, params_cls = SCHEDULER_TYPES[name]
    # WarmupDecayLRParams subclasses WarmupLRParams, so compare exact types.
    if type(cfg.params) is not params_cls:
        raise ValueError(
            f"scheduler.params for {name} must be {params_cls.__name__}, got {type(cfg.params).__name__}"
        )
    kwargs = {f.name: getattr(cfg.params, f.name) for f in dataclasses.fields(cfg.params)}
    unresolved = [k for k, v in kwargs.items() if isinstance(v, str) and v == AUTO]
    if unresolved:
        raise ValueError(
            f"scheduler.params.{', scheduler.params.'.join(unresolved)} still 'auto'; resolve the config "
            "(config/auto.py, from TrainingArguments and the number of training steps) first"
        )
    return cls(optimizer, **kwargs)


def steps_on_metrics(scheduler: Any) -> bool:
    """True for a scheduler whose ``step()`` takes a metric (``ReduceLROnPlateau``, transformers'
    ``GreedyLR``): it is stepped where the metric is known (after evaluation), not after each
    optimizer step.

    >>> steps_on_metrics(torch.optim.lr_scheduler.ReduceLROnPlateau(torch.optim.SGD([torch.zeros(1)], lr=1)))
    True
    """
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return True
    import inspect

    try:
        params = list(inspect.signature(scheduler.step).parameters.values())
    except (TypeError, ValueError, AttributeError):
        return False
    # A first parameter without a default (``step(self, metrics, epoch=None)``) is a metric.
    return bool(params) and params[0].default is inspect.Parameter.empty and params[0].kind in (
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)

