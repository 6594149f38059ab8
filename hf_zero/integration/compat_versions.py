"""Where the Trainer internals that ``ZeroTrainer`` overrides differ between the transformers
releases hf_zero supports (4.56.2 to the newest 5.x): one table, and the code for each row.

``ZeroTrainer`` is written against the transformers 5.3+ training loop, which calls a hook for
each job hf_zero takes over: ``_prepare_for_training`` (wrap the model, build optimizer and
scheduler, resume), ``_clip_grad_norm`` and ``_get_grad_norm``. Older releases (4.56, 4.57,
5.0-5.2) run the same steps inline in ``_inner_training_loop``; :class:`InlineLoopHooks` maps those
inline steps onto the same hooks, so the rest of hf_zero sees one loop. Each difference is found
by looking for the feature itself (``hasattr``), not by comparing version numbers: a backport or
a patched build then takes the right branch. The releases in :data:`CHANGES` were read from the
published wheels.

Script-level names (``--evaluation_strategy``, ``Trainer(tokenizer=)``...) are another job, kept
in ``integration/versions.py``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from transformers import Trainer

__all__ = [
    "Change",
    "CHANGES",
    "HAS_LOOP_HOOKS",
    "InlineLoopHooks",
    "LoopHooks",
    "rotate_checkpoints",
    "render_table",
]


@dataclass(frozen=True)
class Change:
    """One Trainer internal that changed, and what hf_zero does on each side of the change."""

    what: str
    """The internal, as the Trainer spells it."""
    since: str
    """The first transformers release with the current (newer) form."""
    before: str
    """What older releases have instead."""
    handling: str
    """What hf_zero does about it (and where)."""


CHANGES: tuple[Change, ...] = (
    Change(
        "Trainer._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)",
        "5.3.0",
        "the same steps inline in _inner_training_loop: create_optimizer_and_scheduler, "
        "_wrap_model(model_wrapped), accelerator.prepare(model, optimizer), _load_optimizer_and_scheduler",
        "InlineLoopHooks: create_optimizer_and_scheduler is left to the engine, the training _wrap_model call "
        "runs _prepare_for_training, accelerator.prepare passes the engine's objects through, and "
        "_load_optimizer_and_scheduler loads the sharded checkpoint",
    ),
    Change(
        "Trainer._clip_grad_norm(model) / Trainer._get_grad_norm(model, grad_norm)",
        "5.3.0",
        "accelerator.clip_grad_norm_(model.parameters(), max_grad_norm) inline in the loop",
        "InlineLoopHooks: the trainer's own accelerator answers clip_grad_norm_ with the engine's global "
        "norm (all ranks, unscaled) while the engine trains",
    ),
    Change(
        "transformers.trainer_utils.rotate_checkpoints(output_dir, save_total_limit, best_model_checkpoint, use_mtime)",
        "5.3.0",
        "the method Trainer._rotate_checkpoints(use_mtime, output_dir)",
        "rotate_checkpoints() here calls whichever the installed release has",
    ),
    Change(
        "Trainer.train(resume_from_checkpoint=...) keeps the arguments' per-device batch size",
        "5.3.0",
        "train() replaced it with the checkpoint's train_batch_size (trainer_state.json), also without "
        "--auto_find_batch_size",
        "InlineLoopHooks._inner_training_loop trains with args.train_batch_size unless --auto_find_batch_size, "
        "so a run resumed on another number of ranks uses the batch its zero config was resolved from",
    ),
    Change(
        "Trainer.loss_is_scaled_for_ga (a subclass declares whether compute_loss already divided by the "
        "accumulation steps)",
        "5.18.0",
        "no attribute; the rule: scaled when the model takes loss kwargs and num_items_in_batch is set, "
        "or compute_loss_func is set",
        "ZeroTrainer.training_step reads it with getattr and falls back to the rule (trainer subclasses "
        "written for older releases, LLaMA-Factory's included, never set it)",
    ),
)


HAS_LOOP_HOOKS = all(hasattr(Trainer, name) for name in ("_prepare_for_training", "_clip_grad_norm", "_get_grad_norm"))
"""True on transformers 5.3 and newer: the loop calls the hooks ZeroTrainer overrides."""


class InlineLoopHooks:
    """For the training loop of transformers < 5.3 (no ``_prepare_for_training`` hook): route its
    inline steps to ``ZeroTrainer``'s hooks. Every method hands over to the Trainer's own when no
    zero config is given, so the class trains exactly like ``Trainer`` then.

    The inline loop runs, in order: ``create_optimizer_and_scheduler(max_steps)``,
    ``model = _wrap_model(model_wrapped)``, ``accelerator.prepare(model, optimizer)`` (or of the
    optimizer alone when ``model`` is not ``self.model``), ``_load_optimizer_and_scheduler(ckpt)``,
    then per step ``accelerator.clip_grad_norm_(...)``, ``optimizer.step()``,
    ``lr_scheduler.step()`` unless ``accelerator.optimizer_step_was_skipped``.
    """

    _hf_zero_max_steps: int | None = None

    def _inner_training_loop(self, batch_size=None, args=None, *rest, **kwargs):
        if self.zero_enabled and args is not None and not args.auto_find_batch_size:
            # train() replaced the batch size with the checkpoint's when resuming (fixed in 5.3):
            # a run resumed on another number of ranks would train with the old per-rank batch,
            # not the one the zero config was resolved from.
            batch_size = args.train_batch_size
        return super()._inner_training_loop(batch_size, args, *rest, **kwargs)

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        if not self.zero_enabled:
            return super().create_optimizer_and_scheduler(num_training_steps)
        # The engine builds both on the shards (from the config, or the Trainer's own create_*
        # methods); building them here on the whole model would make them look user-given.
        self._hf_zero_max_steps = num_training_steps

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if self.zero_enabled and training and dataloader is None and self._hf_zero_max_steps is not None:
            # The loop's own call (_inner_training_loop: _wrap_model(self.model_wrapped)). The
            # checkpoint, if any, is loaded in _load_optimizer_and_scheduler, which the loop calls next.
            max_steps, self._hf_zero_max_steps = self._hf_zero_max_steps, None
            prepared, _ = self._prepare_for_training(max_steps, None, None)
            _pass_engine_objects_through(self)
            return prepared
        return super()._wrap_model(model, training, dataloader)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if self.zero_engine is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self._load_zero_checkpoint(checkpoint)

    def _load_scaler(self, checkpoint) -> None:
        if self.zero_engine is None:
            return super()._load_scaler(checkpoint)
        # The engine's loss scaler is part of its sharded checkpoint.


class _NoLoopHooks:
    """transformers 5.3+: the loop calls ZeroTrainer's hooks itself."""


