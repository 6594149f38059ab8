"""The table of what hf_zero's ``deepspeed`` namespace holds, and what it refuses.

:data:`SYMBOLS` is the single source: the import finder (``finder.py``) builds each ``deepspeed.*``
module from it (a module exists when some symbol lives in it or below it), and
``docs/deepspeed_compat.md`` renders it. Names that scripts import at module level but that hf_zero
has nothing behind (``deepspeed.initialize``, ``DeepSpeedEngine``...) are stand-ins: they import,
and raise naming themselves when used (``stand_ins.py``). Anything else under ``deepspeed`` fails
with an ImportError that names it and, where :data:`UNSUPPORTED` has an entry for it or a parent,
what hf_zero offers instead.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Symbol", "SYMBOLS", "UNSUPPORTED", "VERSION", "modules", "attributes", "advice_for"]

VERSION = "0.0.0+hf_zero"
"""``deepspeed.__version__``: not a DeepSpeed release; version checks see the oldest one."""


@dataclass(frozen=True)
class Symbol:
    """One object of the namespace, under each of the names DeepSpeed gives it."""

    names: tuple[str, ...]
    target: str
    """``module:attribute`` of the object hf_zero provides."""
    maps_to: str
    """What it does under hf_zero (the docs' second column); for a stand-in, what to use instead."""
    stand_in: bool = False
    """Imports, but raises naming it when used (``stand_ins.py``): a name scripts import at
    module level that hf_zero has nothing behind."""


_ZERO_MODULES = ("deepspeed.zero", "deepspeed.runtime.zero", "deepspeed.runtime.zero.partition_parameters")
_ZERO = "hf_zero.deepspeed_api.zero"
_COMM = "hf_zero.deepspeed_api.comm"
_FP32 = "hf_zero.deepspeed_api.zero_to_fp32"
_LOGS = "hf_zero.deepspeed_api.logs"
_OPS = "hf_zero.deepspeed_api.ops"
_STAND_INS = "hf_zero.deepspeed_api.stand_ins"


def _in_zero(attr: str) -> tuple[str, ...]:
    return tuple(f"{m}.{attr}" for m in _ZERO_MODULES)


def _comm(attr: str, maps_to: str) -> Symbol:
    return Symbol((f"deepspeed.comm.{attr}",), f"{_COMM}:{attr}", maps_to)


def _stand_in(names: tuple[str, ...], instead: str) -> Symbol:
    return Symbol(names, f"{_STAND_INS}:{names[0]}", instead, stand_in=True)


_TRAIN = ("hf_zero trains through the Trainer (`--zero_config ds.json`, `--deepspeed` accepted) or "
          "`hf_zero.initialize(model, 'ds.json')`, whose engine takes DeepSpeed's forward/backward/step loop")
_ENGINE = "the engine is `hf_zero.ZeroEngine` (built by `hf_zero.initialize`)"
_INFERENCE = "hf_zero has no inference engine; load the saved model with `from_pretrained`"
_ESTIMATE = ("hf_zero's estimator covers stages 0-3 and their offloads: `hf-zero estimate --model MODEL_DIR "
             "--num_gpus N` or `hf_zero.estimate_memory(MODEL_DIR, num_gpus=N)`")
_ZERO_OPTIMIZER = ("hf_zero's sharded optimizer lives inside its engine; scripts read `trainer.optimizer`, and "
                   "hf_zero's checkpoints hold no DeepSpeed objects (nothing to allow for torch.load)")
_PIPE = "hf_zero has no pipeline parallelism"


SYMBOLS: tuple[Symbol, ...] = (
    Symbol(_in_zero("GatheredParameters"), f"{_ZERO}:GatheredParameters",
           "the whole tensors of sharded (stage 2/3) parameters inside the block, through the same parameter "
           "objects; with `modifier_rank` the edits made there are broadcast from that rank into every rank's "
           "shard. Parameters that are not sharded are left alone (as DeepSpeed ignores those without `ds_id`)"),
    Symbol(_in_zero("Init"), f"{_ZERO}:Init",
           "at stages 2/3, hf_zero's low-memory loading: `from_pretrained` builds the model on the meta device "
           "on every local rank but 0, and the engine fills the shards from rank 0; a no-op at stages 0/1"),
    Symbol(_in_zero("register_external_parameter"), f"{_ZERO}:register_external_parameter",
           "no-op: the root unit's parameters are gathered for the whole forward"),
    Symbol(_in_zero("ZeroParamStatus"), f"{_ZERO}:ZeroParamStatus",
           "DeepSpeed's enum (AVAILABLE, NOT_AVAILABLE, INFLIGHT); sharded parameters carry `ds_status` "
           "NOT_AVAILABLE, AVAILABLE inside GatheredParameters"),
    Symbol(_in_zero("ZeroParamType"), f"{_ZERO}:ZeroParamType", "DeepSpeed's enum (NORMAL, PARTITIONED, REMOTE)"),
    Symbol(("deepspeed.runtime.zero.partition_parameters.is_zero_param",), f"{_ZERO}:is_zero_param",
           "`hasattr(param, 'ds_id')`, as DeepSpeed"),
    Symbol(("deepspeed.utils.set_z3_leaf_modules",), f"{_ZERO}:set_z3_leaf_modules",
           "no-op returning the matching modules: hf_zero gathers whole transformer blocks (MoE experts included)"),
    Symbol(("deepspeed.init_distributed", "deepspeed.comm.init_distributed"), f"{_COMM}:init_distributed",
           "hf_zero's process-group set-up (NCCL with CUDA, gloo without; the launcher's environment)"),
    _comm("is_initialized", "`torch.distributed.is_initialized`"),
    _comm("get_rank", "`torch.distributed.get_rank` (0 before a process group exists)"),
    _comm("get_world_size", "`torch.distributed.get_world_size` (1 before a process group exists)"),
    _comm("get_local_rank", "the launcher's `LOCAL_RANK` (0 without one)"),
    _comm("barrier", "`torch.distributed.barrier` (nothing to wait for before a process group exists)"),
    _comm("all_reduce", "`torch.distributed.all_reduce`"),
    _comm("broadcast", "`torch.distributed.broadcast`"),
    _comm("all_gather", "`torch.distributed.all_gather`"),
    _comm("all_gather_into_tensor", "`torch.distributed.all_gather_into_tensor`"),
    _comm("reduce", "`torch.distributed.reduce`"),
    _comm("reduce_scatter_tensor", "`torch.distributed.reduce_scatter_tensor`"),
    _comm("new_group", "`torch.distributed.new_group`"),
    _comm("ReduceOp", "`torch.distributed.ReduceOp`"),
    Symbol(("deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint",),
           f"{_FP32}:get_fp32_state_dict_from_zero_checkpoint",
           "the fp32 state dict of a DeepSpeed ZeRO checkpoint (`latest` + `global_stepN/`: DeepSpeed's names, "
           "order and values, read with `weights_only=True`; `tag=`, `exclude_frozen_parameters=`) or of an hf_zero "
           "checkpoint (`checkpoint-N/` or its `zero_state/`), read on one CPU process by hf_zero's safe checkpoint "
           "readers (as `hf-zero consolidate`)"),
    Symbol(("deepspeed.utils.zero_to_fp32.load_state_dict_from_zero_checkpoint",),
           f"{_FP32}:load_state_dict_from_zero_checkpoint",
           "that state dict loaded into the model on the CPU (`strict=False`, as DeepSpeed)"),
    Symbol(("deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict",),
           f"{_FP32}:convert_zero_checkpoint_to_fp32_state_dict",
           "`hf-zero consolidate` into a folder (fp32 safetensors that `from_pretrained` loads)"),
    Symbol(("deepspeed.__version__",), "hf_zero.deepspeed_api.symbols:VERSION",
           f"`{VERSION}` (not a DeepSpeed release)"),
    # --- imported at module level by scripts and test suites: working ---------------------------
    Symbol(("deepspeed.utils.logger",), f"{_LOGS}:logger",
           "the `DeepSpeed` logger, as DeepSpeed makes it (INFO, stdout, not propagated)"),
    Symbol(("deepspeed.utils.log_dist",), f"{_LOGS}:log_dist",
           "logs on the given ranks (all before a process group exists; `[-1]`: every rank), as DeepSpeed"),
    Symbol(("deepspeed.runtime.utils.see_memory_usage",), f"{_LOGS}:see_memory_usage",
           "with `force=True`, logs accelerator and host memory on rank 0, as DeepSpeed"),
    Symbol(("deepspeed.accelerator.get_accelerator", "deepspeed.get_accelerator"),
           "hf_zero.deepspeed_api.accelerator:get_accelerator",
           "an object with DeepSpeed's common accelerator methods (`device_name`, `current_device_name`, "
           "`device_count`, `set_device`, `synchronize`, `empty_cache`, `manual_seed(_all)`, memory figures, "
           "`is_bf16_supported`, `communication_backend_name`...) for CUDA, or the CPU and gloo; other "
           "attributes raise naming torch's device API"),
    Symbol(("deepspeed.ops.adam.FusedAdam",), f"{_OPS}:FusedAdam",
           "torch's AdamW (`adam_w_mode=True`, the default) or Adam, built as the config's `optimizer: Adam` "
           "section; `bias_correction=False` is refused"),
    Symbol(("deepspeed.ops.adam.DeepSpeedCPUAdam",), f"{_OPS}:DeepSpeedCPUAdam",
           "torch's AdamW (`adamw_mode=True`) or Adam, as FusedAdam; set `offload_optimizer` in the config "
           "for a CPU step"),
    Symbol(("deepspeed.add_config_arguments",), "hf_zero.deepspeed_api.arguments:add_config_arguments",
           "adds DeepSpeed's `--deepspeed`/`--deepspeed_config` group to the argparse parser, as DeepSpeed"),
    Symbol(("deepspeed.runtime.zero.config.ZeroStageEnum",), f"{_ZERO}:ZeroStageEnum",
           "DeepSpeed's enum (disabled, optimizer_states, gradients, weights)"),
    # --- imported at module level, nothing behind them: stand-ins that raise when used ------------
    _stand_in(("deepspeed.initialize",), _TRAIN),
    _stand_in(("deepspeed.DeepSpeedEngine", "deepspeed.runtime.engine.DeepSpeedEngine"), _ENGINE),
    _stand_in(("deepspeed.init_inference",), _INFERENCE),
    _stand_in(("deepspeed.utils.safe_get_full_fp32_param",),
              "`with deepspeed.zero.GatheredParameters(param): full = param.data.clone()`"),
    _stand_in(("deepspeed.utils.safe_get_full_grad",),
              "gradients are sharded between steps; read them inside the training step"),
    _stand_in(("deepspeed.utils.groups",),
              "hf_zero has no expert or sequence parallel groups; its data-parallel group is torch.distributed's "
              "default group"),
    _stand_in(("deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_live",), _ESTIMATE),
    _stand_in(("deepspeed.runtime.zero.stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live",), _ESTIMATE),
    _stand_in(("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3",), _ZERO_OPTIMIZER),
    _stand_in(("deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer",), _ZERO_OPTIMIZER),
    _stand_in(("deepspeed.runtime.fp16.loss_scaler.LossScaler",
               ), "hf_zero's loss scaler is part of its engine (the config's `fp16` section)"),
    _stand_in(("deepspeed.pipe.PipelineModule", "deepspeed.PipelineModule"), _PIPE),
    _stand_in(("deepspeed.pipe.LayerSpec",), _PIPE),
    _stand_in(("deepspeed.pipe.TiedLayerSpec",), _PIPE),
)

UNSUPPORTED: dict[str, str] = {
    "deepspeed.runtime.engine": _ENGINE,
    "deepspeed.inference": _INFERENCE,
    "deepspeed.ops": ("DeepSpeed's compiled ops (FusedLamb, DeepSpeedCPUAdagrad, FusedLion...; FusedAdam and "
                      "DeepSpeedCPUAdam are provided) are not needed: name the optimizer in the config's "
                      "`optimizer` section or with `--optim`, and use `offload_optimizer` for a CPU step"),
    "deepspeed.accelerator": "use torch's device API (`torch.cuda`, `torch.accelerator`)",
    "deepspeed.checkpoint": ("hf_zero's checkpoints: `trainer.save_model(dir)` (from_pretrained), Trainer "
                             "checkpoints (resumable, any world size), `hf-zero consolidate`"),
    "deepspeed.runtime.lr_schedules": "the config's `scheduler` section (WarmupLR, WarmupDecayLR, WarmupCosineLR...)",
    "deepspeed.runtime.zero.stage3": "hf_zero's stage 3 is FSDP2 (`hf_zero.gathered_parameters(model)` for full weights)",
    "deepspeed.moe": "hf_zero has no expert parallelism; MoE models train with their experts sharded like other blocks",
    "deepspeed.pipe": _PIPE,
    "deepspeed.launcher": "launch with `hf-zero run` (it takes the DeepSpeed launcher's single-node options)",
    "deepspeed.profiling": "use `torch.profiler`",
    "deepspeed.monitor": "the Trainer's `--report_to` (tensorboard, wandb, ...)",
    "deepspeed.compression": "hf_zero has no compression library",
    "deepspeed.sequence": "hf_zero has no sequence parallelism",
}


def modules() -> set[str]:
    """Every module of the namespace: each dotted prefix of a symbol's name."""
    out: set[str] = set()
    for symbol in SYMBOLS:
        for name in symbol.names:
            parts = name.split(".")
            out.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return out


def attributes(module: str) -> dict[str, str]:
    """``{attribute: target}`` of the symbols that live directly in ``module``."""
    out = {}
    for symbol in SYMBOLS:
        for name in symbol.names:
            parent, _, attr = name.rpartition(".")
            if parent == module:
                out[attr] = symbol.target
    return out


def advice_for(name: str) -> str:
    """The clear error for ``name`` (a module or attribute outside the namespace)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        hint = UNSUPPORTED.get(".".join(parts[:i]))
        if hint is not None:
            return f"{name} is not part of hf_zero's DeepSpeed API: {hint}. See docs/deepspeed_compat.md."
    covered = ", ".join(sorted(m for m in modules() if m.count(".") <= 1))
    return (f"{name} is not part of hf_zero's DeepSpeed API (it covers {covered}: the symbols fine-tuning scripts "
            "use). See docs/deepspeed_compat.md for the list and for hf_zero's equivalents.")
