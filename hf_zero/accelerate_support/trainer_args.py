"""Trainer scripts under an accelerate-form ``hf-zero run`` line (``--config_file fsdp.yaml``,
``--use_deepspeed ...``): the launch settings become the arguments' zero config.

``ZeroTrainingArguments`` calls :func:`apply_launch_settings` before reading ``--zero_config``; a
config given to the script itself (``--zero_config``/``--deepspeed``) always wins, as a DeepSpeed
config passed to ``TrainingArguments`` wins over accelerate's plugin.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["apply_launch_settings", "trainer_zero_config"]


def trainer_zero_config(settings: Any) -> dict[str, Any]:
    """The settings' zero config for a Trainer: precision left ``"auto"`` (the script's
    ``--bf16``/``--fp16``) when the launch asked for none, as accelerate's ``mixed_precision: 'no'``
    is the default every ``accelerate config`` file carries."""
    config = copy.deepcopy(settings.zero_config)
    if settings.mixed_precision in ("no", "auto"):
        for dtype in ("fp16", "bf16"):
            section = config.get(dtype)
            if section is None or section.get("enabled") in (False, "auto"):
                config[dtype] = {**(section or {}), "enabled": "auto"}
                config[dtype].pop("auto_cast", None)
    return config


def apply_launch_settings(args: Any) -> None:
    """Give ``args`` (a ``ZeroTrainingArguments`` being built) the zero config of this rank's
    accelerate-form launch, when the script passed none; FSDP's activation checkpointing turns on
    ``gradient_checkpointing``. Does nothing outside such a launch."""
    from hf_zero.config.sources.accelerate_yaml import settings_from_environment

    settings = settings_from_environment()
    if settings is None or settings.zero_config is None:
        return
    if getattr(args, "zero_config", None) is not None or getattr(args, "deepspeed", None):
        return
    args.zero_config = trainer_zero_config(settings)
    if settings.activation_checkpointing and not getattr(args, "gradient_checkpointing", False):
        args.gradient_checkpointing = True
