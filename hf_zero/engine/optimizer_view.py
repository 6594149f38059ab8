"""The part every "optimizer" view on a :class:`~hf_zero.engine.engine.ZeroEngine` shares: what a
loop reads from ``optimizer`` (groups for the learning rate, state, defaults, state dicts, whether
the last update was skipped) comes from the optimizer the engine steps. The Trainer's view
(``integration/engine_views.py``) and the Accelerator hand-off's (``accelerate_support/views.py``)
add their own ``step()``/``zero_grad()`` rules on top."""

from __future__ import annotations

from typing import Any

__all__ = ["EngineOptimizerProxy"]


class EngineOptimizerProxy:
    """Reads forwarded to ``engine.optimizer``; subclasses define ``step`` and ``zero_grad``."""

    engine: Any

    @property
    def param_groups(self):
        return self.engine.optimizer.param_groups

    @property
    def state(self):
        return self.engine.optimizer.state

    @property
    def defaults(self):
        return self.engine.optimizer.defaults

    def state_dict(self) -> dict:
        return self.engine.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.engine.optimizer.load_state_dict(state)

    @property
    def step_was_skipped(self) -> bool:
        """True when the last update was skipped (an fp16 overflow)."""
        return self.engine.last_step_skipped
