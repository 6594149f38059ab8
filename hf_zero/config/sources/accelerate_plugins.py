"""accelerate's DeepSpeed and FSDP plugin rules, applied to launch values without accelerate or torch.

:func:`convert` reads merged launch values (``hf_zero.config.sources.accelerate_yaml``) the way
``accelerate launch`` hands them to its ranks and the way each rank's plugin builds its settings:

- **DEEPSPEED**: ``DeepSpeedPlugin.__post_init__`` and ``set_mixed_precision`` (accelerate 1.15,
  ``utils/dataclasses.py``): a ``deepspeed_config_file`` is read and its ``"auto"`` plugin keys
  (stage, offload devices and paths, accumulation, clipping, 16-bit save) are filled from the launch
  values; without a file the config is built from the launch values. The result is the DeepSpeed
  config accelerate would give DeepSpeed, which is what hf_zero reads.
- **FSDP**: ``FullyShardedDataParallelPlugin.__post_init__``: sharding strategy or
  ``reshard_after_forward`` -> ZeRO stage, ``offload_params`` -> CPU offload, the wrap policy,
  ``state_dict_type``, activation checkpointing.

Settings with no hf_zero equivalent are listed in :data:`NO_EFFECT` (reported once); those that
would change what training does and that hf_zero cannot do are refused with the alternative.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_zero.config.errors import ZeroConfigError
from hf_zero.config.sources.accelerate_settings import AccelerateSettings, WrapSpec

__all__ = ["FSDP_STAGES", "NO_EFFECT", "convert", "launch_defaults"]

FSDP_STAGES = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0}
"""FSDP1 sharding strategy -> ZeRO stage (what each shards: parameters+gradients+optimizer state,
gradients+optimizer state, nothing)."""
_FSDP_STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]
_WRAP_POLICIES = ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"]
_STATE_DICT_TYPES = ["FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"]

# accelerate's ignore list for a deepspeed_config_file (DeepSpeedPlugin._deepspeed_config_checks).
_IGNORED_WITH_DS_FILE = (
    "gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
    "offload_param_device", "offload_param_nvme_path", "offload_optimizer_nvme_path", "zero3_save_16bit_model",
    "mixed_precision",
)

NO_EFFECT: dict[str, str] = {
    # process and launcher settings
    "downcast_bf16": "TPU only",
    "tpu_name": "TPU only", "tpu_zone": "TPU only", "tpu_use_cluster": "TPU only", "tpu_use_sudo": "TPU only",
    "tpu_vm": "TPU only", "tpu_env": "TPU only", "command_file": "TPU pods only", "commands": "TPU pods only",
    "main_training_function": "TPU and notebook launchers only; hf-zero run runs the script",
    "enable_cpu_affinity": "no NUMA binding; each rank gets cores/N OpenMP threads (OMP_NUM_THREADS)",
    "mpirun_config": "hf-zero run starts ranks with torchrun, not mpirun",
    "mpirun_hostfile": "hf-zero run starts ranks with torchrun, not mpirun",
    "megatron_lm_config": "an empty Megatron-LM section changes nothing",
    "fp8_config": "used with mixed_precision fp8 only (refused)",
    "dynamo_backend": "the Accelerator hand-off does not compile the model: call torch.compile on it yourself "
                      "(Trainer scripts: --torch_compile)",
    "dynamo_mode": "see dynamo_backend", "dynamo_use_fullgraph": "see dynamo_backend",
    "dynamo_use_dynamic": "see dynamo_backend", "dynamo_use_regional_compilation": "see dynamo_backend",
    "deepspeed_hostfile": "multi-node runs start hf-zero run on each node (--num_machines/--machine_rank)",
    "deepspeed_inclusion_filter": "multi-node runs start hf-zero run on each node",
    "deepspeed_exclusion_filter": "multi-node runs start hf-zero run on each node",
    "deepspeed_multinode_launcher": "multi-node runs start hf-zero run on each node",
    "deepspeed_moe_layer_cls_names": "FSDP2 units are transformer blocks; MoE blocks are gathered whole",
    # FSDP settings FSDP2 (what hf_zero's stages 2/3 run on) has no use for
    "fsdp_backward_prefetch": "FSDP2 always prefetches the next block's all-gather in backward",
    "fsdp_forward_prefetch": "FSDP2 prefetches one block ahead",
    "fsdp_use_orig_params": "FSDP2 always trains the original parameters",
    "fsdp_sync_module_states": "hf_zero always starts every rank from rank 0's weights",
    "fsdp_min_num_params": "used with fsdp_auto_wrap_policy SIZE_BASED_WRAP only",
    "fsdp_transformer_layer_cls_to_wrap": "used with fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP only",
    "fsdp_backward_prefetch_policy": "an old name accelerate no longer reads (fsdp_backward_prefetch); FSDP2 "
                                     "prefetches in backward anyway",
}

# Options of one paradigm given under the other: accelerate ignores them too (the launcher only
# exports the chosen paradigm's variables).
_DEEPSPEED_ONLY = ("deepspeed_config_file", "zero_stage", "offload_optimizer_device", "offload_param_device",
                   "offload_optimizer_nvme_path", "offload_param_nvme_path", "gradient_clipping", "zero3_init_flag",
                   "zero3_save_16bit_model", "gradient_accumulation_steps")
_FSDP_ONLY = ("fsdp_version", "fsdp_offload_params", "fsdp_sharding_strategy", "fsdp_reshard_after_forward",
              "fsdp_auto_wrap_policy", "fsdp_state_dict_type", "fsdp_cpu_ram_efficient_loading",
              "fsdp_activation_checkpointing", "fsdp_activation_checkpointing_offload", "fsdp_ignored_modules")


_SECTIONS = ("compute_environment", "use_cpu", "deepspeed_config", "fsdp_config", "fp8_config", "dynamo_config",
             "megatron_lm_config", "mpirun_config", "parallelism_config", "num_machines", "machine_rank",
             "num_processes", "gpu_ids", "main_process_ip", "main_process_port", "rdzv_backend", "same_network",
             "mixed_precision", "debug")


def launch_defaults() -> dict[str, Any]:
    """Each option of accelerate's launch parser -> its default (what a rank gets when neither the
    line nor the file sets it)."""
    from accelerate.commands.launch import launch_command_parser

    return {a.dest: a.default for a in launch_command_parser()._actions
            if a.option_strings and a.dest != "help"}


def _bool(value: Any, key: str) -> bool:
    """accelerate's ``str_to_bool`` (``true/false/yes/no/on/off/1/0``) on a string or a bool."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("y", "yes", "t", "true", "on", "1"):
        return True
    if text in ("n", "no", "f", "false", "off", "0"):
        return False
    raise ZeroConfigError(f"{key}: {value!r} is not true or false (accelerate reads yes/no, true/false, 1/0)")


