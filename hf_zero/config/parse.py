"""Read a DeepSpeed-style config (path, dict, JSON string, base64 JSON, or several fragments) into
hf_zero's frozen :class:`~hf_zero.config.schema.ZeroConfig`.

This module is the only place that knows DeepSpeed's key names: the alias/deprecation mapping
(``stage3_*`` -> field names, ``cpu_offload`` -> ``offload_optimizer.device="cpu"``), the one
:data:`NO_EFFECT_KEYS` table of keys hf_zero accepts without acting on them, and the
:data:`UNSUPPORTED` table of settings that would change numerics in a way hf_zero does not implement
(those are errors, never silent no-ops). ``"auto"`` values are kept as :data:`AUTO`;
:mod:`hf_zero.config.auto` resolves them.

Defaults follow DeepSpeed's code (``deepspeed/runtime/config.py``, ``constants.py``,
``zero/config.py``, ``zero/offload_config.py``, ``lr_schedules.py``); docs/config_reference.md lists
where that code and DeepSpeed's docs disagree.
"""

from __future__ import annotations

import base64
import binascii
import copy
import dataclasses
import difflib
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Union

from hf_zero.config import schema as S
from hf_zero.config.errors import ZeroConfigError, ZeroConfigWarning, format_problem, show_value
from hf_zero.config.schema import AUTO, ZeroConfig

__all__ = [
    "NO_EFFECT_KEYS",
    "UNSUPPORTED",
    "ConfigSource",
    "describe_no_effect",
    "load_raw",
    "merge_configs",
    "parse_config",
]

ConfigSource = Union[str, "os.PathLike[str]", Mapping[str, Any], list, tuple]
"""A path (``.json``/``.yaml``/``.yml``), a dict, a JSON string, base64-encoded JSON, or a list of
those (fragments deep-merged in order, later wins)."""

