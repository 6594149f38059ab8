"""accelerate's config files (``accelerate config`` YAML/JSON) and launch values -> hf_zero settings.

``accelerate launch --config_file fsdp_config.yaml train.py`` merges the file with its command line
(an option typed on the line wins over the file; ``commands/launch.py _validate_launch_command``),
turns the result into environment variables, and each rank's ``Accelerator`` builds a
``DeepSpeedPlugin`` or ``FullyShardedDataParallelPlugin`` from them. hf_zero reads the same file
and options into one flat mapping (accelerate's launch-argument names: ``zero_stage``,
``fsdp_offload_params``, ``mixed_precision`` ...) and converts it with the rules of those plugins
(:mod:`hf_zero.config.sources.accelerate_plugins`) into an :class:`AccelerateSettings`: a
DeepSpeed-style config dict for hf_zero plus what the config has no key for (wrapping, state dict
type, activation checkpointing, process layout).

No torch, transformers or accelerate import here: ``hf-zero config --from-accelerate`` stays fast.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hf_zero.config.errors import ZeroConfigError
from hf_zero.config.sources.accelerate_plugins import convert, launch_defaults
from hf_zero.config.sources.accelerate_settings import (  # noqa: F401 - public here too, as before
    SETTINGS_ENV,
    AccelerateSettings,
    WrapSpec,
    settings_env_value,
    settings_from_environment,
)

__all__ = [
    "SETTINGS_ENV",
    "AccelerateSettings",
    "WrapSpec",
    "default_accelerate_config_file",
    "flatten_accelerate_config",
    "merge_launch_values",
    "read_accelerate_config",
    "settings_from_accelerate_file",
    "settings_from_environment",
    "settings_from_launch_values",
]

# ClusterConfig's fields and BaseConfig's (accelerate/commands/config/config_args.py), plus the two
# old names process_config() still converts (fp16, dynamo_backend).
_TOP_KEYS = (
    "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug", "num_processes",
    "machine_rank", "num_machines", "gpu_ids", "main_process_ip", "main_process_port", "rdzv_backend",
    "same_network", "main_training_function", "enable_cpu_affinity", "fp8_config", "deepspeed_config",
    "fsdp_config", "parallelism_config", "megatron_lm_config", "mpirun_config", "downcast_bf16", "tpu_name",
    "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env",
    "dynamo_config", "fp16", "dynamo_backend",
)

DISTRIBUTED_TYPES = {
    # distributed_type -> the launch flag accelerate sets from it (_validate_launch_command)
    "NO": None, "MULTI_CPU": None, "MULTI_GPU": "multi_gpu", "DEEPSPEED": "use_deepspeed", "FSDP": "use_fsdp",
}
_REFUSED_TYPES = {
    "XLA": "TPUs are not supported by hf_zero",
    "TPU": "TPUs are not supported by hf_zero",
    "MEGATRON_LM": "Megatron-LM's tensor/pipeline parallelism is not part of hf_zero (it is data parallel only)",
}


def default_accelerate_config_file() -> str | None:
    """accelerate's default config (``$HF_HOME/accelerate/default_config.yaml``) when it exists.

    ``accelerate launch`` without ``--config_file`` reads it (``config_args.default_config_file``);
    ``hf-zero run`` does the same for accelerate-form lines and says so.
    """
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache")), "huggingface")
    path = os.path.join(home, "accelerate", "default_config.yaml")
    return path if os.path.isfile(path) else None


def read_accelerate_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read an accelerate config file (``.json`` as JSON, anything else as YAML, as accelerate does).

    Raises:
        ZeroConfigError: the file is missing or malformed, has no ``distributed_type``, or has a key
            accelerate's ``ClusterConfig`` does not know (named, with the closest known key).
    """
    from hf_zero.config.sources.readers import _loads_json, _loads_yaml

    where = str(path)
    p = Path(path).expanduser()
    if not p.is_file():
        raise ZeroConfigError(f"{where}: accelerate config file not found (working directory: {os.getcwd()}); "
                              "check the path (accelerate config --config_file PATH writes one)")
    text = p.read_text(encoding="utf-8")
    data = _loads_json(text, where) if where.endswith(".json") else _loads_yaml(text, where)
    if not isinstance(data, dict):
        raise ZeroConfigError(f"{where}: an accelerate config is a mapping of keys (distributed_type: ...), "
                              f"not {type(data).__name__}")
    if data.get("compute_environment", "LOCAL_MACHINE") != "LOCAL_MACHINE":
        raise ZeroConfigError(f"{where}: compute_environment {data['compute_environment']!r}: hf-zero run starts "
                              "the ranks of this machine only; use LOCAL_MACHINE (accelerate config)")
    if "distributed_type" not in data:
        raise ZeroConfigError(f"{where}: no distributed_type (accelerate refuses this file too); add "
                              "distributed_type: DEEPSPEED, FSDP, MULTI_GPU or NO")
    unknown = [k for k in data if k not in _TOP_KEYS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], _TOP_KEYS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ZeroConfigError(f"{where}: unknown key {unknown[0]!r}{hint}; accelerate's ClusterConfig refuses it "
                              "too. Remove it, or regenerate the file with accelerate config")
    return data


