"""Where :func:`~hf_zero.accelerate_support.use_hf_zero_accelerator` finds its settings.

In order: the argument (an accelerate config file or dict, or a DeepSpeed-style config); the
settings ``hf-zero run`` gave this rank; the variables ``accelerate launch`` exported for its
DeepSpeed or FSDP plugin (``accelerate/utils/launch.py``), read back under the launch-option names
they came from. accelerate's own switches (``ACCELERATE_USE_DEEPSPEED``, ``ACCELERATE_USE_FSDP``) are
then removed from this process's environment, so the ``Accelerator`` the script builds takes its
plain data-parallel path (and needs no DeepSpeed install) while hf_zero shards the model.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hf_zero.config.errors import ZeroConfigError

__all__ = ["settings_for", "values_from_accelerate_env"]

_DEEPSPEED_ENV = {
    "ACCELERATE_DEEPSPEED_CONFIG_FILE": "deepspeed_config_file",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": "zero_stage",
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "gradient_accumulation_steps",
    "ACCELERATE_GRADIENT_CLIPPING": "gradient_clipping",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "offload_optimizer_device",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "offload_param_device",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH": "offload_optimizer_nvme_path",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH": "offload_param_nvme_path",
    "ACCELERATE_DEEPSPEED_ZERO3_INIT": "zero3_init_flag",
    "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "zero3_save_16bit_model",
}
_FSDP_ENV = {
    "FSDP_VERSION": "fsdp_version", "FSDP_SHARDING_STRATEGY": "fsdp_sharding_strategy",
    "FSDP_RESHARD_AFTER_FORWARD": "fsdp_reshard_after_forward", "FSDP_OFFLOAD_PARAMS": "fsdp_offload_params",
    "FSDP_MIN_NUM_PARAMS": "fsdp_min_num_params", "FSDP_AUTO_WRAP_POLICY": "fsdp_auto_wrap_policy",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "fsdp_transformer_layer_cls_to_wrap",
    "FSDP_BACKWARD_PREFETCH": "fsdp_backward_prefetch", "FSDP_STATE_DICT_TYPE": "fsdp_state_dict_type",
    "FSDP_FORWARD_PREFETCH": "fsdp_forward_prefetch", "FSDP_USE_ORIG_PARAMS": "fsdp_use_orig_params",
    "FSDP_CPU_RAM_EFFICIENT_LOADING": "fsdp_cpu_ram_efficient_loading",
    "FSDP_SYNC_MODULE_STATES": "fsdp_sync_module_states",
    "FSDP_ACTIVATION_CHECKPOINTING": "fsdp_activation_checkpointing",
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "fsdp_activation_checkpointing_offload",
    "FSDP_IGNORED_MODULES": "fsdp_ignored_modules",
}


def values_from_accelerate_env(env: Mapping[str, str]) -> dict[str, Any] | None:
    """The launch values behind ``accelerate launch``'s DeepSpeed/FSDP variables, or None when the
    process was not launched for either."""
    def on(name: str) -> bool:
        return env.get(name, "").lower() in ("1", "true", "yes")

    if on("ACCELERATE_USE_DEEPSPEED"):
        values: dict[str, Any] = {"distributed_type": "DEEPSPEED"}
        values.update({name: env[var] for var, name in _DEEPSPEED_ENV.items() if var in env})
        fields = [f for f in env.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",") if f]
        values["deepspeed_config"] = {f: True for f in fields if f != "mixed_precision"}
        values["mixed_precision_from_file"] = "mixed_precision" in fields
    elif on("ACCELERATE_USE_FSDP"):
        values = {"distributed_type": "FSDP"}
        values.update({name: env[var] for var, name in _FSDP_ENV.items() if var in env})
    else:
        return None
    values["mixed_precision"] = env.get("ACCELERATE_MIXED_PRECISION", "no")
    return values


def settings_for(config: Any = None, env: Mapping[str, str] | None = None) -> Any:
    """:class:`~hf_zero.config.sources.accelerate_yaml.AccelerateSettings` for ``config`` (see the
    module docstring). Reading accelerate's variables removes its DeepSpeed/FSDP switches from
    ``os.environ``.

    Raises:
        ZeroConfigError: nothing to read, or a setting hf_zero refuses.
    """
    from hf_zero.config.sources.accelerate_plugins import convert
    from hf_zero.config.sources.accelerate_yaml import (
        flatten_accelerate_config,
        merge_launch_values,
        read_accelerate_config,
        settings_from_environment,
    )

    live = env is None
    env = os.environ if env is None else env
    mixed = env.get("ACCELERATE_MIXED_PRECISION", "auto")  # "auto": the Accelerator's, at prepare
    if config is None:
        settings = settings_from_environment(env)
        if settings is not None:
            return settings
        values = values_from_accelerate_env(env)
        if values is None:
            raise ZeroConfigError("use_hf_zero_accelerator(): no config given and none left by a launcher; pass an "
                                  "accelerate config file, a DeepSpeed-style config, or run under hf-zero run / "
                                  "accelerate launch with DEEPSPEED or FSDP")
        if live:
            for switch in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP"):
                os.environ.pop(switch, None)
        values["_given"] = sorted(values)
        return convert(values, "accelerate launch environment")
    if isinstance(config, Mapping):
        if "distributed_type" in config:
            values = merge_launch_values({}, flatten_accelerate_config(config), {})
        else:
            values = {"distributed_type": "DEEPSPEED", "deepspeed_config_file": dict(config), "mixed_precision": mixed}
        return convert(values, "<dict>")
    path = Path(os.fspath(config))
    if path.suffix.lower() in (".yaml", ".yml") or _has_distributed_type(path):
        values = merge_launch_values({}, flatten_accelerate_config(read_accelerate_config(path)), {})
        if values.get("mixed_precision") == "no" and not values.get("mixed_precision_from_file"):
            values["mixed_precision"] = mixed
        return convert(values, str(path))
    values = {"distributed_type": "DEEPSPEED", "deepspeed_config_file": str(path), "mixed_precision": mixed}
    return convert(values, str(path))


def _has_distributed_type(path: Path) -> bool:
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "distributed_type" in data