def _given(values: Mapping[str, Any], key: str) -> bool:
    return key in set(values.get("_given", ()))


def convert(values: dict[str, Any], source: str) -> AccelerateSettings:
    """Merged launch values -> :class:`AccelerateSettings` (see the module docstring).

    Raises:
        ZeroConfigError: a setting hf_zero refuses, naming it and what to use instead.
    """
    kind = str(values.get("distributed_type") or "NO").upper()
    mixed = str(values.get("mixed_precision") or "no").lower()
    if mixed == "fp8":
        raise ZeroConfigError(f"{source}: mixed_precision fp8 is not supported by hf_zero; use bf16 (or fp16)")
    if mixed not in ("no", "fp16", "bf16", "auto"):  # "auto": the Accelerator's own, at prepare
        raise ZeroConfigError(f"{source}: mixed_precision {mixed!r}: use no, fp16 or bf16")
    if values.get("use_parallelism_config") or values.get("parallelism_config"):
        raise ZeroConfigError(f"{source}: parallelism_config (tensor/context/sequence parallel, HSDP) is not part of "
                              "hf_zero, which is data parallel only; remove it and use DEEPSPEED or FSDP")
    if values.get("use_megatron_lm") or values.get("megatron_lm_config"):
        if kind == "MEGATRON_LM" or values.get("use_megatron_lm"):
            raise ZeroConfigError(f"{source}: Megatron-LM is not part of hf_zero; use DEEPSPEED or FSDP")
    notes: list[str] = []
    no_effect: list[str] = []
    low_memory = None
    wrap = state_dict_type = None
    activation_checkpointing = False
    gas = values.get("gradient_accumulation_steps")
    if kind == "DEEPSPEED":
        zero_config, low_memory = _deepspeed(values, mixed, source)
        skipped = _FSDP_ONLY
    elif kind == "FSDP":
        zero_config, wrap, state_dict_type, activation_checkpointing, low_memory, more = _fsdp(values, mixed, source)
        notes.extend(more)
        skipped = _DEEPSPEED_ONLY
        gas = None  # a DeepSpeed launch option; the Accelerator's own argument rules under FSDP
    else:
        zero_config = None
        skipped = _DEEPSPEED_ONLY + _FSDP_ONLY
        notes.append(f"distributed_type {kind}: no ZeRO config; the script runs as with accelerate (DDP)")
    for key in sorted(set(values.get("_given", ()))):
        if key in skipped:
            no_effect.append(f"{key}: no effect with distributed_type {kind} (accelerate ignores it too)")
        elif key in NO_EFFECT and _set(values.get(key), key):
            if key == "fsdp_min_num_params" and wrap is not None and wrap.policy == "SIZE_BASED_WRAP":
                continue
            if key == "fsdp_transformer_layer_cls_to_wrap" and wrap is not None and wrap.policy == "TRANSFORMER_BASED_WRAP":
                continue
            if key.startswith("fsdp_") and kind != "FSDP":
                continue
            no_effect.append(f"{key}: no effect in hf_zero ({NO_EFFECT[key]})")
        elif "_known" in values and key not in values["_known"] and key not in _SECTIONS and key not in NO_EFFECT:
            no_effect.append(f"{key}: no effect (not an accelerate launch setting; accelerate ignores it too)")
    return AccelerateSettings(
        distributed_type=kind,
        zero_config=zero_config,
        mixed_precision=mixed,
        wrap=wrap,
        state_dict_type=state_dict_type,
        activation_checkpointing=activation_checkpointing,
        low_memory_loading=low_memory,
        gradient_accumulation_steps=int(gas) if gas not in (None, "auto") else None,
        num_processes=_int_or_none(values.get("num_processes")),
        num_machines=_int_or_none(values.get("num_machines")),
        machine_rank=_int_or_none(values.get("machine_rank")),
        main_process_ip=values.get("main_process_ip"),
        main_process_port=_int_or_none(values.get("main_process_port")),
        gpu_ids=None if values.get("gpu_ids") in (None, "all") else str(values.get("gpu_ids")),
        same_network=bool(values.get("same_network")),
        rdzv_backend=values.get("rdzv_backend"),
        no_effect=tuple(no_effect),
        notes=tuple(notes),
        source=source,
    )


