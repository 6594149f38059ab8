"""Loops written on accelerate's ``Accelerator``, trained by hf_zero's engine.

Under ``hf-zero run`` with accelerate's options or config files (``--config_file fsdp.yaml``,
``--use_deepspeed ...``) nothing is to be called: each rank installs the hand-off before the script
runs. Scripts started by ``accelerate launch``, ``torchrun`` or in a notebook make one call before
``accelerator.prepare``::

    import hf_zero.accelerate_support as hz
    hz.use_hf_zero_accelerator()                       # under accelerate launch: its DEEPSPEED/FSDP settings
    hz.use_hf_zero_accelerator("fsdp_config.yaml")     # an accelerate config file
    hz.use_hf_zero_accelerator({"zero_optimization": {"stage": 3}})   # a DeepSpeed-style config

Then ``accelerator.prepare(model, optimizer, dataloader, scheduler)`` shards the model with hf_zero
and the loop (``accelerator.backward``, ``optimizer.step()``, ``clip_grad_norm_``, ``accumulate``,
``unwrap_model``/``get_state_dict``, ``save_state``/``load_state``) runs unchanged. See
docs/accelerate.md for what is patched and why.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from hf_zero.accelerate_support.handoff import active_settings, install, installed

__all__ = ["active_settings", "installed", "use_hf_zero_accelerator"]


def use_hf_zero_accelerator(config: str | os.PathLike[str] | Mapping[str, Any] | None = None) -> Any:
    """Make ``Accelerator.prepare`` hand models to hf_zero's engine in this process.

    Args:
        config: an accelerate config file (``.yaml``/``.yml``, or a ``.json`` with
            ``distributed_type``); a DeepSpeed-style config (a dict, or a ``.json`` path);
            or None: the settings ``hf-zero run`` gave this rank, else the ones ``accelerate launch``
            exported (``ACCELERATE_USE_DEEPSPEED``/``ACCELERATE_USE_FSDP`` and their variables).

    Returns:
        The :class:`~hf_zero.config.sources.accelerate_yaml.AccelerateSettings` in use.

    Raises:
        ZeroConfigError: the config asks for something hf_zero refuses, or None was given and no
            launcher left settings to read.
    """
    from hf_zero.accelerate_support.launch_env import settings_for

    settings = settings_for(config)
    install(settings)
    return settings