def flatten_accelerate_config(data: Mapping[str, Any]) -> dict[str, Any]:
    """A config file's values under accelerate's launch-argument names, as ``_validate_launch_command``
    copies them: top-level keys as they are, ``fsdp_config.X`` as ``fsdp_X`` (when not already so
    prefixed), ``deepspeed_config.X`` as ``X``, ``dynamo_config.X`` as ``dynamo_X``, ``fp8_config.X``
    as ``fp8_X``; ``distributed_type`` becomes its launch flag (``use_deepspeed``, ``use_fsdp``,
    ``multi_gpu``). The nested sections are kept too (``deepspeed_config``...) for the checks that need
    to know which keys the file set."""
    flat: dict[str, Any] = {}
    sections: set[str] = set()
    for name, value in data.items():
        if name == "dynamo_backend":  # old format: process_config() turns it into dynamo_config
            value = {} if value == "NO" else {"dynamo_backend": value}
            name = "dynamo_config"
        if isinstance(value, dict):
            flat[name] = dict(value)
            for key, inner in value.items():
                if name == "fsdp_config" and not key.startswith("fsdp"):
                    key = "fsdp_" + key
                elif name == "fp8_config" and not key.startswith("fp8"):
                    key = "fp8_" + key
                elif name == "dynamo_config" and not key.startswith("dynamo_"):
                    key = "dynamo_" + key
                flat[key] = inner
                sections.add(key)
        elif name == "fp16":  # old format: process_config() turns fp16: true into mixed_precision
            if value and "mixed_precision" not in data:
                flat["mixed_precision"] = "fp16"
        else:
            flat[name] = value
    kind = str(data.get("distributed_type", "NO")).upper()
    if kind in _REFUSED_TYPES:
        raise ZeroConfigError(f"distributed_type {kind}: {_REFUSED_TYPES[kind]}; use DEEPSPEED or FSDP "
                              "(accelerate config) to train with ZeRO, or launch with accelerate")
    if kind not in DISTRIBUTED_TYPES:
        raise ZeroConfigError(f"distributed_type {kind!r} is not one hf_zero reads; use DEEPSPEED, FSDP, "
                              "MULTI_GPU, MULTI_CPU or NO")
    flag = DISTRIBUTED_TYPES[kind]
    if flag:
        flat[flag] = True
    flat["distributed_type"] = kind
    flat["_section_keys"] = sorted(sections)
    return flat


def merge_launch_values(defaults: Mapping[str, Any], file_values: Mapping[str, Any] | None,
                        line_values: Mapping[str, Any]) -> dict[str, Any]:
    """The launch values ``accelerate launch`` works with: its parser's defaults, under the file's
    values, under the options typed on the line (``_validate_launch_command``'s rules).

    - a value from a file section (``fsdp_config``, ``deepspeed_config``...) replaces the default
      unless the line typed that option; a top-level file value only fills an option whose default
      is None (accelerate's ``getattr(args, name) is None``);
    - ``mixed_precision`` from the file is remembered (``mixed_precision_from_file``): accelerate
      refuses it beside a ``deepspeed_config_file``;
    - ``distributed_type`` sets its launch flag only when the line gave none of ``--use_deepspeed``,
      ``--use_fsdp``, ``--multi_gpu``, ``--cpu``.

    Args:
        defaults: option name -> default, from accelerate's launch parser.
        file_values: :func:`flatten_accelerate_config` of the config file, or None.
        line_values: the options typed on the line (name -> typed value).
    """
    merged = dict(defaults)
    file_values = dict(file_values or {})
    sections = set(file_values.pop("_section_keys", ()))
    paradigm = ("use_deepspeed", "use_fsdp", "multi_gpu", "cpu")
    line_paradigm = any(line_values.get(f) for f in paradigm)
    for key, value in file_values.items():
        if key in line_values:
            continue
        if key in paradigm and line_paradigm:
            continue
        if key in sections or key in paradigm or merged.get(key) is None:
            merged[key] = value
    merged["mixed_precision_from_file"] = ("mixed_precision" not in line_values
                                           and file_values.get("mixed_precision") is not None)
    merged.update(line_values)
    if line_paradigm or "distributed_type" not in merged:
        merged["distributed_type"] = ("DEEPSPEED" if merged.get("use_deepspeed") else "FSDP" if merged.get("use_fsdp")
                                      else "MULTI_GPU" if merged.get("multi_gpu") else
                                      "MULTI_CPU" if merged.get("cpu") else "NO")
    if merged.get("mixed_precision") is None:
        merged["mixed_precision"] = "no"
    # What the user set (file or line), for the no-effect report; defaults are not reported.
    merged["_given"] = sorted((set(file_values) - {"distributed_type"}) | set(line_values))
    return merged


def settings_from_launch_values(values: Mapping[str, Any], source: str = "<accelerate options>") -> AccelerateSettings:
    """Convert merged launch values (:func:`merge_launch_values`) into :class:`AccelerateSettings`.

    Raises:
        ZeroConfigError: a setting hf_zero refuses (HYBRID_* sharding, fp8, parallelism configs...),
            with what to use instead; or values accelerate itself would refuse.
    """
    return convert(dict(values), source)


def settings_from_accelerate_file(path: str | os.PathLike[str]) -> AccelerateSettings:
    """:class:`AccelerateSettings` of a config file launched with no other option
    (``accelerate launch --config_file FILE train.py``)."""
    flat = flatten_accelerate_config(read_accelerate_config(path))
    values = merge_launch_values(launch_defaults(), flat, {})
    values["_known"] = sorted(launch_defaults())
    return settings_from_launch_values(values, source=str(path))