def _set(value: Any, key: str = "") -> bool:
    """A no-effect setting worth reporting: given with a value that asks for something."""
    if key == "main_training_function":
        return value not in (None, "main")  # accelerate config always writes "main"
    if isinstance(value, str):
        return value.strip().lower() not in ("", "no", "false", "none", "0")
    return bool(value)


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


# ----------------------------------------------------------------------------------------- DeepSpeed
def _deepspeed(values: Mapping[str, Any], mixed: str, source: str) -> tuple[dict[str, Any], bool]:
    """The DeepSpeed config ``DeepSpeedPlugin`` builds (then ``set_mixed_precision``), and zero.Init's flag."""
    from hf_zero.config.sources.readers import load_raw

    gas = values.get("gradient_accumulation_steps")
    clipping = values.get("gradient_clipping")
    plugin = {  # DeepSpeedPlugin's attributes as its __post_init__ reads them from the launch
        "gradient_accumulation_steps": int(gas) if gas is not None else "auto",
        "gradient_clipping": float(clipping) if clipping is not None else "auto",
        "zero_optimization.stage": int(values["zero_stage"]) if values.get("zero_stage") is not None else 2,
        "zero_optimization.offload_optimizer.device": str(values.get("offload_optimizer_device") or "none").lower(),
        "zero_optimization.offload_param.device": str(values.get("offload_param_device") or "none").lower(),
        "zero_optimization.offload_param.nvme_path": values.get("offload_param_nvme_path") or "none",
        "zero_optimization.offload_optimizer.nvme_path": values.get("offload_optimizer_nvme_path") or "none",
        "zero_optimization.stage3_gather_16bit_weights_on_model_save":
            str(values["zero3_save_16bit_model"]).lower() == "true" if values.get("zero3_save_16bit_model") is not None
            else False,
    }
    file = values.get("deepspeed_config_file")
    if file not in (None, "none"):
        from_file = list((values.get("deepspeed_config") or {}).keys())
        if values.get("mixed_precision_from_file"):
            from_file.append("mixed_precision")
        clash = [k for k in from_file if k in _IGNORED_WITH_DS_FILE]
        if clash:
            raise ZeroConfigError(
                f"{source}: {', '.join(clash)} beside deepspeed_config_file {file}: accelerate refuses this too "
                f"(with a DeepSpeed config file it ignores {', '.join(_IGNORED_WITH_DS_FILE)}). Put these values "
                "in the DeepSpeed config file and remove them from the accelerate config")
        config, _ = load_raw(file if isinstance(file, Mapping) else str(file))
        config.setdefault("gradient_accumulation_steps", 1)
        if "zero_optimization" not in config:
            raise ZeroConfigError(f"{file}: no zero_optimization section; accelerate's DeepSpeedPlugin needs one "
                                  "(add \"zero_optimization\": {\"stage\": 2} for example)")
        for dotted, value in plugin.items():
            node, key = _node(config, dotted)
            if node is not None and node.get(key) == "auto":
                node[key] = value
    else:
        config = {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": plugin["gradient_accumulation_steps"],
            "zero_optimization": {
                "stage": plugin["zero_optimization.stage"],
                "offload_optimizer": {"device": plugin["zero_optimization.offload_optimizer.device"]},
                "offload_param": {"device": plugin["zero_optimization.offload_param.device"]},
                "stage3_gather_16bit_weights_on_model_save":
                    plugin["zero_optimization.stage3_gather_16bit_weights_on_model_save"],
            },
        }
        zero = config["zero_optimization"]
        for part in ("offload_optimizer", "offload_param"):
            if zero[part]["device"] == "nvme":  # accelerate writes nvme_path None otherwise
                zero[part]["nvme_path"] = plugin[f"zero_optimization.{part}.nvme_path"]
        if plugin["gradient_clipping"]:
            config["gradient_clipping"] = plugin["gradient_clipping"]
    _set_mixed_precision(config, mixed, source)
    stage = (config.get("zero_optimization") or {}).get("stage")
    zero3 = stage == 3
    flag = values.get("zero3_init_flag")
    init = _bool(flag, "zero3_init_flag") if flag is not None else zero3
    return config, bool(init and zero3)


