"""Section tables: DeepSpeed JSON key -> (dataclass field, converter), per section, with the old
names (aliases) DeepSpeed still reads. The keys hf_zero implements are exactly these.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_zero.config import schema as S
from hf_zero.config.converters import (
    Converter,
    _betas,
    _bool,
    _choice,
    _dict,
    _float,
    _int,
    _path,
    _str,
)

SUPPORTED_OPTIMIZERS = ("adam", "adamw", "sgd", "lion", "lamb", "muon")
_OPTIMIZER_DISPLAY = "Adam, AdamW, SGD, Lion, Lamb or Muon"

SCHEDULER_TYPES: dict[str, type] = {
    "WarmupLR": S.WarmupLRParams,
    "WarmupDecayLR": S.WarmupDecayLRParams,
    "WarmupCosineLR": S.WarmupCosineLRParams,
    "OneCycle": S.OneCycleParams,
    "LRRangeTest": S.LRRangeTestParams,
}
# DeepSpeed's OneCycle(optimizer, cycle_min_lr, cycle_max_lr, ...) has no defaults for these.
_REQUIRED_SCHEDULER_PARAMS = {"OneCycle": ("cycle_min_lr", "cycle_max_lr")}


# --------------------------------------------------------------------------------------------------
# Section tables: JSON key -> (dataclass field, converter). Aliases map old names to JSON keys here.
# --------------------------------------------------------------------------------------------------
Fields = dict[str, tuple[str, Converter]]

_TOP: Fields = {
    "train_batch_size": ("train_batch_size", _int(1, auto=True)),
    "train_micro_batch_size_per_gpu": ("train_micro_batch_size_per_gpu", _int(1, auto=True)),
    "gradient_accumulation_steps": ("gradient_accumulation_steps", _int(1, auto=True)),
    "gradient_clipping": ("gradient_clipping", _float(0.0, auto=True)),
    "steps_per_print": ("steps_per_print", _int(0)),
    "wall_clock_breakdown": ("wall_clock_breakdown", _bool()),
    # DeepSpeed spells bfloat16 "bfp16" here (runtime/config.py get_communication_data_type).
    "communication_data_type": (
        "communication_data_type",
        _choice({"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "bfp16": "bf16", "bfloat16": "bf16",
                 "float32": "fp32", "float16": "fp16"}),
    ),
    "prescale_gradients": ("prescale_gradients", _bool()),
    "gradient_predivide_factor": ("gradient_predivide_factor", _float(0.0, exclusive_min=True)),
}
_TOP_SECTIONS = (
    "fp16", "bf16", "optimizer", "scheduler", "zero_optimization", "aio",
    "activation_checkpointing", "checkpoint", "tensorboard", "wandb", "csv_monitor",
)
_TOP_ALIASES = {"bfloat16": "bf16"}  # deepspeed/runtime/precision_config.py BFLOAT16_OLD

_FP16: Fields = {
    "enabled": ("enabled", _bool(auto=True)),
    "auto_cast": ("auto_cast", _bool()),
    "loss_scale": ("loss_scale", _float(0.0)),
    "initial_scale_power": ("initial_scale_power", _int(0, 127)),
    "loss_scale_window": ("loss_scale_window", _int(1)),
    "hysteresis": ("hysteresis", _int(1)),
    "consecutive_hysteresis": ("consecutive_hysteresis", _bool()),
    "min_loss_scale": ("min_loss_scale", _float(0.0, exclusive_min=True)),
}
_BF16: Fields = {"enabled": ("enabled", _bool(auto=True))}

_OFFLOAD_DEVICE = _choice({"none": "none", "cpu": "cpu", "nvme": "nvme"})
_OFFLOAD_OPTIMIZER: Fields = {
    "device": ("device", _OFFLOAD_DEVICE),
    "nvme_path": ("nvme_path", _path()),
    "pin_memory": ("pin_memory", _bool()),
    "buffer_count": ("buffer_count", _int(0)),
    "fast_init": ("fast_init", _bool()),
    "ratio": ("ratio", _float(0.0, 1.0, exclusive_min=True)),
}
_OFFLOAD_PARAM: Fields = {
    "device": ("device", _OFFLOAD_DEVICE),
    "nvme_path": ("nvme_path", _path()),
    "pin_memory": ("pin_memory", _bool()),
    "buffer_count": ("buffer_count", _int(0)),
    "buffer_size": ("buffer_size", _int(0)),
    "max_in_cpu": ("max_in_cpu", _int(0)),
}

_ZERO: Fields = {
    "stage": ("stage", _int(0, 3, hint="write 0, 1, 2 or 3 (the ZeRO stage)")),
    "overlap_comm": ("overlap_comm", _bool()),
    "contiguous_gradients": ("contiguous_gradients", _bool()),
    "reduce_scatter": ("reduce_scatter", _bool()),
    "reduce_bucket_size": ("reduce_bucket_size", _int(0, auto=True)),
    "allgather_partitions": ("allgather_partitions", _bool()),
    "allgather_bucket_size": ("allgather_bucket_size", _int(0)),
    "round_robin_gradients": ("round_robin_gradients", _bool()),
    "sub_group_size": ("sub_group_size", _int(0)),
    "stage3_prefetch_bucket_size": ("prefetch_bucket_size", _int(0, auto=True)),
    "stage3_param_persistence_threshold": ("param_persistence_threshold", _int(0, auto=True)),
    "stage3_max_live_parameters": ("max_live_parameters", _int(0)),
    "stage3_max_reuse_distance": ("max_reuse_distance", _int(0)),
    "stage3_gather_16bit_weights_on_model_save": ("gather_16bit_weights_on_model_save", _bool(auto=True)),
    "mics_shard_size": ("mics_shard_size", _int(-1, hint="write the ranks of one shard group, such as 8, or -1 (off)")),
    "zero_hpz_partition_size": ("hpz_partition_size", _int(1, hint="write the ranks of one secondary group, such as 8, or 1 (off)")),
}
# DeepSpeed's pydantic model has populate_by_name=True, so the field names work as well as the
# stage3_* aliases; stage3_gather_fp16_* is the deprecated name (zero/config.py).
_ZERO_ALIASES = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
}
# Deprecated pre-offload_* switches (zero/config.py cpu_offload*, and the older cpu_offload_params).
_ZERO_LEGACY_OFFLOAD = ("cpu_offload", "cpu_offload_param", "cpu_offload_params", "cpu_offload_use_pin_memory")

_AIO: Fields = {
    "block_size": ("block_size", _int(1)),
    "queue_depth": ("queue_depth", _int(1)),
    "thread_count": ("thread_count", _int(1)),
    "single_submit": ("single_submit", _bool()),
    "overlap_events": ("overlap_events", _bool()),
    "use_gds": ("use_gds", _bool()),
}
_AIO_ALIASES = {"intra_op_parallelism": "thread_count"}  # newer DeepSpeed name

_ACT_CKPT: Fields = {
    "partition_activations": ("partition_activations", _bool()),
    "cpu_checkpointing": ("cpu_checkpointing", _bool()),
    "contiguous_memory_optimization": ("contiguous_memory_optimization", _bool()),
    "number_checkpoints": ("number_checkpoints", _int(0)),
    "synchronize_checkpoint_boundary": ("synchronize_checkpoint_boundary", _bool()),
    "profile": ("profile", _bool()),
}
_CHECKPOINT: Fields = {
    "tag_validation": ("tag_validation", _choice({"ignore": "Ignore", "warn": "Warn", "fail": "Fail"})),
    "load_universal": ("load_universal", _bool()),
    "use_node_local_storage": ("use_node_local_storage", _bool()),
    "parallel_write": ("parallel_write", _dict()),
}
_MONITORS: dict[str, Fields] = {
    "tensorboard": {"enabled": ("enabled", _bool()), "output_path": ("output_path", _str()),
                    "job_name": ("job_name", _str())},
    "csv_monitor": {"enabled": ("enabled", _bool()), "output_path": ("output_path", _str()),
                    "job_name": ("job_name", _str())},
    "wandb": {"enabled": ("enabled", _bool()), "team": ("team", _str()), "group": ("group", _str()),
              "project": ("project", _str())},
}

_LR = ("lr", _float(0.0, auto=True))
_WD = ("weight_decay", _float(0.0, auto=True))
_EPS = ("eps", _float(0.0, auto=True))
_OPTIMIZER_PARAMS: dict[str, Fields] = {
    "adam": {
        "lr": _LR, "betas": ("betas", _betas()), "eps": _EPS, "weight_decay": _WD,
        "amsgrad": ("amsgrad", _bool()), "bias_correction": ("bias_correction", _bool()),
        "adam_w_mode": ("adam_w_mode", _bool()), "torch_adam": ("torch_adam", _bool()),
    },
    "sgd": {
        "lr": _LR, "weight_decay": _WD, "momentum": ("momentum", _float(0.0)),
        "dampening": ("dampening", _float(0.0)), "nesterov": ("nesterov", _bool()),
    },
    "lion": {"lr": _LR, "betas": ("betas", _betas()), "weight_decay": _WD},
    "lamb": {
        "lr": _LR, "betas": ("betas", _betas()), "eps": _EPS, "weight_decay": _WD,
        "bias_correction": ("bias_correction", _bool()),
        "max_coeff": ("max_coeff", _float(0.0, exclusive_min=True)),
        "min_coeff": ("min_coeff", _float(0.0)),
    },
    # The keys DeepSpeed 0.19's engine reads for Muon (_MUON_HALF_KEYS, _ADAM_HALF_KEYS, muon_lr,
    # adam_lr, adam_w_mode, torch_adam); per_head_muon is in the refused table. ns_method is
    # compared case-sensitively, as DeepSpeed's assert does.
    "muon": {
        "lr": _LR, "muon_lr": ("muon_lr", _float(0.0)), "adam_lr": ("adam_lr", _float(0.0)),
        "momentum": ("momentum", _float(0.0, 1.0)), "weight_decay": _WD,
        "ns_method": ("ns_method", _choice({"gram": "gram", "standard": "standard"}, case_sensitive=True)),
        "betas": ("betas", _betas()), "eps": _EPS,
        "adam_w_mode": ("adam_w_mode", _bool()), "torch_adam": ("torch_adam", _bool()),
    },
}
_OPTIMIZER_PARAMS["adamw"] = _OPTIMIZER_PARAMS["adam"]
# What DeepSpeed's Muon uses for a key the config leaves out (runtime/zero/muon/original_muon.py
# MuonWithAuxAdam.__init__): the Muon half's lr and momentum, the Adam half's lr, betas and eps.
MUON_DEFAULTS: dict[str, Any] = {"muon_lr": 0.02, "momentum": 0.95, "adam_lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10}
# Keys users copy from other Muon implementations that DeepSpeed does not read: its Muon always
# runs 5 Newton-Schulz steps with Nesterov momentum.
MUON_FIXED: dict[str, str] = {
    "ns_steps": "DeepSpeed's Muon always runs 5 Newton-Schulz steps and does not read ns_steps; remove it",
    "nesterov": "DeepSpeed's Muon always uses Nesterov momentum and does not read nesterov; remove it",
}

_WARMUP_TYPE = ("warmup_type", _choice({"log": "log", "linear": "linear"}, case_sensitive=True))
_WARMUP_BASE: Fields = {
    "warmup_min_lr": ("warmup_min_lr", _float(0.0, auto=True)),
    "warmup_max_lr": ("warmup_max_lr", _float(0.0, auto=True)),
    "warmup_num_steps": ("warmup_num_steps", _int(0, auto=True)),
    "warmup_type": _WARMUP_TYPE,
}
_SCHEDULER_PARAMS: dict[str, Fields] = {
    "WarmupLR": _WARMUP_BASE,
    "WarmupDecayLR": {**_WARMUP_BASE, "total_num_steps": ("total_num_steps", _int(1, auto=True))},
    "WarmupCosineLR": {
        "total_num_steps": ("total_num_steps", _int(1, auto=True)),
        "warmup_min_ratio": ("warmup_min_ratio", _float(0.0)),
        "warmup_num_steps": ("warmup_num_steps", _int(0, auto=True)),
        "cos_min_ratio": ("cos_min_ratio", _float(0.0)),
        "warmup_type": _WARMUP_TYPE,
    },
    "OneCycle": {
        "cycle_min_lr": ("cycle_min_lr", _float(0.0)),
        "cycle_max_lr": ("cycle_max_lr", _float(0.0)),
        "decay_lr_rate": ("decay_lr_rate", _float()),
        "cycle_first_step_size": ("cycle_first_step_size", _int(1)),
        "cycle_second_step_size": ("cycle_second_step_size", _int(1)),
        "cycle_first_stair_count": ("cycle_first_stair_count", _int(0)),
        "cycle_second_stair_count": ("cycle_second_stair_count", _int(0)),
        "decay_step_size": ("decay_step_size", _int(0)),
        "cycle_momentum": ("cycle_momentum", _bool()),
        "cycle_min_mom": ("cycle_min_mom", _float(0.0)),
        "cycle_max_mom": ("cycle_max_mom", _float(0.0)),
        "decay_mom_rate": ("decay_mom_rate", _float()),
    },
    "LRRangeTest": {
        "lr_range_test_min_lr": ("lr_range_test_min_lr", _float(0.0)),
        "lr_range_test_step_size": ("lr_range_test_step_size", _int(1)),
        "lr_range_test_step_rate": ("lr_range_test_step_rate", _float()),
        "lr_range_test_staircase": ("lr_range_test_staircase", _bool()),
    },
}


def _children(path: str, table: Mapping[str, Any]) -> list[str]:
    prefix = path + "." if path else ""
    return [k[len(prefix):] for k in table if k.startswith(prefix) and "." not in k[len(prefix):]]


