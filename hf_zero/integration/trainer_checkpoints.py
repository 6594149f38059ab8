"""Saving and resuming for ``ZeroTrainer``: the Trainer's save/load hooks, answered by hf_zero.

- ``save_model``: 16-bit weights gathered to rank 0 and written as ``save_pretrained`` would (the
  adapter only for a peft model); at stage 3 without ``stage3_gather_16bit_weights_on_model_save``,
  the sharded weights and how to consolidate them.
- ``_save_checkpoint``: a Trainer checkpoint with hf_zero's sharded, resumable state in
  ``zero_state/``, written into ``checkpoint-N.incomplete`` and renamed when complete.
- ``_load_from_checkpoint`` / ``_load_rng_state``: resume from such a checkpoint on any world size.
"""

from __future__ import annotations

import logging
import os
import shutil

import torch
import torch.distributed as dist
from torch import nn
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hf_zero.integration.deepspeed_surface import check_whole_state_dict

__all__ = ["ZeroCheckpointingMixin", "ZERO_STATE_DIR"]

logger = logging.getLogger("hf_zero")

ZERO_STATE_DIR = "zero_state"
"""Sub-folder of a Trainer checkpoint that holds hf_zero's sharded state."""
TRAINER_STATE_NAME = "trainer_state.json"
SCHEDULER_NAME = "scheduler.pt"  # the Trainer's own scheduler state (a DeepSpeed run without a scheduler section)