LoopHooks: type = _NoLoopHooks if HAS_LOOP_HOOKS else InlineLoopHooks
"""The first base of ``ZeroTrainer`` and ``ZeroSeq2SeqTrainer`` (``class ZeroTrainer(LoopHooks,
ZeroTrainerMixin, Trainer)``), ahead of ``ZeroTrainerMixin`` so that its ``_wrap_model`` sees the
loop's call first: an empty class on transformers 5.3+, :class:`InlineLoopHooks` before."""


def _pass_engine_objects_through(trainer: Any) -> None:
    """Make the trainer's accelerator leave the engine's model, optimizer and scheduler views
    alone (``prepare`` would wrap the sharded model in DDP) and answer ``clip_grad_norm_`` with the
    engine's norm. Only this trainer's own ``Accelerator`` instance is changed, and only once; any
    other object (the eval dataloaders) still goes through accelerate."""
    accelerator = trainer.accelerator
    if getattr(accelerator, "_hf_zero_passthrough", False):
        return
    prepare, clip = accelerator.prepare, accelerator.clip_grad_norm_

    def engine_owns(obj: Any) -> bool:
        engine = trainer.zero_engine
        if engine is None:
            return False
        return obj is trainer.model or obj is engine.forward_module or obj is trainer.optimizer or obj is trainer.lr_scheduler

    def prepare_passing_engine(*objects: Any, **kwargs: Any):
        if objects and all(engine_owns(o) for o in objects):
            return objects[0] if len(objects) == 1 else objects
        return prepare(*objects, **kwargs)

    def clip_with_engine(parameters, max_norm, norm_type=2):
        engine = trainer.zero_engine
        if engine is None:
            return clip(parameters, max_norm, norm_type)
        if norm_type != 2:
            raise ValueError(f"hf_zero clips by the 2-norm; clip_grad_norm_ got norm_type={norm_type}")
        return engine.clip_grad_norm(max_norm)

    accelerator.prepare = prepare_passing_engine
    accelerator.clip_grad_norm_ = clip_with_engine
    accelerator._hf_zero_passthrough = True


def rotate_checkpoints(trainer: Any, run_dir: str) -> None:
    """Delete the oldest ``checkpoint-*`` folders of ``run_dir`` beyond ``--save_total_limit``
    (never the newest, nor the best), by modification time, as the Trainer's own save does."""
    try:
        from transformers.trainer_utils import rotate_checkpoints as rotate  # 5.3.0+
    except ImportError:
        return trainer._rotate_checkpoints(use_mtime=True, output_dir=run_dir)
    return rotate(
        output_dir=run_dir,
        save_total_limit=trainer.args.save_total_limit,
        best_model_checkpoint=trainer.state.best_model_checkpoint,
        use_mtime=True,
    )


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_table() -> str:
    """The markdown table of :data:`CHANGES` for ``docs/versions.md``."""
    lines = ["| Trainer internal | since | before that | hf_zero |", "| --- | --- | --- | --- |"]
    for c in CHANGES:
        lines.append(f"| `{_cell(c.what)}` | {c.since} | {_cell(c.before)} | {_cell(c.handling)} |")
    return "\n".join(lines) + "\n"


def installed_versions() -> dict[str, str]:
    """The versions of the packages hf_zero depends on, as installed (for reports and tests)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "transformers", "accelerate", "peft", "trl"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "-"
    out["python"] = ".".join(map(str, os.sys.version_info[:3]))
    return out
