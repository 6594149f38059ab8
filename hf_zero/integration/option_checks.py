"""Trainer options checked against the zero config when a ``ZeroTrainer`` is built.

Each check here stands for a run that would otherwise differ from what the user asked for without
a word: a Trainer option hf_zero's engine cannot honour is refused, naming the option and what to
use instead; one the zero config overrides (as under DeepSpeed) is logged once.

- ``--fsdp``: the Trainer's FSDP wrapping never runs under hf_zero (the engine shards, or at stage
  0 replicates, the model itself), so the flag would be ignored at stage 0 and conflict at 1-3.
- ``optimizers=(...)`` or ``optimizer_cls_and_kwargs=`` beside an ``optimizer`` section, or a
  scheduler passed in beside a ``scheduler`` section: one of the two would be dropped.
- ``--optim`` / ``--lr_scheduler_type`` set beside a config section: the section wins, as it does
  under DeepSpeed (transformers' ``deepspeed_optim_sched``); logged.
- ``--optim lomo|adalomo`` and the ``*_layerwise`` optimizers update the weights inside the
  backward pass, from per-parameter hooks; hf_zero's engine updates after the gradients of all
  ranks are reduced, so they cannot run under it.
- ``--optim grokadamw`` at stage 1 or with an offloaded optimizer: GrokAdamW's per-parameter beta
  depends on the parameter's position in its group, and there each rank steps a reordered subset of
  every group, so the updates would silently differ from the plain run.
- ``--save_only_model`` with ``--load_best_model_at_end``: the best checkpoint would have no
  resumable state to load back (refused by transformers for DeepSpeed and FSDP alike).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

__all__ = ["check_trainer_options", "check_sharding_flags"]

logger = logging.getLogger("hf_zero")

_IN_BACKWARD_OPTIMIZERS = ("lomo", "adalomo")


def _default(args: Any, name: str) -> Any:
    for f in dataclasses.fields(args):
        if f.name == name:
            return f.default
    return None


def _value(option: Any) -> str:
    return str(getattr(option, "value", option))


def check_sharding_flags(args: Any) -> None:
    """Raise ``ValueError`` when ``--fsdp`` is set beside a zero config. Called before the
    Trainer's own ``__init__`` too, whose FSDP checks would otherwise answer first with a message
    about FSDP alone."""
    config = getattr(args, "parsed_zero_config", None)
    if config is not None and getattr(args, "fsdp", None):
        raise ValueError(
            f"--fsdp and --zero_config both set how the model is sharded (the zero config {config.source} "
            f"is stage {config.stage}); pass only one of them (stages 2/3 are FSDP2 fully_shard already)"
        )


def check_trainer_options(trainer: Any) -> None:
    """Raise ``ValueError`` for a Trainer option that hf_zero would silently not honour under the
    trainer's zero config; log the options the config overrides.

    Example::

        >>> ZeroTrainer(model, args, optimizers=(sgd, None))   # config with an "optimizer" section
        ValueError: Trainer(optimizers=...) was given an optimizer (SGD) and the zero config ... has
        an "optimizer" section ...
    """
    args = trainer.args
    config = args.parsed_zero_config
    where = f"the zero config {config.source}"
    check_sharding_flags(args)
    if config.optimizer is not None:
        if trainer.optimizer is not None:
            raise ValueError(
                f"Trainer(optimizers=...) was given an optimizer ({type(trainer.optimizer).__name__}) and "
                f"{where} has an \"optimizer\" section ({config.optimizer.type}); hf_zero would use one "
                "and drop the other. Remove the section to train with the optimizer you pass (hf_zero "
                "rebuilds it on the shards), or do not pass it"
            )
        if getattr(trainer, "optimizer_cls_and_kwargs", None) is not None:
            raise ValueError(
                f"Trainer(optimizer_cls_and_kwargs=...) and the \"optimizer\" section of {where} "
                f"({config.optimizer.type}) both choose the optimizer; remove one of them"
            )
        if _value(args.optim) != _value(_default(args, "optim")):
            logger.warning(
                "hf_zero: --optim %s is not used: %s has an \"optimizer\" section (%s), which wins as "
                "it does under DeepSpeed; remove the section to use --optim",
                _value(args.optim), where, config.optimizer.type,
            )
    if config.scheduler is not None:
        if trainer.lr_scheduler is not None:
            raise ValueError(
                f"Trainer(optimizers=(..., lr_scheduler)) was given a scheduler "
                f"({type(trainer.lr_scheduler).__name__}) and {where} has a \"scheduler\" section "
                f"({config.scheduler.type}); hf_zero would use one and drop the other. Remove the section "
                "or do not pass the scheduler"
            )
        if _value(args.lr_scheduler_type) != _value(_default(args, "lr_scheduler_type")):
            logger.warning(
                "hf_zero: --lr_scheduler_type %s is not used: %s has a \"scheduler\" section (%s), which "
                "wins as it does under DeepSpeed; remove the section to use --lr_scheduler_type",
                _value(args.lr_scheduler_type), where, config.scheduler.type,
            )
    optim = _value(args.optim)
    if config.optimizer is None and (optim in _IN_BACKWARD_OPTIMIZERS or optim.endswith("_layerwise")):
        raise ValueError(
            f"--optim {optim} updates each weight inside the backward pass; hf_zero's engine updates "
            "them after the gradients of all ranks are reduced (and sharded), so it cannot run this "
            f"optimizer. Use {optim.removesuffix('_layerwise') if optim.endswith('_layerwise') else 'adamw_torch'} "
            "or an \"optimizer\" section, with offload_optimizer for memory"
        )
    offloaded = config.zero_optimization.offload_optimizer.device != "none"
    if config.optimizer is None and optim == "grokadamw" and (config.stage == 1 or offloaded):
        raise ValueError(
            f"--optim grokadamw at ZeRO stage {config.stage}{' with offload_optimizer' if offloaded else ''}: "
            "GrokAdamW scales each parameter's beta1 by its position in the group, and here each rank "
            "steps a reordered subset of the group, so the updates would differ from the plain run. Use "
            "stage 0, 2 or 3 without offload_optimizer (the same updates as without hf_zero)"
        )
    if config.optimizer is None and optim == "apollo_adamw" and config.stage >= 1:
        # apollo_torch's AdamW numbers the parameters at construction, and the number seeds each
        # parameter's random projection; its step mixes plain tensors with the DTensor gradients.
        raise ValueError(
            f"--optim apollo_adamw at ZeRO stage {config.stage}: APOLLO seeds each parameter's random "
            "projection with the parameter's position in the optimizer's group; at stage 1 (and with "
            "offload_optimizer) each rank steps a reordered subset of the group, so the updates would "
            "differ from the plain run, and at stages 2/3 its step cannot run on the sharded (DTensor) "
            "parameters. Use stage 0 (the same updates as without hf_zero), or --optim galore_adamw "
            "(low-rank projections too) at any stage"
        )
    if args.save_only_model and args.load_best_model_at_end:
        raise ValueError(
            "--save_only_model with --load_best_model_at_end: the checkpoints would hold the model's "
            "16-bit weights but not the training state hf_zero loads the best model from; drop "
            "--save_only_model (transformers refuses the pair under DeepSpeed and FSDP too)"
        )
