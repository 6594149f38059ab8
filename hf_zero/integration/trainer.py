"""``ZeroTrainer``: the Hugging Face ``Trainer`` with hf_zero's engine underneath.

Same constructor and the same loop as ``Trainer``; a short list of hooks hand the work to the
:class:`~hf_zero.engine.engine.ZeroEngine`:

- ``_prepare_for_training``: builds the engine (shards the model, builds optimizer and scheduler
  from the config sections or, when absent, the Trainer's own ``optim``/``lr_scheduler_type``),
  and resumes from a sharded checkpoint.
- ``training_step``: forward under the engine's context, ``engine.backward`` (loss scaling).
- ``_clip_grad_norm`` / ``_get_grad_norm``: the engine's global norm (all ranks, unscaled).
- the optimizer/scheduler the loop sees are thin views on the engine: ``optimizer.step()`` is
  the engine's update (skipped on fp16 overflow, which also leaves the scheduler alone).
- ``save_model``: 16-bit weights gathered to rank 0 and written by ``save_pretrained`` (adapter
  only for peft models); ``_save_checkpoint``: a sharded, resumable, atomically written checkpoint.

Scripts written for transformers 4 and DeepSpeed also find what they read: ``Trainer(tokenizer=)``
and ``trainer.tokenizer`` (integration/versions.py), and ``is_deepspeed_enabled``,
``trainer.deepspeed`` and ``model_wrapped._zero3_consolidated_16bit_state_dict()``
(integration/deepspeed_surface.py).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import Seq2SeqTrainer, Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hf_zero.integration.deepspeed_surface import (
    attach_consolidated_state_dict,
    called_from_library,
    check_whole_state_dict,
)

__all__ = ["ZeroTrainer", "ZeroSeq2SeqTrainer", "ZeroTrainerMixin"]

logger = logging.getLogger("hf_zero")

ZERO_STATE_DIR = "zero_state"
"""Sub-folder of a Trainer checkpoint that holds hf_zero's sharded state."""
TRAINER_STATE_NAME = "trainer_state.json"


class _EngineOptimizer:
    """What the Trainer loop calls ``self.optimizer``: the engine's update behind ``step()``."""

    def __init__(self, engine, scheduler: _EngineScheduler | None):
        self.engine = engine
        self.scheduler = scheduler  # None when the loop steps the real scheduler itself (plateau)

    @property
    def param_groups(self):
        return self.engine.optimizer.param_groups

    @property
    def state(self):
        return self.engine.optimizer.state

    @property
    def defaults(self):
        return self.engine.optimizer.defaults

    def step(self, closure=None):
        self.engine.optimizer_step()
        if self.scheduler is not None:
            self.scheduler.lagging = True

    def zero_grad(self, set_to_none: bool = True):
        self.engine.zero_grad()

    def state_dict(self):
        return self.engine.optimizer.state_dict()

    def load_state_dict(self, state):
        self.engine.optimizer.load_state_dict(state)

    @property
    def step_was_skipped(self) -> bool:
        return self.engine.last_step_skipped


class _EngineScheduler:
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


