"""What ``Accelerator.prepare`` returns under the hand-off: the model, optimizer and scheduler the
user's loop keeps calling, as thin views on the :class:`~hf_zero.engine.engine.ZeroEngine`.

accelerate's own objects do the same job around DDP/FSDP (``AcceleratedOptimizer`` steps only when
``accelerator.sync_gradients``; ``AcceleratedScheduler`` steps only after a real optimizer step);
these keep accelerate's rules and put the engine behind them.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from hf_zero.engine.optimizer_view import EngineOptimizerProxy

__all__ = ["EngineModel", "EngineOptimizerView", "EngineSchedulerView"]


class EngineModel(nn.Module):
    """The prepared model: ``model(**batch)`` runs the engine's forward (DDP at stages 0/1, the
    FSDP2-sharded model at 2/3) with the accumulation boundary accelerate decided
    (``accelerator.sync_gradients``). Attributes the wrapper lacks (``config``, ``generate``...)
    are the user's model's, as they are through accelerate's DDP wrapper after ``unwrap_model``.

    Attributes:
        module: the user's model (sharded in place at stages 2/3), what ``unwrap_model`` returns.
    """

    def __init__(self, engine: Any, accelerator: Any):
        super().__init__()
        self.module = engine.module
        # Not registered as submodules or parameters: the engine and accelerator are not weights.
        object.__setattr__(self, "engine", engine)
        object.__setattr__(self, "_accelerator", accelerator)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.engine.set_gradient_accumulation_boundary(bool(self._accelerator.sync_gradients))
        return self.engine.forward(*args, **kwargs)

    def no_sync(self):
        """``accelerator.accumulate``/``no_sync`` look for this; the engine already skips the
        reduction on micro-steps that are not accumulation boundaries."""
        return contextlib.nullcontext()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)


class EngineOptimizerView(EngineOptimizerProxy):
    """The prepared optimizer: ``step()``/``zero_grad()`` act at accumulation boundaries only
    (accelerate's ``AcceleratedOptimizer`` rule); ``step()`` is the engine's update (overflow check,
    clipping from the config, the optimizer over the shards)."""

    def __init__(self, engine: Any, accelerator: Any):
        self.engine = engine
        self.accelerator = accelerator
        self._stepped = False

    @property
    def optimizer(self):
        """The optimizer the engine steps (rebuilt on the shards from the one the script made)."""
        return self.engine.optimizer

    def step(self, closure: Any = None) -> None:
        if self.accelerator.sync_gradients:
            self.engine.optimizer_step()
            self._stepped = True

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if self.accelerator.sync_gradients:
            self.engine.zero_grad()

    def __repr__(self) -> str:
        return f"EngineOptimizerView({self.engine.optimizer!r})"


class EngineSchedulerView:
    """The prepared scheduler when the config has a ``scheduler`` section: the engine steps it in
    its update, so ``step()`` here does nothing."""

    def __init__(self, engine: Any):
        self.engine = engine

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        return self.engine.lr_scheduler.get_last_lr()

    def state_dict(self) -> dict:
        return self.engine.lr_scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.engine.lr_scheduler.load_state_dict(state)