def _node(config: dict[str, Any], dotted: str) -> tuple[dict[str, Any] | None, str]:
    """HfDeepSpeedConfig.find_config_node: the dict holding ``dotted``'s last key (None when a parent is absent)."""
    *parents, key = dotted.split(".")
    node: Any = config
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            return None, key
    return (node if isinstance(node, dict) else None), key


def _set_mixed_precision(config: dict[str, Any], mixed: str, source: str) -> None:
    """``DeepSpeedPlugin.set_mixed_precision``: add the fp16/bf16 sections, fill their ``"auto"``.
    ``mixed`` ``"auto"`` (no launcher said): absent sections stay ``"auto"`` for the Accelerator's."""
    if mixed == "auto":
        for dtype in ("fp16", "bf16"):
            config.setdefault(dtype, {"enabled": "auto"})
        return
    if mixed == "fp16" and "fp16" not in config:
        config["fp16"] = {"enabled": True, "auto_cast": True}
    elif mixed == "bf16" and "bf16" not in config:
        config["bf16"] = {"enabled": True}
    if mixed != "no":
        other = "bf16" if mixed == "fp16" else "fp16"
        if str((config.get(other) or {}).get("enabled", "False")).lower() == "true":
            raise ZeroConfigError(f"{source}: mixed_precision {mixed} while the DeepSpeed config enables {other}: "
                                  "accelerate refuses this too; make them agree")
    for dtype in ("fp16", "bf16"):
        config.setdefault(dtype, {"enabled": False})
        if isinstance(config[dtype], dict) and config[dtype].get("enabled") == "auto":
            config[dtype]["enabled"] = mixed == dtype