# --------------------------------------------------------------------------------------------------
# The no-effect table: dotted DeepSpeed key -> why it changes nothing in hf_zero.
# A key listed here is accepted (any value, unless UNSUPPORTED below rejects the value); a section key
# (``flops_profiler``) accepts the whole sub-tree. Keys the user actually set end up in
# ``ZeroConfig.no_effect_keys`` and are reported once at start-up (``describe_no_effect``).
# --------------------------------------------------------------------------------------------------
NO_EFFECT_KEYS: dict[str, str] = {
    # top level
    "steps_per_print": "progress is logged by the Trainer (--logging_steps)",
    "wall_clock_breakdown": "hf_zero has no DeepSpeed timers; use the Trainer's logs or torch.profiler",
    "memory_breakdown": "hf_zero has no DeepSpeed memory logger; use torch.cuda.memory_summary()",
    "dump_state": "hf_zero has no DeepSpeed state dump",
    "zero_allow_untested_optimizer": "hf_zero accepts any torch optimizer the Trainer builds",
    "zero_force_ds_cpu_optimizer": "there is no DeepSpeed CPU Adam; offloaded steps run torch optimizers on CPU",
    "flops_profiler": "hf_zero has no DeepSpeed flops profiler; use torch.profiler",
    "comms_logger": "hf_zero has no DeepSpeed comms logger; use TORCH_DISTRIBUTED_DEBUG=DETAIL or torch.profiler",
    "autotuning": "hf_zero has no DeepSpeed autotuner",
    "elasticity": "disabled elasticity changes nothing (enabled elasticity is rejected)",
    "amp": "disabled Apex AMP changes nothing (enabled AMP is rejected)",
    "data_types": "the gradient accumulation dtype follows hf_zero's precision policy",
    "fp32_allreduce": "gradients are reduced in fp32 unless communication_data_type says otherwise",
    "disable_allgather": "parameters are always all-gathered by torch's FSDP2",
    "sparse_gradients": "gradients are reduced as dense tensors",
    "vocabulary_size": "DeepSpeed only uses it for a tensor-core alignment warning",
    "dataloader_drop_last": "the Trainer's --dataloader_drop_last controls this",
    "nebula": "no Nebula service; checkpoints use torch.distributed.checkpoint",
    "eigenvalue": "only used by DeepSpeed's MoQ quantizer",
    "progressive_layer_drop": "disabled PLD changes nothing (enabled PLD is rejected)",
    "curriculum_learning": "disabled curriculum learning changes nothing (enabled is rejected)",
    "data_efficiency": "disabled data efficiency changes nothing (enabled is rejected)",
    "quantize_training": "disabled MoQ changes nothing (enabled is rejected)",
    "hybrid_engine": "disabled hybrid engine changes nothing (enabled is rejected)",
    "compression_training": "an empty section changes nothing (compression settings are rejected)",
    "weight_quantization": "an empty section changes nothing (quantized weights are rejected)",
    "sparse_attention": "only applies to models built from DeepSpeed's SparseSelfAttention modules",
    "pipeline": "hf_zero is data parallel only; pipeline settings apply to DeepSpeed's PipelineModule",
    "tensor_parallel": "tensor parallel size 1 changes nothing (autotp_size > 1 is rejected)",
    "sequence_parallel_size": "size 1 changes nothing (sequence parallelism is rejected)",
    "seq_parallel_communication_data_type": "hf_zero has no sequence parallelism",
    "compile": "use the Trainer's --torch_compile",
    "torch_autocast": "disabled torch_autocast changes nothing (use bf16/fp16 sections to enable mixed precision)",
    "timers": "hf_zero has no DeepSpeed throughput timers",
    "comet": "use the Trainer's --report_to comet_ml",
    "tensorboard": "use the Trainer's --report_to tensorboard",
    "wandb": "use the Trainer's --report_to wandb",
    "csv_monitor": "use the Trainer's --report_to (CSV logs are not written by hf_zero)",
    "activation_checkpointing": "use the Trainer's --gradient_checkpointing",
    # checkpoint
    "checkpoint.tag_validation": "sharded checkpoints carry no DeepSpeed tag to validate",
    "checkpoint.load_universal": "hf_zero checkpoints always reshard on load (any world size)",
    "checkpoint.parallel_write": "applies to DeepSpeed's pipeline-parallel checkpoint writer",
    # precision
    "fp16.auto_cast": "floating-point inputs are always cast to the compute dtype",
    "fp16.fp16_master_weights_and_grads": "false changes nothing (true is rejected: master weights stay fp32)",
    "bf16.immediate_grad_update": "DeepSpeed bf16-optimizer detail; gradients are applied at the optimizer step",
    "bf16.check_grad_overflow": "bf16 needs no overflow check (no loss scaling)",
    "bf16.loss_scale": "bf16 uses no loss scaling",
    "bf16.loss_scale_window": "bf16 uses no loss scaling",
    "bf16.initial_scale_power": "bf16 uses no loss scaling",
    "bf16.hysteresis": "bf16 uses no loss scaling",
    "bf16.consecutive_hysteresis": "bf16 uses no loss scaling",
    "bf16.min_loss_scale": "bf16 uses no loss scaling",
    "bf16.auto_cast": "floating-point inputs are always cast to the compute dtype",
    # optimizer / scheduler
    "optimizer.legacy_fusion": "DeepSpeed fp16-optimizer detail",
    "optimizer.params.torch_adam": "hf_zero always uses torch's Adam/AdamW",
    "optimizer.params.set_grad_none": "gradients are always set to None by zero_grad",
    "optimizer.params.eps_inside_sqrt": "false changes nothing (true is rejected)",
    "scheduler.params.last_batch_iteration": "resuming restores the scheduler state from the checkpoint",
    # aio (NVMe)
    "aio.use_gds": "no GPUDirect Storage; NVMe swaps go through pinned host memory",
    # zero_optimization
    "zero_optimization.contiguous_gradients": "FSDP2 always reduces into contiguous buffers",
    "zero_optimization.reduce_scatter": "stages 2/3 always reduce-scatter gradients",
    "zero_optimization.allgather_partitions": "stages 2/3 always all-gather parameters",
    "zero_optimization.round_robin_gradients": "DeepSpeed stage 1/2 CPU-offload copy detail",
    "zero_optimization.load_from_fp32_weights": "fp32 master weights are always restored from checkpoints",
    "zero_optimization.elastic_checkpoint": "checkpoints always reshard on load",
    "zero_optimization.ignore_unused_parameters": "unused parameters are always tolerated",
    "zero_optimization.legacy_stage1": "there is one stage-1 implementation",
    "zero_optimization.zero_hpz_partition_size": "no ZeRO++ hierarchical partitioning; parameters shard across all ranks",
    "zero_optimization.zero_quantized_weights": "false changes nothing (true is rejected)",
    "zero_optimization.zero_quantized_nontrainable_weights": "false changes nothing (true is rejected)",
    "zero_optimization.zero_quantized_gradients": "false changes nothing (true is rejected)",
    "zero_optimization.zeropp_loco_param": "only used with ZeRO++ quantized gradients",
    "zero_optimization.mics_shard_size": "no MiCS sub-group sharding; parameters shard across all ranks",
    "zero_optimization.mics_hierarchical_params_gather": "no MiCS sub-group sharding",
    "zero_optimization.memory_efficient_linear": "DeepSpeed stage-3 linear-layer patch; FSDP2 needs none",
    "zero_optimization.pipeline_loading_checkpoint": "DeepSpeed pipeline-parallel loading detail",
    "zero_optimization.override_module_apply": "DeepSpeed stage-3 nn.Module.apply patch; FSDP2 needs none",
    "zero_optimization.use_multi_rank_bucket_allreduce": "DeepSpeed stage 1/2 bucketing detail",
    "zero_optimization.stage3_model_persistence_threshold": "persistence is decided per parameter (param_persistence_threshold)",
    "zero_optimization.model_persistence_threshold": "persistence is decided per parameter (param_persistence_threshold)",
    "zero_optimization.stage3_module_granularity_threshold": "FSDP2 units are transformer blocks (_no_split_modules)",
    "zero_optimization.module_granularity_threshold": "FSDP2 units are transformer blocks (_no_split_modules)",
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": "parameters are fetched with FSDP2's all-gather",
    "zero_optimization.use_all_reduce_for_fetch_params": "parameters are fetched with FSDP2's all-gather",
    "zero_optimization.log_trace_cache_warnings": "hf_zero has no DeepSpeed stage-3 trace cache",
    "zero_optimization.offload_optimizer.fast_init": "DeepSpeed NVMe init detail",
    "zero_optimization.offload_param.buffer_size": "NVMe parameter swaps move whole FSDP units; buffer_count sets the read-ahead depth",
    "zero_optimization.offload_optimizer.pipeline_read": "the NVMe swapper always reads ahead",
    "zero_optimization.offload_optimizer.pipeline_write": "the NVMe swapper always writes behind",
    "zero_optimization.offload_optimizer.pipeline": "the NVMe swapper always reads ahead and writes behind",
}


def _enabled(value: Any) -> bool:
    return isinstance(value, Mapping) and value.get("enabled") is True


def _true(value: Any) -> bool:
    return value is True


def _nonempty(value: Any) -> bool:
    return bool(value)


def _always(value: Any) -> bool:
    return True


def _gt1(field: str | None = None) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        v = value.get(field) if (field and isinstance(value, Mapping)) else value
        try:
            return v is not None and not isinstance(v, bool) and float(v) > 1
        except (TypeError, ValueError):
            return False

    return check


