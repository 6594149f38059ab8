"""What the Trainer loop sees as ``self.optimizer`` and ``self.lr_scheduler`` under hf_zero: thin
views on the :class:`~hf_zero.engine.engine.ZeroEngine`, which owns the real optimizer and
scheduler and steps them inside its update (skipped on an fp16 overflow)."""

from __future__ import annotations

from hf_zero.engine.optimizer_view import EngineOptimizerProxy

__all__ = ["EngineOptimizer", "EngineScheduler"]


class EngineOptimizer(EngineOptimizerProxy):
    """What the Trainer loop calls ``self.optimizer``: the engine's update behind ``step()``."""

    def __init__(self, engine, scheduler: EngineScheduler | None):
        self.engine = engine
        self.scheduler = scheduler  # None when the loop steps the real scheduler itself (plateau)

    def step(self, closure=None):
        self.engine.optimizer_step()
        if self.scheduler is not None:
            self.scheduler.lagging = True

    def zero_grad(self, set_to_none: bool = True):
        self.engine.zero_grad()

    # Schedule-free optimizers (``--optim schedule_free_*``) keep two sets of weights and swap
    # them with ``train()`` / ``eval()``; the Trainer calls them when the optimizer has them, so
    # the view has them exactly when the optimizer the engine steps does.
    @property
    def train(self):
        return self._mode_switch("train")

    @property
    def eval(self):
        return self._mode_switch("eval")

    def _mode_switch(self, name: str):
        outer = self.engine.optimizer
        local = self.engine.stage.local_optimizer(outer)
        switch = getattr(local, name, None)
        if not callable(switch):
            raise AttributeError(f"{type(local).__name__} has no {name}()")
        if local is outer:
            return switch

        def switch_partitioned(*args, **kwargs):
            # Stage 1: ZeroRedundancyOptimizer copies its own groups' settings onto the local
            # optimizer before each step, which would undo the mode flag the switch sets there
            # ("not in train mode"), and each rank switches only the parameters it owns.
            before = [dict(group) for group in local.param_groups]
            result = switch(*args, **kwargs)
            for outer_group, local_group, old in zip(outer.param_groups, local.param_groups, before):
                # only what the switch changed: the scheduler may have set a newer lr on the outer groups
                outer_group.update({k: v for k, v in local_group.items() if k != "params" and old.get(k) is not v})
            sync = getattr(outer, "_sync_params", None)
            if callable(sync):
                sync()  # every rank gets the switched weights of the others, as after a step
            return result

        return switch_partitioned


class EngineScheduler:
    """What the loop calls ``self.lr_scheduler``: the engine steps the real one inside its update
    (and not on an fp16 overflow), so ``step()`` here does nothing.

    The loop reads ``get_last_lr()`` between ``optimizer.step()`` and ``lr_scheduler.step()`` to
    log the rate the update used; the engine's scheduler has already moved on by then, so until
    the loop's ``step()`` the view answers with the rates of the last update."""

    def __init__(self, engine):
        self.engine = engine
        self.lagging = False  # the engine stepped the scheduler; the loop has not called step() yet

    def step(self, *args, **kwargs):
        self.lagging = False
        return None

    def get_last_lr(self):
        if self.lagging:
            return self.engine.get_last_step_lr()
        if self.engine.lr_scheduler is not None:
            return self.engine.lr_scheduler.get_last_lr()
        return self.engine.get_lr()

    def state_dict(self):
        return self.engine.lr_scheduler.state_dict() if self.engine.lr_scheduler is not None else {}

    def load_state_dict(self, state):
        if self.engine.lr_scheduler is not None:
            self.engine.lr_scheduler.load_state_dict(state)