# ----------------------------------------------------------------------------------------- FSDP
def _fsdp(values: Mapping[str, Any], mixed: str, source: str):
    """FullyShardedDataParallelPlugin's settings as hf_zero's: (config, wrap, state dict type,
    activation checkpointing, low-memory loading, notes)."""
    notes: list[str] = []
    version = int(values.get("fsdp_version") or 1)
    if version not in (1, 2):
        raise ZeroConfigError(f"{source}: fsdp_version {version}: accelerate knows 1 and 2")
    if version == 1:
        raw = values.get("fsdp_sharding_strategy") or "FULL_SHARD"
        name = _strategy_name(raw, "fsdp_sharding_strategy", source)
        reshard = values.get("fsdp_reshard_after_forward")
        if _given(values, "fsdp_reshard_after_forward") and not _given(values, "fsdp_sharding_strategy"):
            other = str(reshard).upper()
            if other != name and other in _FSDP_STRATEGIES:
                notes.append(f"fsdp_reshard_after_forward {reshard} is not read with fsdp_version 1 under a "
                             f"launcher: accelerate's FSDP1 uses fsdp_sharding_strategy ({name}), and so does hf_zero")
    else:
        reshard = values.get("fsdp_reshard_after_forward", True)
        try:
            name = "FULL_SHARD" if _bool(reshard, "fsdp_reshard_after_forward") else "SHARD_GRAD_OP"
        except ZeroConfigError:
            raise ZeroConfigError(f"{source}: fsdp_reshard_after_forward {reshard!r}: with fsdp_version 2 it is "
                                  "true (FULL_SHARD, stage 3) or false (SHARD_GRAD_OP, stage 2)") from None
    if name.startswith("HYBRID"):
        raise ZeroConfigError(
            f"{source}: {name} shards within a node and replicates across nodes; hf_zero shards over all ranks. "
            f"Use FULL_SHARD (ZeRO stage 3) or SHARD_GRAD_OP (stage 2){' - the ZeRO-2 flavour' if 'ZERO2' in name else ''}")
    stage = FSDP_STAGES[name]
    offload = _bool(values.get("fsdp_offload_params", False), "fsdp_offload_params")
    zero: dict[str, Any] = {"stage": stage}
    if offload:
        # FSDP's CPU offload keeps parameters and gradients on the host and so steps the optimizer
        # there (its state is on the host too): hf_zero's parameter + optimizer offload.
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
        else:
            notes.append(f"fsdp_offload_params with {name}: hf_zero offloads the optimizer (fp32 masters, state and "
                         "step) to CPU; parameters stay on the accelerator below stage 3")
    sd_raw = values.get("fsdp_state_dict_type") or ("FULL_STATE_DICT" if version == 1 else "SHARDED_STATE_DICT")
    state_dict_type = _choice(sd_raw, _STATE_DICT_TYPES, "fsdp_state_dict_type", source)
    zero["stage3_gather_16bit_weights_on_model_save"] = state_dict_type == "FULL_STATE_DICT"
    if state_dict_type == "LOCAL_STATE_DICT":
        notes.append("fsdp_state_dict_type LOCAL_STATE_DICT: hf_zero's checkpoints are always sharded and "
                     "reshardable (as SHARDED_STATE_DICT)")
    policy = _choice(values.get("fsdp_auto_wrap_policy") or "NO_WRAP", _WRAP_POLICIES, "fsdp_auto_wrap_policy", source)
    if policy == "TRANSFORMER_BASED_WRAP":
        names = values.get("fsdp_transformer_layer_cls_to_wrap")
        classes = tuple(n.strip() for n in str(names).split(",") if n.strip()) if names else ()
        wrap = WrapSpec(policy, transformer_classes=classes)
    elif policy == "SIZE_BASED_WRAP":
        wrap = WrapSpec(policy, min_num_params=int(values.get("fsdp_min_num_params") or 0))
    else:
        wrap = WrapSpec(policy)
    checkpointing = _bool(values.get("fsdp_activation_checkpointing", False), "fsdp_activation_checkpointing")
    if _bool(values.get("fsdp_activation_checkpointing_offload", False), "fsdp_activation_checkpointing_offload"):
        raise ZeroConfigError(f"{source}: fsdp_activation_checkpointing_offload: hf_zero does not move checkpointed "
                              "activations to the host; remove it (fsdp_activation_checkpointing alone works)")
    if values.get("fsdp_ignored_modules"):
        raise ZeroConfigError(f"{source}: fsdp_ignored_modules: hf_zero shards every module; remove it, or freeze "
                              "those modules (requires_grad=False) to keep them out of the optimizer")
    ram = _bool(values.get("fsdp_cpu_ram_efficient_loading", False), "fsdp_cpu_ram_efficient_loading")
    if ram and not _bool(values.get("fsdp_sync_module_states", True), "fsdp_sync_module_states"):
        raise ZeroConfigError(f"{source}: fsdp_cpu_ram_efficient_loading needs fsdp_sync_module_states true "
                              "(accelerate launch refuses this pair too)")
    config: dict[str, Any] = {"zero_optimization": zero}
    if mixed in ("fp16", "bf16"):
        config[mixed] = {"enabled": True}
    elif mixed == "auto":
        config.update(fp16={"enabled": "auto"}, bf16={"enabled": "auto"})
    return config, wrap, state_dict_type, checkpointing, bool(ram and stage == 3), notes


def _strategy_name(raw: Any, key: str, source: str) -> str:
    """FSDP1's sharding strategy by name or by ``ShardingStrategy`` number (1 = FULL_SHARD ... 5)."""
    text = str(raw).strip().upper()
    if text.isdigit() and 1 <= int(text) <= len(_FSDP_STRATEGIES):
        return _FSDP_STRATEGIES[int(text) - 1]
    if text in _FSDP_STRATEGIES:
        return text
    raise ZeroConfigError(f"{source}: {key} {raw!r}: use FULL_SHARD (1), SHARD_GRAD_OP (2) or NO_SHARD (3)")


def _choice(raw: Any, names: list[str], key: str, source: str) -> str:
    text = str(raw).strip().upper()
    if text.isdigit() and 1 <= int(text) <= len(names):
        return names[int(text) - 1]
    if text in names:
        return text
    raise ZeroConfigError(f"{source}: {key} {raw!r}: use one of {', '.join(names)}")