# Settings that would change numerics (or batch semantics) in ways hf_zero does not implement:
# dotted key -> (predicate on the value, what to do instead). Checked before NO_EFFECT_KEYS, so a
# benign value (``false``, ``enabled: false``) is merely a no-effect key.
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "amp": (_enabled, 'Apex AMP is not available; remove "amp" and use "bf16": {"enabled": true} or "fp16": {"enabled": true}'),
    "elasticity": (_enabled, "elastic batch sizing is not implemented; remove it and set train_micro_batch_size_per_gpu / gradient_accumulation_steps"),
    "progressive_layer_drop": (_enabled, "progressive layer drop is not implemented; remove it"),
    "curriculum_learning": (_enabled, "curriculum learning is not implemented; remove it (or schedule sequence length in your data collator)"),
    "data_efficiency": (_enabled, "DeepSpeed data efficiency is not implemented; remove it"),
    "quantize_training": (_enabled, "MoQ quantized training is not implemented; remove it"),
    "hybrid_engine": (_enabled, "the DeepSpeed-Chat hybrid engine is not implemented; remove it"),
    "torch_autocast": (_enabled, 'use "bf16": {"enabled": true} or "fp16": {"enabled": true} instead'),
    "compression_training": (_nonempty, "DeepSpeed Compression is not implemented; remove compression_training"),
    "weight_quantization": (_nonempty, "quantized weights are not implemented; remove weight_quantization"),
    "tensor_parallel": (_gt1("autotp_size"), "hf_zero is data parallel only; remove tensor_parallel (or set autotp_size to 1)"),
    "sequence_parallel_size": (_gt1(), "hf_zero is data parallel only; set sequence_parallel_size to 1"),
    "fp16.fp16_master_weights_and_grads": (_true, "hf_zero keeps fp32 master weights; set it to false or remove it"),
    "optimizer.params.max_grad_norm": (_always, 'gradient clipping is a top-level setting: use "gradient_clipping" instead (DeepSpeed rejects it here too)'),
    "optimizer.params.eps_inside_sqrt": (_true, "the Lamb eps-inside-sqrt variant is not implemented; remove it"),
    "zero_optimization.zero_quantized_weights": (_true, "ZeRO++ quantized weights change numerics and are not implemented; set it to false"),
    "zero_optimization.zero_quantized_nontrainable_weights": (_true, "quantized frozen weights are not implemented; set it to false (for QLoRA load the model with bitsandbytes instead)"),
    "zero_optimization.zero_quantized_gradients": (_true, "ZeRO++ quantized gradients change numerics and are not implemented; set it to false"),
}

SUPPORTED_OPTIMIZERS = ("adam", "adamw", "sgd", "lion", "lamb")
_OPTIMIZER_DISPLAY = "Adam, AdamW, SGD, Lion or Lamb"
# DeepSpeed optimizer names hf_zero knows but does not implement (deepspeed/runtime/config.py
# DEEPSPEED_OPTIMIZERS): compressed-communication or MuP variants would change the update rule.
_UNSUPPORTED_OPTIMIZERS = {
    "onebitadam": "1-bit Adam compresses the update",
    "zerooneadam": "0/1 Adam compresses the update",
    "onebitlamb": "1-bit Lamb compresses the update",
    "adagrad": "Adagrad is not implemented",
    "muadam": "MuP optimizers are not implemented",
    "muadamw": "MuP optimizers are not implemented",
    "musgd": "MuP optimizers are not implemented",
}

SCHEDULER_TYPES: dict[str, type] = {
    "WarmupLR": S.WarmupLRParams,
    "WarmupDecayLR": S.WarmupDecayLRParams,
    "WarmupCosineLR": S.WarmupCosineLRParams,
    "OneCycle": S.OneCycleParams,
    "LRRangeTest": S.LRRangeTestParams,
}
# DeepSpeed's OneCycle(optimizer, cycle_min_lr, cycle_max_lr, ...) has no defaults for these.
_REQUIRED_SCHEDULER_PARAMS = {"OneCycle": ("cycle_min_lr", "cycle_max_lr")}

_BAD = object()  # a converter recorded a problem; the value is dropped