class ZeroCheckpointingMixin:
    """The save/resume hooks of :class:`~hf_zero.integration.trainer.ZeroTrainerMixin` (which
    provides ``zero_engine`` and ``zero_enabled``)."""

    zero_engine = None

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write 16-bit weights gathered from all ranks (``from_pretrained`` loads them), or for a
        peft model the adapter only; with ``stage3_gather_16bit_weights_on_model_save: false`` at
        stage 3, say where the sharded weights are and how to consolidate them."""
        output_dir = output_dir or self.args.output_dir
        engine = self.zero_engine
        if engine is None:
            return super().save_model(output_dir, _internal_call)
        if not self._saves_gathered_weights():
            if not _internal_call:
                self._save_zero_state(output_dir)
            if self.args.should_save:
                logger.warning(
                    "stage3_gather_16bit_weights_on_model_save is false: %s holds sharded weights only "
                    "(%s/); turn them into a from_pretrained folder with: hf-zero consolidate %s OUT_DIR",
                    output_dir, ZERO_STATE_DIR, output_dir,
                )
            return
        key_filter = None
        if _is_peft_model(self.model):
            # The adapter is all that is written; gathering the frozen base would cost a full copy.
            trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
            key_filter = trainable.__contains__
        from hf_zero.checkpoint.export16 import save_16bit_model

        # One tensor at a time on the writing rank (not the whole model, as save_pretrained would
        # need), into a folder beside output_dir that is renamed in when complete.
        save_16bit_model(
            engine,
            output_dir,
            dtype=engine.precision.compute_dtype,
            max_shard_size=self._save_max_shard_size(),
            is_main_process=self.args.should_save,
            state_dict_filter=key_filter,
            extra_files=self._write_trainer_files,
            progress=not _internal_call and not self.args.disable_tqdm,
        )

    def _saves_gathered_weights(self) -> bool:
        """False at stage 3 with ``stage3_gather_16bit_weights_on_model_save: false``: ``save_model``
        then writes sharded weights (``zero_state/``), not a ``from_pretrained`` folder."""
        config = self.zero_engine.config
        return config.stage < 3 or bool(config.zero_optimization.gather_16bit_weights_on_model_save)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        # Scripts call _save(dir, state_dict=...) themselves (Qwen, Alpaca); sharded values there
        # would be written as one rank's slices.
        if state_dict is not None and self.zero_engine is not None:
            check_whole_state_dict(state_dict, "Trainer._save")
        return super()._save(output_dir, state_dict)

    save_max_shard_size: int | str | None = None
    """Largest weights file ``save_model`` writes; None: what ``save_pretrained`` uses by default."""

    def _save_max_shard_size(self) -> int | str:
        if self.save_max_shard_size is not None:
            return self.save_max_shard_size
        import inspect

        from hf_zero.checkpoint.export16 import unwrap_model

        save_pretrained = getattr(unwrap_model(self.model), "save_pretrained", None)
        try:
            default = inspect.signature(save_pretrained).parameters["max_shard_size"].default
        except (TypeError, ValueError, KeyError):  # not a PreTrainedModel: one file unless it is huge
            default = inspect.Parameter.empty
        return default if isinstance(default, (int, str)) else "5GB"

    def _write_trainer_files(self, directory: str) -> list[str]:
        """What ``Trainer._save`` writes beside the weights: the tokenizer/processor and the
        arguments (``training_args.bin``, which hf_zero itself never reads back)."""
        from transformers.trainer import TRAINING_ARGS_NAME

        before = set(os.listdir(directory))
        if self.processing_class is not None:
            self.processing_class.save_pretrained(directory)
        elif getattr(self.data_collator, "tokenizer", None) is not None:
            self.data_collator.tokenizer.save_pretrained(directory)
        torch.save(self.args, os.path.join(directory, TRAINING_ARGS_NAME))
        return sorted(set(os.listdir(directory)) - before)

    def _save_zero_state(self, output_dir: str) -> None:
        from hf_zero.checkpoint.sharded import save_checkpoint

        save_checkpoint(self.zero_engine, os.path.join(output_dir, ZERO_STATE_DIR))

    def _save_checkpoint(self, model: nn.Module, trial) -> None:
        """A Trainer checkpoint written into ``checkpoint-N.incomplete`` and renamed to
        ``checkpoint-N`` only when every part is on disk."""
        if self.zero_engine is None:
            return super()._save_checkpoint(model, trial)
        from transformers.trainer_callback import ExportableState
        from transformers.trainer_utils import SaveStrategy
        from hf_zero.integration.compat_versions import rotate_checkpoints

        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        final_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        work_dir = final_dir + ".incomplete"
        from hf_zero.checkpoint.atomic_dir import recover_replaced, replace_directory
        from hf_zero.checkpoint.sharded import agree_on_error

        error = None
        if self.args.should_save:
            try:
                recover_replaced(run_dir)
                # Work folders of saves that were killed: never complete, and as big as a checkpoint.
                for name in os.listdir(run_dir) if os.path.isdir(run_dir) else ():
                    if name.startswith(f"{PREFIX_CHECKPOINT_DIR}-") and name.endswith(".incomplete"):
                        shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)
                os.makedirs(work_dir)
            except Exception as exc:
                error = exc
        agree_on_error(error, f"creating {work_dir}")

        self.save_model(work_dir, _internal_call=True)
        if not self.args.save_only_model:
            self._save_zero_state(work_dir)
        elif not self._saves_gathered_weights():
            # --save_only_model at stage 3 without gathered 16-bit weights: the sharded weights
            # are the model this checkpoint holds (no optimizer state, no RNG).
            from hf_zero.checkpoint.sharded import save_checkpoint

            save_checkpoint(self.zero_engine, os.path.join(work_dir, ZERO_STATE_DIR), model_only=True)
        _barrier()  # every rank's sharded-state files are on disk before the checkpoint is completed
        error = None
        if self.args.should_save:
            try:
                for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
                    name = cb.__class__.__name__
                    if isinstance(self.state.stateful_callbacks.get(name), list):
                        self.state.stateful_callbacks[name].append(cb.state())
                    else:
                        self.state.stateful_callbacks[name] = cb.state()
                self.state.save_to_json(os.path.join(work_dir, TRAINER_STATE_NAME))
                # Only now is the checkpoint complete: the rename makes it visible as checkpoint-N,
                # swapped with an existing checkpoint-N so that one of them is always there.
                replace_directory(work_dir, final_dir)
            except Exception as exc:
                error = exc
        agree_on_error(error, f"finishing checkpoint {final_dir}")

        if self.args.save_strategy in [SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST] and self.state.best_global_step:
            best_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if os.path.exists(best_dir):
                self.state.best_model_checkpoint = best_dir
        if self.args.should_save:
            rotate_checkpoints(self, run_dir)  # transformers' own, wherever the release keeps it

    # ------------------------------------------------------------------------------- resuming
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        # Called by train() before the engine exists: only check the folder, so a bad path fails
        # before any work; the state is loaded once the model is sharded (_prepare_for_training).
        if not self.zero_enabled:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        from hf_zero.checkpoint.sharded import read_marker

        if not os.path.isdir(resume_from_checkpoint):
            raise FileNotFoundError(f"resume_from_checkpoint: {resume_from_checkpoint} does not exist")
        zero_state = os.path.join(resume_from_checkpoint, ZERO_STATE_DIR)
        if _is_deepspeed_checkpoint(resume_from_checkpoint):
            # DeepSpeed's own checkpoint: its files are checked (and refused, if crafted or of a
            # layout hf_zero does not read) here, before any work; loaded in _load_zero_checkpoint.
            from hf_zero.checkpoint.deepspeed_files.layout import find_deepspeed_checkpoint

            find_deepspeed_checkpoint(resume_from_checkpoint)
            return
        if not os.path.isdir(zero_state) and os.path.isfile(os.path.join(resume_from_checkpoint, TRAINER_STATE_NAME)):
            # A complete Trainer checkpoint without hf_zero's state: written with --save_only_model
            # (or by another trainer). The plain Trainer would load the weights and restart the
            # optimizer and the schedule from zero under the saved step count.
            raise ValueError(
                f"resume_from_checkpoint: {resume_from_checkpoint} holds the model's weights but no training "
                f"state ({ZERO_STATE_DIR}/ is missing: saved with --save_only_model, or not by hf_zero), so "
                "training cannot resume from it (transformers documents the same for --save_only_model). "
                "Start a new run from these weights with from_pretrained, or save without --save_only_model"
            )
        info = read_marker(zero_state)
        if info.get("model_only"):
            raise ValueError(
                f"resume_from_checkpoint: {resume_from_checkpoint} was saved with --save_only_model: "
                f"{ZERO_STATE_DIR}/ holds the sharded weights only, no optimizer state, so training cannot "
                f"resume from it. Turn it into a from_pretrained folder with `hf-zero consolidate "
                f"{resume_from_checkpoint} OUT_DIR`, or save without --save_only_model"
            )

    def _load_best_model(self) -> None:
        """``--load_best_model_at_end``: the engine's state at the best checkpoint (weights, their
        fp32 masters and the optimizer state, as DeepSpeed's ``load_checkpoint`` restores them);
        the Trainer's own loader would call ``load_state_dict`` on sharded parameters."""
        if self.zero_engine is None:
            return super()._load_best_model()
        from hf_zero.checkpoint.sharded import load_checkpoint

        best = self.state.best_model_checkpoint
        logger.info("hf_zero: loading the best model from %s (score: %s)", best, self.state.best_metric)
        load_checkpoint(self.zero_engine, os.path.join(best, ZERO_STATE_DIR), restore_rng=False)

    def _load_zero_checkpoint(self, checkpoint: str) -> None:
        if _is_deepspeed_checkpoint(checkpoint):
            self._load_deepspeed_checkpoint(checkpoint)
            return
        from hf_zero.checkpoint.sharded import load_checkpoint

        load_checkpoint(self.zero_engine, os.path.join(checkpoint, ZERO_STATE_DIR))

    def _load_deepspeed_checkpoint(self, checkpoint: str) -> None:
        """A run DeepSpeed saved (``latest`` + ``global_stepN/``): weights, Adam's state, learning
        rates, loss scaler and counters from DeepSpeed's files (without running code from them);
        the schedule from DeepSpeed's ``lr_scheduler`` entry or, for the Trainer's own scheduler,
        ``scheduler.pt`` (``weights_only``). The RNG states are the Trainer's ``rng_state_R.pth``."""
        from hf_zero.checkpoint.deepspeed_files.engine_state import load_deepspeed_checkpoint
        from hf_zero.checkpoint.safe_load import load_torch_file

        engine = self.zero_engine
        layout = load_deepspeed_checkpoint(engine, checkpoint)
        if engine.lr_scheduler is None:
            return
        saved = layout.model_state.get("lr_scheduler")
        source = f"{layout.model_files[0]} (lr_scheduler)"
        if saved is None and os.path.isfile(os.path.join(checkpoint, SCHEDULER_NAME)):
            source = os.path.join(checkpoint, SCHEDULER_NAME)
            saved = load_torch_file(source)
        if saved is None:
            logger.warning("hf_zero: %s holds no learning-rate schedule state; the schedule starts afresh", checkpoint)
            return
        try:
            engine.lr_scheduler.load_state_dict(saved)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(
                f"resume_from_checkpoint: the schedule state in {source} does not fit this run's scheduler "
                f"({type(engine.lr_scheduler).__name__}: {exc}); resume with the scheduler the DeepSpeed run used"
            ) from exc

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not self.zero_enabled:
            return super()._load_rng_state(checkpoint)
        if checkpoint is None:
            return
        if _is_deepspeed_checkpoint(checkpoint):
            return super()._load_rng_state(checkpoint)  # rng_state_R.pth, read by transformers with weights_only
        from hf_zero.checkpoint.sharded import load_rng_state

        load_rng_state(os.path.join(checkpoint, ZERO_STATE_DIR))


def _is_deepspeed_checkpoint(checkpoint: str) -> bool:
    """A Trainer checkpoint DeepSpeed wrote (``latest`` + ``global_stepN/``), not hf_zero's."""
    from hf_zero.checkpoint.deepspeed_files.layout import is_deepspeed_checkpoint

    return not os.path.isdir(os.path.join(checkpoint, ZERO_STATE_DIR)) and is_deepspeed_checkpoint(checkpoint)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)
