"""Second models a trainer prepares for evaluation only (TRL's reference models, GRPO's reward
models, a distillation teacher) go through :func:`hf_zero.prepare_frozen_model`.

TRL (and trainers written like it) prepare them with the Trainer's accelerator:
``self.accelerator.prepare_model(ref_model, evaluation_mode=True)`` when DeepSpeed and FSDP are
off, which is what accelerate sees under hf_zero. accelerate would only move the model to the
device: at stage 3 that fails on the ranks where low-memory loading built it on the meta device
("Cannot copy out of meta tensor"), and at stages 2/3 its parameters would not match the sharded
policy's. accelerate has no extension point for this, so the trainer's own accelerator instance
gets a ``prepare_model`` that sends such models to hf_zero (nothing else changes: the trained
model and every other call go to accelerate as before).
"""

from __future__ import annotations

from typing import Any

__all__ = ["route_frozen_models"]


def route_frozen_models(trainer: Any) -> None:
    """Wrap ``trainer.accelerator.prepare_model`` so that ``evaluation_mode=True`` calls for a
    model other than the one the trainer trains are placed by ``prepare_frozen_model``.
    Idempotent; a no-op when the trainer has no zero config."""
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is None or getattr(accelerator.prepare_model, "_hf_zero_routes_frozen", False):
        return
    original = accelerator.prepare_model

    def prepare_model(model: Any, device_placement: bool | None = None, evaluation_mode: bool = False) -> Any:
        if evaluation_mode and trainer.zero_enabled and not _is_trained_model(trainer, model):
            from hf_zero.engine.frozen import prepare_frozen_model

            return prepare_frozen_model(model, trainer._zero_config(), trainer.args)
        return original(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    prepare_model._hf_zero_routes_frozen = True  # type: ignore[attr-defined]
    accelerator.prepare_model = prepare_model


def _is_trained_model(trainer: Any, model: Any) -> bool:
    """The trainer's own model (or its wrapper): the engine places that one."""
    engine = getattr(trainer, "zero_engine", None)
    held = [getattr(trainer, "model", None), getattr(trainer, "model_wrapped", None)]
    if engine is not None:
        held += [engine.module, engine.forward_module]
    return any(model is m for m in held if m is not None)