# --------------------------------------------------------------------------------------------------
# Loading: path | dict | JSON string | base64 JSON -> (deep-copied dict, source name)
# --------------------------------------------------------------------------------------------------
class _DuplicateKey(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # DeepSpeed rejects duplicate keys too (config_utils.dict_raise_error_on_duplicate_keys); json's
    # default silently keeps the last one, which hides copy-paste mistakes.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _json_hint(text: str, err: json.JSONDecodeError) -> str:
    at = text[err.pos : err.pos + 2] if err.pos < len(text) else ""
    before = text[: err.pos].rstrip()[-1:] if err.pos else ""
    if at.startswith("//") or at.startswith("/*") or at.startswith("#"):
        return "JSON does not allow comments (DeepSpeed reads hjson); remove them"
    if before == "," and at[:1] in ("}", "]"):
        return "remove the trailing comma"
    if at.startswith("'"):
        return "JSON strings and keys need double quotes"
    return "fix the JSON syntax there"


def _loads_json(text: str, where: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as err:
        raise ZeroConfigError(
            f"{where}:{err.lineno}:{err.colno}: invalid JSON at line {err.lineno}, column {err.colno}: "
            f"{err.msg}; {_json_hint(text, err)}"
        ) from None
    except _DuplicateKey as dup:
        raise ZeroConfigError(
            f'{where}: key "{dup.key}" appears twice in one object; keep only one of them'
        ) from None


def _loads_yaml(text: str, where: str) -> Any:
    try:
        import yaml
    except ImportError:  # pragma: no cover - pyyaml is a dependency
        raise ZeroConfigError(f"{where}: reading YAML needs PyYAML; pip install pyyaml or use JSON") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        if mark is not None:
            line, col = mark.line + 1, mark.column + 1
            reason = getattr(err, "problem", None) or str(err)
            raise ZeroConfigError(
                f"{where}:{line}:{col}: invalid YAML at line {line}, column {col}: {reason}; fix the YAML syntax there"
            ) from None
        raise ZeroConfigError(f"{where}: invalid YAML: {err}; fix the YAML syntax") from None


def _read_file(path: Path) -> tuple[Any, str]:
    where = str(path)
    if not path.exists():
        raise ZeroConfigError(
            f"{where}: config file not found (working directory: {os.getcwd()}); check the path"
        )
    if path.is_dir():
        raise ZeroConfigError(f"{where}: is a directory; give the path of the .json or .yaml config file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ZeroConfigError(f"{where}: cannot read the config file ({err}); check its permissions and encoding") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        return _loads_yaml(text, where), where
    return _loads_json(text, where), where


def _try_base64(text: str) -> str | None:
    # HF's HfDeepSpeedConfig and DeepSpeed accept urlsafe base64 of the JSON text.
    compact = "".join(text.split())
    if not compact or len(compact) % 4 == 1:
        return None
    padded = compact + "=" * (-len(compact) % 4)
    for decode in (base64.urlsafe_b64decode, base64.standard_b64decode):
        try:
            decoded = decode(padded.encode("ascii")).decode("utf-8").strip()
        except (binascii.Error, UnicodeDecodeError, UnicodeEncodeError, ValueError):
            continue
        if decoded.startswith("{"):
            return decoded
    return None


def load_raw(source: ConfigSource) -> tuple[dict[str, Any], str]:
    """Load one config source into a fresh ``dict`` (the caller's dict is deep-copied, never mutated).

    Args:
        source: A path (``str``/``PathLike``; ``.yaml``/``.yml`` read as YAML, anything else as JSON),
            a ``dict``, a JSON object string, or base64-encoded JSON.

    Returns:
        ``(config_dict, source_name)`` where ``source_name`` is the path, ``"<dict>"``,
        ``"<json string>"`` or ``"<base64 json>"``.

    Raises:
        ZeroConfigError: The file is missing or malformed (the message gives line and column), the
            string is neither a file, JSON nor base64 JSON, or the document is not an object.
    """
    if isinstance(source, Mapping):
        data, where = copy.deepcopy(dict(source)), "<dict>"
    elif isinstance(source, os.PathLike):
        data, where = _read_file(Path(os.fspath(source)).expanduser())
    elif isinstance(source, (str, bytes)):
        text = source.decode("utf-8") if isinstance(source, bytes) else source
        stripped = text.strip()
        if not stripped:
            raise ZeroConfigError("<json string>: the config is an empty string; give a path, a dict or a JSON object")
        if stripped[0] in "{[":
            data, where = _loads_json(stripped, "<json string>"), "<json string>"
        else:
            path = Path(stripped).expanduser()
            looks_like_path = (
                path.suffix.lower() in (".json", ".yaml", ".yml")
                or os.sep in stripped
                or path.exists()
            )
            decoded = None if looks_like_path else _try_base64(stripped)
            if decoded is not None:
                data, where = _loads_json(decoded, "<base64 json>"), "<base64 json>"
            elif looks_like_path or len(stripped) < 16:
                data, where = _read_file(path)
            else:
                raise ZeroConfigError(
                    f"{stripped[:60]!r}: is not an existing file, a JSON object or base64-encoded JSON; "
                    "give the path of a .json/.yaml config"
                )
    else:
        raise ZeroConfigError(
            f"<{type(source).__name__}>: a config must be a path, a dict, a JSON string or base64 JSON, "
            f"not {type(source).__name__}"
        )
    if data is None:
        data = {}  # an empty YAML file
    if not isinstance(data, dict):
        raise ZeroConfigError(
            f"{where}: the config must be an object ({{...}}) at the top level, got {type(data).__name__} "
            f"{show_value(data)[:60]}; wrap the settings in {{ }}"
        )
    return data, where


def _deep_merge(base: dict, extra: dict, origin: str, origins: dict[str, str], prefix: str = "") -> None:
    for key, value in extra.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value, origin, origins, dotted + ".")
        else:
            base[key] = copy.deepcopy(value)
            _mark_origin(value, origin, origins, dotted)
        origins.setdefault(dotted, origin)


def _mark_origin(value: Any, origin: str, origins: dict[str, str], dotted: str) -> None:
    # A replaced sub-tree comes wholly from `origin`: drop stale entries below it first.
    for key in [k for k in origins if k == dotted or k.startswith(dotted + ".")]:
        del origins[key]
    origins[dotted] = origin
    if isinstance(value, dict):
        for k, v in value.items():
            _mark_origin(v, origin, origins, f"{dotted}.{k}")


# --------------------------------------------------------------------------------------------------
# Converters: (parser, dotted key, raw value) -> typed value, or _BAD after recording a problem.
# --------------------------------------------------------------------------------------------------
Converter = Callable[["_Parser", str, Any], Any]


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


def _number(value: Any) -> int | float | None:
    """``2e8``, ``"2e8"``, ``500000000``, ``"8"`` -> a number; bools and other strings -> None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            return float(text)
        except ValueError:
            return None
    return None


def _auto_refused(p: "_Parser", key: str, value: Any) -> Any:
    p.problem(key, value, "is not allowed here: hf_zero fills \"auto\" only for the keys in the "
              "\"auto\" table of docs/config_reference.md", "write a value")
    return _BAD


def _int(
    minimum: int | None = None, maximum: int | None = None, auto: bool = False, hint: str | None = None
) -> Converter:
    def convert(p: "_Parser", key: str, value: Any) -> Any:
        if _is_auto(value):
            return AUTO if auto else _auto_refused(p, key, value)
        n = _number(value)
        example = hint or ("write a whole number such as 8 or 2e8" + (' or "auto"' if auto else ""))
        if n is None:
            p.problem(key, value, "is not a number", example)
            return _BAD
        if isinstance(n, float):
            if not math.isfinite(n) or n != int(n):
                p.problem(key, value, "is not a whole number", example)
                return _BAD
            n = int(n)
        if minimum is not None and n < minimum:
            p.problem(key, value, f"is below the minimum {minimum}", hint or f"write a number >= {minimum}")
            return _BAD
        if maximum is not None and n > maximum:
            p.problem(key, value, f"is above the maximum {maximum}", hint or f"write a number <= {maximum}")
            return _BAD
        return n

    return convert


def _float(
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    exclusive_min: bool = False,
    auto: bool = False,
) -> Converter:
    def convert(p: "_Parser", key: str, value: Any) -> Any:
        if _is_auto(value):
            return AUTO if auto else _auto_refused(p, key, value)
        n = _number(value)
        if n is None or not math.isfinite(n):
            p.problem(key, value, "is not a finite number", "write a number such as 1e-5" + (' or "auto"' if auto else ""))
            return _BAD
        n = float(n)
        if minimum is not None and (n <= minimum if exclusive_min else n < minimum):
            p.problem(key, value, f"must be {'>' if exclusive_min else '>='} {minimum:g}", "write a value in range")
            return _BAD
        if maximum is not None and n > maximum:
            p.problem(key, value, f"must be <= {maximum:g}", "write a value in range")
            return _BAD
        return n

    return convert


def _bool(auto: bool = False) -> Converter:
    def convert(p: "_Parser", key: str, value: Any) -> Any:
        if isinstance(value, bool):
            return value
        if _is_auto(value):
            return AUTO if auto else _auto_refused(p, key, value)
        p.problem(key, value, "is not a boolean",
                  "write true or false (JSON booleans, without quotes)" + (' or "auto"' if auto else ""))
        return _BAD

    return convert


def _choice(choices: Mapping[str, str], *, case_sensitive: bool = False) -> Converter:
    """``choices`` maps accepted spellings to the canonical value."""

    def convert(p: "_Parser", key: str, value: Any) -> Any:
        if isinstance(value, str):
            probe = value if case_sensitive else value.lower()
            table = choices if case_sensitive else {k.lower(): v for k, v in choices.items()}
            if probe in table:
                return table[probe]
        canon = sorted(set(choices.values()))
        close = difflib.get_close_matches(str(value).lower(), [c.lower() for c in canon], n=1, cutoff=0.5)
        fix = f'did you mean "{close[0]}"? ' if close else ""
        p.problem(key, value, "is not one of " + ", ".join(f'"{c}"' for c in canon), fix + "use one of those")
        return _BAD

    return convert


def _str() -> Converter:
    def convert(p: "_Parser", key: str, value: Any) -> Any:
        if isinstance(value, str):
            return value
        p.problem(key, value, "is not a string", "write a quoted string")
        return _BAD

    return convert


def _path() -> Converter:
    def convert(p: "_Parser", key: str, value: Any) -> Any:
        if isinstance(value, str) and value.strip():
            return value
        p.problem(key, value, "is not a folder path", 'write a path such as "/local_nvme"')
        return _BAD

    return convert


def _betas(auto: bool = True) -> Converter:
    def convert(p: "_Parser", key: str, value: Any) -> Any:
        if _is_auto(value):
            return AUTO if auto else _auto_refused(p, key, value)
        if isinstance(value, (list, tuple)) and len(value) == 2:
            nums = [_number(v) for v in value]
            if all(n is not None and 0.0 <= n < 1.0 for n in nums):
                return (float(nums[0]), float(nums[1]))
        p.problem(key, value, "is not a pair of numbers in [0, 1)", 'write two numbers such as [0.9, 0.999] or "auto"')
        return _BAD

    return convert


def _dict() -> Converter:
    def convert(p: "_Parser", key: str, value: Any) -> Any:
        if isinstance(value, dict):
            return copy.deepcopy(value)
        p.problem(key, value, "is not an object", "write {...}")
        return _BAD

    return convert


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
    "stage3_gather_16bit_weights_on_model_save": ("gather_16bit_weights_on_model_save", _bool()),
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
}
_OPTIMIZER_PARAMS["adamw"] = _OPTIMIZER_PARAMS["adam"]

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


# --------------------------------------------------------------------------------------------------
# The parser
# --------------------------------------------------------------------------------------------------
class _Parser:
    """One pass over a raw dict: collects every problem, then builds the frozen tree."""

    def __init__(self, source: str, strict: bool, origins: Mapping[str, str] | None = None):
        self.source = source
        self.strict = strict
        self.origins = dict(origins or {})
        self.problems: list[str] = []
        self.no_effect: list[str] = []
        self.explicit: set[str] = set()

    # -- reporting ---------------------------------------------------------------------------------
    def source_of(self, dotted: str) -> str:
        key = dotted
        while key:
            if key in self.origins:
                return self.origins[key]
            key = key.rpartition(".")[0]
        return self.source

    def problem(self, key: str, value: Any, issue: str, fix: str | None = None) -> None:
        self.problems.append(format_problem(self.source_of(key), key, value, issue, fix))

    def unknown(self, dotted: str, key: str, candidates: list[str], value: Any = None) -> None:
        close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
        if not close:
            lowered = {c.lower(): c for c in candidates}
            close = [lowered[key.lower()]] if key.lower() in lowered else []
        parent = dotted[: -len(key)]
        if close:
            hint = f'did you mean "{parent}{close[0]}"?'
        else:
            known = ", ".join(sorted(candidates)[:12]) + (", ..." if len(candidates) > 12 else "")
            hint = f"keys known here: {known}"
        shown = show_value(value)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        message = (f'{self.source_of(dotted)}: unknown key "{dotted}" (value {shown}); {hint} '
                   "(parse with strict=False to only warn)")
        if self.strict:
            self.problems.append(message)
        else:
            warnings.warn(message, ZeroConfigWarning, stacklevel=4)

    def note_no_effect(self, dotted: str) -> None:
        if dotted not in self.no_effect:
            self.no_effect.append(dotted)

    def special(self, dotted: str, value: Any) -> bool:
        """Handle keys from UNSUPPORTED / NO_EFFECT_KEYS; True when the key was consumed."""
        rule = UNSUPPORTED.get(dotted)
        if rule is not None and rule[0](value):
            self.problem(dotted, value, "is not supported by hf_zero", rule[1])
            return True
        if dotted in NO_EFFECT_KEYS:
            self.note_no_effect(dotted)
            return True
        return False

    # -- sections ----------------------------------------------------------------------------------
    def section(
        self,
        path: str,
        raw: Any,
        fields: Fields,
        *,
        field_prefix: str,
        aliases: Mapping[str, str] | None = None,
        skip: tuple[str, ...] = (),
    ) -> dict[str, Any]:
        """Convert the keys of one JSON object into dataclass keyword arguments.

        ``skip`` keys are left for the caller (sub-sections, legacy switches).
        """
        aliases = aliases or {}
        if raw is None:
            return {}
        if not isinstance(raw, dict):
            self.problem(path, raw, "is not an object", "write {...} with the section's keys")
            return {}
        out: dict[str, Any] = {}
        set_by: dict[str, tuple[str, Any]] = {}
        for key, value in raw.items():
            dotted = f"{path}.{key}" if path else key
            if key in skip:
                continue
            canonical = aliases.get(key, key)
            if canonical in fields:
                canonical_dotted = f"{path}.{canonical}" if path else canonical
                if value is None:  # JSON null = the default (DeepSpeed's get_scalar_param does the same)
                    continue
                name, convert = fields[canonical]
                converted = convert(self, dotted, value)
                if converted is _BAD:
                    continue
                if name in out and out[name] != converted:
                    other_key, other_value = set_by[name]
                    self.problem(dotted, value, f"conflicts with {other_key}={show_value(other_value)}",
                                 "keep only one of the two names")
                    continue
                out[name] = converted
                set_by[name] = (dotted, value)
                self.explicit.add(f"{field_prefix}{name}")
                if canonical_dotted in NO_EFFECT_KEYS:
                    self.note_no_effect(canonical_dotted)
                continue
            if self.special(dotted, value):
                continue
            candidates = list(fields) + list(aliases) + list(skip) + _children(path, NO_EFFECT_KEYS)
            self.unknown(dotted, key, candidates, value)
        return out

    # -- whole document ----------------------------------------------------------------------------
    def build(self, raw: dict[str, Any]) -> ZeroConfig:
        for old, new in _TOP_ALIASES.items():
            if old in raw:
                if new in raw:
                    self.problem(old, raw[old], f"is the old name of {new}, which is also set", f"keep only {new}")
                else:
                    raw[new] = raw[old]
                raw = {k: v for k, v in raw.items() if k != old}
        top = self.section("", raw, _TOP, field_prefix="", skip=_TOP_SECTIONS)

        zero = self.zero_section(raw.get("zero_optimization"))
        fp16 = self.section("fp16", raw.get("fp16"), _FP16, field_prefix="fp16.")
        bf16 = self.section("bf16", raw.get("bf16"), _BF16, field_prefix="bf16.")
        optimizer = self.optimizer_section(raw.get("optimizer"))
        scheduler = self.scheduler_section(raw.get("scheduler"))
        aio = self.section("aio", raw.get("aio"), _AIO, field_prefix="aio.", aliases=_AIO_ALIASES)
        act = self.section("activation_checkpointing", raw.get("activation_checkpointing"), _ACT_CKPT,
                           field_prefix="activation_checkpointing.")
        ckpt = self.section("checkpoint", raw.get("checkpoint"), _CHECKPOINT, field_prefix="checkpoint.")
        monitors = {
            name: self.section(name, raw.get(name), fields, field_prefix=f"{name}.")
            for name, fields in _MONITORS.items()
        }
        for name in ("activation_checkpointing", *_MONITORS):
            if raw.get(name):
                self.note_no_effect(name)

        if fp16.get("enabled") is True and bf16.get("enabled") is True:
            self.problem("bf16.enabled", True, "conflicts with fp16.enabled=true (both enabled)",
                         "enable only one of fp16 and bf16 (or set both to \"auto\")")

        if self.problems:
            raise ZeroConfigError(self.problems)

        return ZeroConfig(
            **top,
            fp16=S.FP16Config(**fp16),
            bf16=S.BF16Config(**bf16),
            optimizer=optimizer,
            scheduler=scheduler,
            zero_optimization=zero,
            aio=S.AioConfig(**aio),
            activation_checkpointing=S.ActivationCheckpointingConfig(**act),
            checkpoint=S.CheckpointConfig(**ckpt),
            tensorboard=S.MonitorConfig(**monitors["tensorboard"]),
            wandb=S.MonitorConfig(**monitors["wandb"]),
            csv_monitor=S.MonitorConfig(**monitors["csv_monitor"]),
            source=self.source,
            no_effect_keys=tuple(self.no_effect),
            explicit_keys=tuple(sorted(self.explicit)),
        )

    def zero_section(self, raw: Any) -> S.ZeroOptimizationConfig:
        if isinstance(raw, bool):
            # Pre-2020 format "zero_optimization": true meant stage 1 (zero/config.py
            # read_zero_config_deprecated).
            raw = {"stage": 1 if raw else 0}
        path = "zero_optimization"
        kw = self.section(path, raw, _ZERO, field_prefix=f"{path}.", aliases=_ZERO_ALIASES,
                          skip=("offload_optimizer", "offload_param", *_ZERO_LEGACY_OFFLOAD))
        raw = raw if isinstance(raw, dict) else {}
        stage = kw.get("stage", 0)
        # An invalid stage was already reported; checks that depend on it would only add noise.
        stage_known = "stage" in kw or raw.get("stage") is None

        opt = self.section(f"{path}.offload_optimizer", raw.get("offload_optimizer"), _OFFLOAD_OPTIMIZER,
                           field_prefix=f"{path}.offload_optimizer.")
        par = self.section(f"{path}.offload_param", raw.get("offload_param"), _OFFLOAD_PARAM,
                           field_prefix=f"{path}.offload_param.")
        self.legacy_offload(path, raw, opt, par)

        opt_device, par_device = opt.get("device", "none"), par.get("device", "none")
        if par_device != "none" and stage != 3 and stage_known:
            self.problem(f"{path}.offload_param.device", par_device,
                         f"needs ZeRO stage 3 (zero_optimization.stage is {stage})",
                         "set zero_optimization.stage to 3, or remove offload_param "
                         "(offload_optimizer works at stages 1-3)")
        if opt_device != "none" and stage == 0 and stage_known:
            self.problem(f"{path}.offload_optimizer.device", opt_device,
                         "needs ZeRO stage 1, 2 or 3 (zero_optimization.stage is 0)",
                         "set zero_optimization.stage to 1, 2 or 3, or set the device to \"none\"")
        for name, section in (("offload_optimizer", opt), ("offload_param", par)):
            if section.get("device") == "nvme" and not section.get("nvme_path"):
                self.problem(f"{path}.{name}.device", "nvme", "needs a folder for swap files",
                             f'add "nvme_path": "/path/on/fast/disk" to zero_optimization.{name}')
        if opt.get("ratio", 1.0) < 1.0 and stage != 3 and stage_known:
            # DeepSpeed asserts the same (zero/config.py offload_ratio_check).
            self.problem(f"{path}.offload_optimizer.ratio", opt["ratio"],
                         f"partial offload needs ZeRO stage 3 (zero_optimization.stage is {stage})",
                         "set ratio to 1.0 or use stage 3")

        if "overlap_comm" not in kw:
            # DeepSpeed: overlap_comm None -> stage == 3 (zero/config.py overlap_comm_valid).
            kw["overlap_comm"] = stage == 3
        return S.ZeroOptimizationConfig(
            **kw,
            offload_optimizer=S.OffloadOptimizerConfig(**opt),
            offload_param=S.OffloadParamConfig(**par),
        )

    def legacy_offload(self, path: str, raw: dict, opt: dict, par: dict) -> None:
        """``cpu_offload`` -> offload_optimizer.device=cpu; ``cpu_offload_param(s)`` ->
        offload_param.device=cpu; ``cpu_offload_use_pin_memory`` -> pin_memory of those."""
        flags: dict[str, bool] = {}
        for key in _ZERO_LEGACY_OFFLOAD:
            if key in raw and raw[key] is not None:
                value = _bool()(self, f"{path}.{key}", raw[key])
                if value is not _BAD:
                    flags[key] = value
        param_flag = flags.get("cpu_offload_param", flags.get("cpu_offload_params"))
        for flag, target, section, name in (
            (flags.get("cpu_offload"), opt, "offload_optimizer", "cpu_offload"),
            (param_flag, par, "offload_param",
             "cpu_offload_param" if "cpu_offload_param" in flags else "cpu_offload_params"),
        ):
            if not flag:
                continue
            if target.get("device", "cpu") != "cpu":
                # DeepSpeed refuses a deprecated key that contradicts its replacement too.
                self.problem(f"{path}.{name}", flag,
                             f'contradicts {path}.{section}.device="{target["device"]}" (it is the old spelling '
                             f'of device "cpu")', f"remove {name} and keep {section}")
            else:
                target["device"] = "cpu"
                self.explicit.add(f"{path}.{section}.device")
        pin = flags.get("cpu_offload_use_pin_memory")
        if pin is not None:
            for target in (opt, par):
                if target.get("device") == "cpu" and "pin_memory" not in target:
                    target["pin_memory"] = pin

    def drop_foreign_params(
        self, path: str, params: Any, type_name: str, fields: Fields, every: set[str]
    ) -> Any:
        """Report parameters that belong to another optimizer/scheduler type (a clearer message
        than "unknown key") and return the params without them."""
        if not isinstance(params, dict):
            return params
        kept = {}
        for key, value in params.items():
            if key in every and key not in fields:
                self.problem(f"{path}.{key}", value, f"is not a parameter of {type_name}",
                             f"{type_name} takes {', '.join(fields)}; remove it or change the type")
            else:
                kept[key] = value
        return kept

    def optimizer_section(self, raw: Any) -> S.OptimizerConfig | None:
        if raw is None:
            return None
        if not isinstance(raw, dict):
            self.problem("optimizer", raw, "is not an object", 'write {"type": "AdamW", "params": {...}}')
            return None
        for key, value in raw.items():
            if key not in ("type", "params") and not self.special(f"optimizer.{key}", value):
                self.unknown(f"optimizer.{key}", key, ["type", "params", *_children("optimizer", NO_EFFECT_KEYS)],
                             value)
        type_name = raw.get("type")
        if not isinstance(type_name, str) or not type_name.strip():
            self.problem("optimizer.type", type_name, "is missing or not a string",
                         f"set it to one of {_OPTIMIZER_DISPLAY}")
            return None
        canonical = type_name.strip().lower()
        if canonical not in SUPPORTED_OPTIMIZERS:
            if canonical in _UNSUPPORTED_OPTIMIZERS:
                self.problem("optimizer.type", type_name,
                             f"is not supported by hf_zero ({_UNSUPPORTED_OPTIMIZERS[canonical]})",
                             f"use {_OPTIMIZER_DISPLAY}")
            else:
                close = difflib.get_close_matches(canonical, SUPPORTED_OPTIMIZERS, n=1, cutoff=0.6)
                fix = (f'did you mean "{close[0]}"? ' if close else "") + f"use {_OPTIMIZER_DISPLAY}"
                self.problem("optimizer.type", type_name, "is not an optimizer hf_zero implements", fix)
            return None
        params = self.drop_foreign_params(
            "optimizer.params", raw.get("params"), type_name, _OPTIMIZER_PARAMS[canonical],
            set().union(*_OPTIMIZER_PARAMS.values()),
        )
        kw = self.section("optimizer.params", params, _OPTIMIZER_PARAMS[canonical], field_prefix="optimizer.")
        if canonical == "adamw":
            if kw.get("adam_w_mode") is False:
                # DeepSpeed ignores it as well (engine.py: effective_adam_w_mode = name == adamw or ...).
                warnings.warn(
                    f'{self.source_of("optimizer")}: optimizer.params.adam_w_mode=false has no effect with '
                    'type "AdamW" (as in DeepSpeed); use type "Adam" with adam_w_mode false for L2-style decay',
                    ZeroConfigWarning, stacklevel=3,
                )
            kw["adam_w_mode"] = True
        return S.OptimizerConfig(type=canonical, **kw)

    def scheduler_section(self, raw: Any) -> S.SchedulerConfig | None:
        if raw is None:
            return None
        if not isinstance(raw, dict):
            self.problem("scheduler", raw, "is not an object", 'write {"type": "WarmupLR", "params": {...}}')
            return None
        for key, value in raw.items():
            if key not in ("type", "params") and not self.special(f"scheduler.{key}", value):
                self.unknown(f"scheduler.{key}", key, ["type", "params"], value)
        type_name = raw.get("type")
        if type_name not in SCHEDULER_TYPES:
            names = list(SCHEDULER_TYPES)
            close = [n for n in names if isinstance(type_name, str) and n.lower() == type_name.lower()]
            close = close or difflib.get_close_matches(str(type_name), names, n=1, cutoff=0.6)
            fix = (f'did you mean "{close[0]}"? (names are case-sensitive, as in DeepSpeed) ' if close else "")
            self.problem("scheduler.type", type_name, "is not a scheduler hf_zero implements",
                         fix + "use one of " + ", ".join(names))
            return None
        params = self.drop_foreign_params(
            "scheduler.params", raw.get("params"), type_name, _SCHEDULER_PARAMS[type_name],
            set().union(*_SCHEDULER_PARAMS.values()),
        )
        kw = self.section("scheduler.params", params, _SCHEDULER_PARAMS[type_name],
                          field_prefix="scheduler.params.")
        for required in _REQUIRED_SCHEDULER_PARAMS.get(type_name, ()):
            if required not in kw and f"scheduler.params.{required}" not in self.explicit:
                self.problems.append(
                    f"{self.source_of('scheduler')}: scheduler.params.{required} is missing but required by "
                    f"{type_name} (DeepSpeed has no default for it); add it to scheduler.params"
                )
        params_cls = SCHEDULER_TYPES[type_name]
        return S.SchedulerConfig(type=type_name, params=params_cls(**kw))


# --------------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------------
def parse_config(source: ConfigSource, *, strict: bool = True) -> ZeroConfig:
    """Parse a DeepSpeed-style config into a frozen :class:`ZeroConfig` (``"auto"`` values kept).

    Args:
        source: A path to a ``.json``/``.yaml``/``.yml`` file, a dict (deep-copied, never mutated),
            a JSON object string, base64-encoded JSON, or a list/tuple of those (fragments merged
            with :func:`merge_configs`).
        strict: When True (default) an unknown key is an error; when False it is a
            :class:`~hf_zero.config.errors.ZeroConfigWarning`.

    Returns:
        The parsed config. ``cfg.unresolved()`` lists the keys still ``"auto"``;
        ``cfg.no_effect_keys`` the accepted keys that change nothing; ``cfg.explicit_keys`` the
        field paths the user wrote.

    Raises:
        ZeroConfigError: Every problem found (unknown keys, wrong types, values out of range,
            unsupported settings, inconsistent sections), one line each, naming the source, the
            dotted key, the value and what to write instead.
    """
    if isinstance(source, ZeroConfig):
        return source
    if isinstance(source, (list, tuple)):
        return merge_configs(*source, strict=strict)
    raw, where = load_raw(source)
    return _Parser(where, strict).build(raw)


def merge_configs(*sources: ConfigSource, strict: bool = True) -> ZeroConfig:
    """Deep-merge config fragments in order (later wins) and parse the result.

    Lets a section kept in its own file (``optimizer.json``, ``scheduler.json``) join a
    ``zero_optimization`` file. Nested objects merge key by key; any other value replaces.

    Args:
        *sources: Config sources as accepted by :func:`load_raw` (at least one).
        strict: As in :func:`parse_config`.

    Returns:
        The parsed merged config; its ``source`` is the sources joined with ``" + "``. Problem
        messages name the fragment that set the offending key.

    Raises:
        ZeroConfigError: As :func:`parse_config`, or when no source is given.
    """
    if not sources:
        raise ZeroConfigError("merge_configs: no config given; pass at least one path, dict or JSON string")
    merged: dict[str, Any] = {}
    origins: dict[str, str] = {}
    names: list[str] = []
    for src in sources:
        raw, where = load_raw(src)
        names.append(where)
        _deep_merge(merged, raw, where, origins)
    return _Parser(" + ".join(names), strict, origins if len(sources) > 1 else None).build(merged)


def describe_no_effect(cfg: ZeroConfig) -> list[str]:
    """One line per accepted key that changes nothing in hf_zero, for the engine to log once.

    Args:
        cfg: A parsed config.

    Returns:
        Lines such as ``"zero_optimization.round_robin_gradients: no effect in hf_zero (DeepSpeed
        stage 1/2 CPU-offload copy detail)"``, in the order the keys appeared.
    """
    return [
        f"{key}: no effect in hf_zero ({NO_EFFECT_KEYS.get(key, 'accepted for compatibility')})"
        for key in cfg.no_effect_keys
    ]