class ZeroTrainerMixin:
    """The hf_zero hooks; mixed into ``Trainer`` (``ZeroTrainer``) and ``Seq2SeqTrainer``."""

    zero_engine = None

    engine_listeners: list[Callable[[Any], None]] = []
    """Called with the trainer each time it builds an engine (the model is sharded then).
    hf_zero's DeepSpeed API registers here to tag parameters the way DeepSpeed does (``ds_id``,
    ``ds_status``...); the trainer itself never imports that API."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if "tokenizer" in kwargs:
            # transformers 4's name for processing_class (removed in 5.0.0; integration/versions.py).
            tokenizer = kwargs.pop("tokenizer")
            if kwargs.get("processing_class") is not None and tokenizer is not None:
                raise ValueError("Trainer got both tokenizer= and processing_class=; pass processing_class only")
            if tokenizer is not None:
                kwargs["processing_class"] = tokenizer
        super().__init__(*args, **kwargs)
        if self.zero_enabled:
            # Check the config against the arguments now, before any model is sharded or loaded
            # onto a device: a contradiction (e.g. micro batch 4 vs --per_device_train_batch_size 2)
            # fails at construction, naming both values.
            from hf_zero.config.auto import resolve_auto

            resolve_auto(self._zero_config(), training_args=self.args, world_size=self.args.world_size)
            if self._zero_config().stage >= 1 and getattr(self.args, "fsdp", None):
                raise ValueError("--fsdp and --zero_config both shard the model; pass only one of them")
            # Reference/reward/teacher models prepared for evaluation (TRL) are placed by hf_zero.
            from hf_zero.integration.frozen_models import route_frozen_models

            route_frozen_models(self)
            if self.args.should_save:
                # A save killed between moving checkpoint-N aside and renaming its successor in
                # (filesystems without an atomic swap): checkpoint-N is put back before any resume.
                from hf_zero.checkpoint.atomic_dir import recover_replaced

                recover_replaced(self.args.output_dir)

    # ------------------------------------------------------------------------------- set-up
    def _zero_config(self):
        parsed = getattr(self.args, "parsed_zero_config", None)
        if parsed is None:
            raise ValueError(
                "ZeroTrainer needs a zero config: build the arguments with "
                "hf_zero.ZeroTrainingArguments(..., zero_config='ds_config.json') or pass --zero_config"
            )
        return parsed

    def _build_zero_engine(self, max_steps: int | None, for_training: bool) -> None:
        from hf_zero.engine.initialize import initialize

        config = self._zero_config()
        optimizer = lr_scheduler = None
        if for_training:
            if config.optimizer is None:
                # The Trainer's own optimizer (its decay/no-decay groups), rebuilt on the shards.
                optimizer = self.optimizer if self.optimizer is not None else self.create_optimizer()
            if config.scheduler is None:
                lr_scheduler = self._trainer_scheduler_factory(max_steps)
        self.zero_engine = initialize(
            self.model,
            config,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            training_args=self.args,
            num_training_steps=max_steps,
        )
        engine = self.zero_engine
        attach_consolidated_state_dict(engine.forward_module, engine)
        for listener in ZeroTrainerMixin.engine_listeners:
            listener(self)
        if engine.config.stage >= 2 and hasattr(self.model, "generate") and not getattr(self.model, "_hf_zero_generate", False):
            # generate() is not a forward, so FSDP2 would not gather the parameters for it. Once
            # per model: a second trainer on the same model must not wrap it twice.
            from torch.distributed.fsdp import register_fsdp_forward_method

            register_fsdp_forward_method(self.model, "generate")
            self.model._hf_zero_generate = True

    def _trainer_scheduler_factory(self, max_steps):
        user_scheduler = self.lr_scheduler

        def make(optimizer):
            if user_scheduler is not None:
                from hf_zero.engine.engine import _rebind_scheduler

                return _rebind_scheduler(user_scheduler, optimizer)
            self.lr_scheduler = None
            return Trainer.create_scheduler(self, num_training_steps=max_steps, optimizer=optimizer)

        return make

    @property
    def zero_enabled(self) -> bool:
        """True when the arguments carry a zero config (else this is a plain Trainer)."""
        return getattr(self.args, "parsed_zero_config", None) is not None

    # ------------------------------------------------------------------------------- transformers 4 / DeepSpeed surface
    @property
    def tokenizer(self):
        """transformers 4's name for ``processing_class`` (removed in 5.0.0)."""
        return self.processing_class

    @tokenizer.setter
    def tokenizer(self, value) -> None:
        self.processing_class = value

    @property
    def is_deepspeed_enabled(self) -> bool:
        """For a script: true when hf_zero's ZeRO engine trains the model, as it would be under
        DeepSpeed (its save branches then lead to ``save_model``). For transformers, TRL and the
        other libraries: accelerate's answer (false: there is no DeepSpeed plugin, and their
        DeepSpeed branches would call DeepSpeed itself). See integration/deepspeed_surface.py."""
        if self.zero_enabled and not called_from_library(depth=2):
            return True
        return self.__dict__.get("_accelerate_is_deepspeed_enabled", False)

    @is_deepspeed_enabled.setter
    def is_deepspeed_enabled(self, value: bool) -> None:
        # Trainer.create_accelerator_and_postprocess stores accelerate's answer here.
        self.__dict__["_accelerate_is_deepspeed_enabled"] = value

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        if not self.zero_enabled:
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if self.zero_engine is not None and not self._engine_holds(self.model):
            # model_init built a fresh model for this train() (a second call, a hyperparameter
            # trial): the old engine trains the old model, so the new one needs its own engine.
            # Reusing it would train nothing that the user gets back.
            self.zero_engine.close()
            self.zero_engine = None
        if self.zero_engine is not None and self.zero_engine.optimizer is None:
            # Sharded for evaluation before train(): a training engine re-uses the shards, except
            # with offload, where the evaluation engine's host copies are not master weights.
            if self.zero_engine.offload is not None:
                raise RuntimeError(
                    "the model was sharded for evaluation (with offload) before train(); build the "
                    "ZeroTrainer anew to train it, or call train() before evaluate()"
                )
            self.zero_engine.close()
            self.zero_engine = None
        if self.zero_engine is None:
            self._build_zero_engine(max_steps, for_training=True)
        engine = self.zero_engine
        from hf_zero.optim.schedulers import steps_on_metrics

        if engine.lr_scheduler is not None and steps_on_metrics(engine.lr_scheduler):
            # ReduceLROnPlateau & co.: the loop knows them by type and steps them with the eval
            # metric, as with the plain Trainer; the engine leaves them alone.
            self.lr_scheduler = engine.lr_scheduler
            self.optimizer = _EngineOptimizer(engine, None)
        else:
            self.lr_scheduler = _EngineScheduler(engine)
            self.optimizer = _EngineOptimizer(engine, self.lr_scheduler)
        self._created_lr_scheduler = False
        model = engine.forward_module
        self.model_wrapped = model
        # DeepSpeed scripts test ``trainer.deepspeed`` (LLaVA's save) and call methods on it; the
        # Trainer's own reads of it sit behind is_deepspeed_enabled, which stays false for it.
        self.deepspeed = model
        if resume_from_checkpoint is not None:
            self._load_zero_checkpoint(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return model, train_dataloader

    def _engine_holds(self, model: nn.Module) -> bool:
        from hf_zero.checkpoint.export16 import unwrap_model

        return unwrap_model(self.zero_engine) is unwrap_model(model)

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None) -> nn.Module:
        if not self.zero_enabled:
            return super()._wrap_model(model, training, dataloader)
        if self.zero_engine is None and not training and self._zero_config().stage >= 2:
            # Evaluation before training: shard now, so no rank holds the whole model.
            self._build_zero_engine(None, for_training=False)
        if self.zero_engine is not None:
            return self.zero_engine.forward_module if training else self.model
        return model

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True):
        if self.zero_engine is not None:
            return self.zero_engine.stage.forward_context()
        return super().autocast_smart_context_manager(cache_enabled)

    # ------------------------------------------------------------------------------- training
    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        if self.zero_engine is None:
            return super().training_step(model, inputs, num_items_in_batch)
        engine = self.zero_engine
        model.train()
        inputs = self._prepare_inputs(inputs)
        # The loop decides where accumulation windows end (also for a short last window).
        engine.set_gradient_accumulation_boundary(self.accelerator.sync_gradients)
        with engine.forward_context():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        if self.args.n_gpu > 1:
            loss = loss.mean()
        # ``loss_is_scaled_for_ga`` is newer than transformers 5.17; before it, the rule below was the only one.
        declared = getattr(self, "loss_is_scaled_for_ga", None)
        if declared is not None:
            scaled_for_ga = declared
        else:
            scaled_for_ga = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
                self.compute_loss_func is not None
            )
        if not scaled_for_ga:
            loss = loss / self.current_gradient_accumulation_steps
        engine.backward(loss, scale_wrt_gas=False)
        return loss.detach()

    def _clip_grad_norm(self, model):
        if self.zero_engine is None:
            return super()._clip_grad_norm(model)
        return self.zero_engine.clip_grad_norm(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if self.zero_engine is None:
            return super()._get_grad_norm(model, grad_norm)
        if grad_norm is None:
            grad_norm = self.zero_engine.clip_grad_norm(0.0)  # norm only
        return float(grad_norm)

    # ------------------------------------------------------------------------------- saving
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write 16-bit weights gathered from all ranks (``from_pretrained`` loads them), or for a
        peft model the adapter only; with ``stage3_gather_16bit_weights_on_model_save: false`` at
        stage 3, say where the sharded weights are and how to consolidate them."""
        output_dir = output_dir or self.args.output_dir
        engine = self.zero_engine
        if engine is None:
            return super().save_model(output_dir, _internal_call)
        gather = engine.config.zero_optimization.gather_16bit_weights_on_model_save or engine.config.stage < 3
        if not gather:
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
        from transformers.trainer import rotate_checkpoints

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
        self._save_zero_state(work_dir)
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
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )

    # ------------------------------------------------------------------------------- resuming
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        # Called by train() before the engine exists: only check the folder, so a bad path fails
        # before any work; the state is loaded once the model is sharded (_prepare_for_training).
        if not self.zero_enabled:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        from hf_zero.checkpoint.sharded import read_marker

        if not os.path.isdir(resume_from_checkpoint):
            raise FileNotFoundError(f"resume_from_checkpoint: {resume_from_checkpoint} does not exist")
        read_marker(os.path.join(resume_from_checkpoint, ZERO_STATE_DIR))

    def _load_zero_checkpoint(self, checkpoint: str) -> None:
        from hf_zero.checkpoint.sharded import load_checkpoint

        load_checkpoint(self.zero_engine, os.path.join(checkpoint, ZERO_STATE_DIR))

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not self.zero_enabled:
            return super()._load_rng_state(checkpoint)
        if checkpoint is None:
            return
        from hf_zero.checkpoint.sharded import load_rng_state

        load_rng_state(os.path.join(checkpoint, ZERO_STATE_DIR))


def _is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class ZeroTrainer(ZeroTrainerMixin, Trainer):
    """``transformers.Trainer`` trained by hf_zero; pass :class:`ZeroTrainingArguments`.

    Example::

        args = ZeroTrainingArguments(output_dir="out", zero_config="ds_zero3.json", bf16=True,
                                     per_device_train_batch_size=2, max_steps=100)
        trainer = ZeroTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
        trainer.train()
        trainer.save_model()        # from_pretrained-ready 16-bit weights (adapter only for peft)
    """


class ZeroSeq2SeqTrainer(ZeroTrainerMixin, Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` trained by hf_zero."""
