"""``ZeroTrainer``: the Hugging Face ``Trainer`` with hf_zero's engine underneath.

Same constructor and the same loop as ``Trainer``; a short list of hooks hand the work to the
:class:`~hf_zero.engine.engine.ZeroEngine`:

- ``_prepare_for_training``: builds the engine (shards the model, builds optimizer and scheduler
  from the config sections or, when absent, the Trainer's own ``optim``/``lr_scheduler_type``),
  and resumes from a sharded checkpoint.
- ``training_step``: forward under the engine's context, ``engine.backward`` (loss scaling).
- ``_clip_grad_norm`` / ``_get_grad_norm``: the engine's global norm (all ranks, unscaled).
- the optimizer/scheduler the loop sees are thin views on the engine (integration/engine_views.py):
  ``optimizer.step()`` is the engine's update (skipped on fp16 overflow, which also leaves the
  scheduler alone).
- saving and resuming (``save_model``, ``_save_checkpoint``, ``_load_from_checkpoint``...):
  integration/trainer_checkpoints.py.

Scripts written for transformers 4 and DeepSpeed also find what they read: ``Trainer(tokenizer=)``
and ``trainer.tokenizer`` (integration/versions.py), and ``is_deepspeed_enabled``,
``trainer.deepspeed`` and ``model_wrapped._zero3_consolidated_16bit_state_dict()``
(integration/deepspeed_surface.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import Seq2SeqTrainer, Trainer

from hf_zero.integration.compat_versions import LoopHooks
from hf_zero.integration.deepspeed_surface import attach_consolidated_state_dict, called_from_library
from hf_zero.integration.engine_views import EngineOptimizer, EngineScheduler
from hf_zero.integration.trainer_checkpoints import ZeroCheckpointingMixin

__all__ = ["ZeroTrainer", "ZeroSeq2SeqTrainer", "ZeroTrainerMixin"]

logger = logging.getLogger("hf_zero")


class ZeroTrainerMixin(ZeroCheckpointingMixin):
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
        from hf_zero.integration.option_checks import check_sharding_flags

        check_sharding_flags(kwargs.get("args", args[1] if len(args) > 1 else None))
        super().__init__(*args, **kwargs)
        if self.zero_enabled:
            # Check the config against the arguments now, before any model is sharded or loaded
            # onto a device: a contradiction (e.g. micro batch 4 vs --per_device_train_batch_size 2)
            # fails at construction, naming both values.
            from hf_zero.config.auto import resolve_auto

            resolve_auto(self._zero_config(), training_args=self.args, world_size=self.args.world_size)
            # Options the engine could not honour, or that the config overrides (integration/option_checks.py).
            from hf_zero.integration.option_checks import check_trainer_options

            check_trainer_options(self)
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
        from hf_zero.integration.compiled_model import compile_like_accelerate

        # --torch_compile: the plain Trainer compiles in accelerate's prepare_model, which hf_zero skips.
        compile_like_accelerate(self.model, self.accelerator.state.dynamo_plugin)
        if engine.config.stage >= 2:
            from hf_zero.integration.script_state_dict import gather_state_dicts_for_scripts

            gather_state_dicts_for_scripts(self.model, engine)  # Alpaca's trainer.model.state_dict() save
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
            self.optimizer = EngineOptimizer(engine, None)
        else:
            self.lr_scheduler = EngineScheduler(engine)
            self.optimizer = EngineOptimizer(engine, self.lr_scheduler)
        self._created_lr_scheduler = False
        model = engine.forward_module
        self.model_wrapped = model
        if not any(m is model for m in self.accelerator._models):
            # What the plain Trainer's accelerator.prepare records: the evaluation loop then sees a
            # prepared model and adds no "eval_model_preparation_time" metric, which transformers'
            # default hyperparameter-search objective would otherwise add to the eval loss.
            self.accelerator._models.append(model)
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
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):  # schedule-free
            self.optimizer.train()
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


class ZeroTrainer(LoopHooks, ZeroTrainerMixin, Trainer):
    """``transformers.Trainer`` trained by hf_zero; pass :class:`ZeroTrainingArguments`.

    Example::

        args = ZeroTrainingArguments(output_dir="out", zero_config="ds_zero3.json", bf16=True,
                                     per_device_train_batch_size=2, max_steps=100)
        trainer = ZeroTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
        trainer.train()
        trainer.save_model()        # from_pretrained-ready 16-bit weights (adapter only for peft)
    """


class ZeroSeq2SeqTrainer(LoopHooks, ZeroTrainerMixin, Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` trained by hf_zero."""
