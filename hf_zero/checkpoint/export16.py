"""Export the full weights of a (possibly sharded) model as safetensors that ``from_pretrained`` loads.

``save_16bit_model`` is what ``stage3_gather_16bit_weights_on_model_save`` asks for: every rank
gathers the full weights **one tensor at a time** (``DTensor.full_tensor()`` is a collective, so
every rank calls it in the same order), and only the writing rank keeps a CPU copy, one
safetensors shard at a time, so host memory on that rank peaks at one shard (``max_shard_size``),
not the whole model.

The output is what ``transformers``' ``save_pretrained`` writes: ``model.safetensors``, or
``model-00001-of-0000N.safetensors`` shards plus ``model.safetensors.index.json``, and
``config.json`` / ``generation_config.json``; tied weights are written once (the tied copy is
re-tied by ``from_pretrained``). For a peft model only the adapter is written
(``adapter_model.safetensors`` + ``adapter_config.json``, keys as ``get_peft_model_state_dict``
makes them), which ``PeftModel.from_pretrained(base, dir)`` loads.

Writes are atomic: files are written into a temporary directory next to ``output_dir`` and moved
in, weights first and the file that makes the set complete (the index, or the adapter config) last;
an interrupted export never leaves a complete-looking but partial model.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hf_zero.distributed.collectives import agree_on_error, on_mesh_device
from hf_zero.engine.scalar_params import lifted_keys, restore_scalar_keys

__all__ = [
    "save_16bit_model",
    "gather_full_state_dict",
    "unwrap_model",
    "resolve_dtype",
    "tied_groups",
    "peft_adapter_key_map",
    "save_model_config",
]

logger = logging.getLogger("hf_zero")

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
# transformers' shard names: model-00001-of-00003.safetensors
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

_DTYPE_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``torch.bfloat16`` for ``"bf16"``/``"bfloat16"``/``torch.bfloat16`` (and fp16, fp32 alike).

    Raises:
        ValueError: an unknown name.
    """
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPE_NAMES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of fp32, bf16, fp16") from None


def unwrap_model(model: Any) -> nn.Module:
    """The user's module inside a ``ZeroEngine`` and/or ``DistributedDataParallel`` wrapper.

    FSDP2 shards in place, so an FSDP2 model is its own unwrapped module.
    """
    for _ in range(4):  # engine -> DDP -> module at most; the bound guards against odd cycles
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif not isinstance(model, nn.Module) and isinstance(getattr(model, "module", None), nn.Module):
            model = model.module  # ZeroEngine (duck-typed: checkpoint code does not import the engine)
        else:
            break
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, a DDP wrapper or a ZeroEngine, got {type(model).__name__}")
    return model


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# ----------------------------------------------------------------------------------------------- gather
def tied_groups(module: nn.Module, names: Iterable[str] | None = None) -> list[list[str]]:
    """Groups of state-dict keys that are the same tensor (tied weights), kept key first.

    The kept key is the one ``save_pretrained`` keeps: not a tie target of the model
    (``all_tied_weights_keys``, e.g. ``lm_head.weight`` when tied to ``model.embed_tokens.weight``),
    else the first in state-dict order.
    """
    state = module.state_dict(keep_vars=True)
    wanted = set(names) if names is not None else None
    by_id: dict[int, list[str]] = {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor) and (wanted is None or name in wanted):
            by_id.setdefault(id(value), []).append(name)
    targets = set(getattr(module, "all_tied_weights_keys", None) or getattr(module, "_tied_weights_keys", None) or ())
    groups = []
    for group in by_id.values():
        if len(group) > 1:
            group.sort(key=lambda n: n in targets)  # stable: targets last, otherwise state-dict order
            groups.append(group)
    return groups


def _cpu_copy(full: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """A CPU tensor that shares no memory with ``source`` (a live parameter or its shard)."""
    out = full.detach().to("cpu")
    if out.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
        out = out.clone()
    return out.contiguous()


def _gather_one(value: torch.Tensor, dtype: torch.dtype | None, keep: bool) -> torch.Tensor | None:
    """Full tensor of ``value`` cast to ``dtype``; every rank must call this (collective for DTensors)."""
    value = value.detach()
    cast = dtype is not None and value.is_floating_point() and value.dtype != dtype
    if isinstance(value, DTensor):
        local = value.to_local()
        if cast:
            # Cast the shard before gathering: identical result, and 16-bit all-gathers move half the bytes.
            value = value.to(dtype)
        full = on_mesh_device(value).full_tensor()
    else:
        local = value
        full = value.to(dtype) if cast else value
    if not keep:
        return None
    return _cpu_copy(full, local)


def gather_full_state_dict(
    model: Any,
    dtype: torch.dtype | str | None = None,
    *,
    state_dict_filter: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Gather the full (unsharded) state dict onto rank 0 as CPU tensors, one tensor at a time.

    Every rank must call it (stages 2/3 gather with collectives). Works on an FSDP2 model, a plain
    or DDP-wrapped module (stages 0/1), or a ``ZeroEngine``. Tied keys share one tensor object.
    Given the engine, NVMe-swapped parameter shards are read back for the gather; given the bare
    module of an ``offload_param: nvme`` run, hold ``engine.params_resident()`` around the call.

    Args:
        model: the model, its DDP wrapper, or the engine.
        dtype: cast floating-point tensors to this dtype (``None`` keeps the stored dtype, fp32 for
            the FSDP2 master weights); non-float buffers are never cast.
        state_dict_filter: keep only the keys for which it returns True.

    Returns:
        On rank 0, ``{key: cpu tensor}`` in state-dict order; on other ranks ``{}``.
    """
    resident = getattr(model, "params_resident", None)  # a ZeroEngine: NVMe-swapped shards back first
    if callable(resident) and not isinstance(model, nn.Module):
        with resident():
            return gather_full_state_dict(unwrap_model(model), dtype, state_dict_filter=state_dict_filter)
    module = unwrap_model(model)
    dtype = resolve_dtype(dtype)
    state = module.state_dict(keep_vars=True)
    names = [n for n in state if isinstance(state[n], torch.Tensor) and (state_dict_filter is None or state_dict_filter(n))]
    keep = _rank() == 0
    out: dict[str, torch.Tensor] = {}
    first_by_id: dict[int, str] = {}
    for name in names:
        original = first_by_id.setdefault(id(state[name]), name)
        if original != name:  # tied: gather once, share the tensor
            if keep:
                out[name] = out[original]
            continue
        tensor = _gather_one(state[name], dtype, keep)
        if keep:
            out[name] = tensor
    return restore_scalar_keys(out, lifted_keys(module))


# ----------------------------------------------------------------------------------------------- peft
def _is_peft_model(module: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(module, PeftModel)


def peft_adapter_key_map(module: nn.Module) -> dict[str, str] | None:
    """For a peft model, ``{model state-dict key: adapter-file key}`` of its active adapter; else None.

    The adapter keys are exactly those ``peft.get_peft_model_state_dict`` produces (adapter name
    removed, e.g. ``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``). Computed
    from names only, so it needs no gathering.
    """
    module = unwrap_model(module)
    if not _is_peft_model(module):
        return None
    from peft import get_peft_model_state_dict

    state = module.state_dict(keep_vars=True)
    key_of_id: dict[int, str] = {}
    for key, value in state.items():
        key_of_id.setdefault(id(value), key)
    adapter = get_peft_model_state_dict(module, state_dict=state, adapter_name=module.active_adapter)
    mapping: dict[str, str] = {}
    for adapter_key, value in adapter.items():
        source = key_of_id.get(id(value))
        if source is None:
            raise NotImplementedError(
                f"peft produced adapter entry {adapter_key!r} that is not a tensor of the model's state dict; "
                "hf_zero cannot gather it"
            )
        mapping[source] = adapter_key
    return mapping


# ----------------------------------------------------------------------------------------------- files
@dataclass(frozen=True)
class ShardPlan:
    """Which keys go to which file (``filename -> [keys]``) and, when sharded, the index to write."""

    files: dict[str, list[str]]
    index: dict[str, Any] | None


def plan_shards(
    sizes: dict[str, int], max_shard_size: int | str, *, weights_name: str = WEIGHTS_NAME, total_parameters: int | None = None
) -> ShardPlan:
    """Split keys (in order, with their byte sizes) into files the way ``save_pretrained`` names them."""
    from huggingface_hub import split_state_dict_into_shards_factory

    pattern = weights_name.replace(".safetensors", "{suffix}.safetensors")
    split = split_state_dict_into_shards_factory(
        sizes, get_storage_size=lambda n: n, filename_pattern=pattern, max_shard_size=max_shard_size
    )
    files = {f: list(keys) for f, keys in split.filename_to_tensors.items()}
    if not split.is_sharded:
        return ShardPlan(files={weights_name: [k for keys in files.values() for k in keys]}, index=None)
    metadata: dict[str, Any] = dict(split.metadata)
    if total_parameters is not None:
        metadata = {"total_parameters": total_parameters, **metadata}
    return ShardPlan(files=files, index={"metadata": metadata, "weight_map": dict(split.tensor_to_filename)})


def write_safetensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write one safetensors file with transformers' ``{"format": "pt"}`` metadata."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})


def write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def make_temp_dir(target: str) -> str:
    """An empty directory next to ``target`` (same filesystem, so files move in by rename)."""
    target = os.path.abspath(target)
    parent, base = os.path.split(target.rstrip(os.sep))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{base}.tmp-{uuid.uuid4().hex[:12]}")
    os.makedirs(tmp)
    return tmp


def publish_files(tmp_dir: str, output_dir: str, order: list[str], *, stale: Callable[[str], bool] | None = None) -> None:
    """Move the files ``order`` from ``tmp_dir`` into ``output_dir`` one by one, in that order.

    Put the file that makes the output complete (index, adapter config) last. Before moving, files
    of a previous export that the new one does not replace and that would make a mixed set look
    complete (``stale(name)`` true: an old index, shards of another count) are removed; an empty
    ``output_dir`` is replaced by renaming the whole temporary directory.
    """
    output_dir = os.path.abspath(output_dir)
    if not os.path.exists(output_dir):
        os.replace(tmp_dir, output_dir)
        return
    new = set(order)
    if stale is not None:
        for name in sorted(os.listdir(output_dir)):
            if name not in new and stale(name) and os.path.isfile(os.path.join(output_dir, name)):
                os.remove(os.path.join(output_dir, name))
    for name in order:
        os.replace(os.path.join(tmp_dir, name), os.path.join(output_dir, name))
    shutil.rmtree(tmp_dir, ignore_errors=True)


def _is_weight_file(name: str) -> bool:
    return name in (WEIGHTS_NAME, WEIGHTS_INDEX_NAME) or bool(_SHARD_RE.match(name))


def save_model_config(module: nn.Module, directory: str, dtype: torch.dtype | None) -> list[str]:
    """``config.json`` (and ``generation_config.json``) as ``save_pretrained`` writes them."""
    config = getattr(module, "config", None)
    written: list[str] = []
    if config is None or not hasattr(config, "save_pretrained"):
        return written
    config = copy.deepcopy(config)
    # save_pretrained records the class and the saved dtype; FSDP2 renames the class FSDP<Name>.
    config.architectures = [type(module).__name__.removeprefix("FSDP")]
    if dtype is not None:
        config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(directory)
    written.append(CONFIG_NAME)
    can_generate = getattr(module, "can_generate", None)
    generation_config = getattr(module, "generation_config", None)
    if generation_config is not None and callable(can_generate) and can_generate():
        generation_config.save_pretrained(directory)
        written.append(GENERATION_CONFIG_NAME)
    return written


# ----------------------------------------------------------------------------------------------- export
def save_16bit_model(
    model: Any,
    output_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | str | None = torch.bfloat16,
    max_shard_size: int | str = "5GB",
    is_main_process: bool | None = None,
    safe_serialization: bool = True,
    state_dict_filter: Callable[[str], bool] | None = None,
    save_config: bool = True,
) -> list[str]:
    """Gather the full weights and write them as a ``from_pretrained``-loadable directory.

    Every rank must call it, in the same order as the other collectives; only the main process
    writes. For a peft model only the active adapter is written.

    Args:
        model: the model (FSDP2-sharded at stages 2/3, plain or DDP-wrapped at stages 0/1) or a
            ``ZeroEngine``.
        output_dir: directory to write into (created if missing; other files in it are kept, files
            of a previous export are replaced).
        dtype: dtype of the written floating-point weights (``torch.bfloat16``, ``torch.float16``,
            ``torch.float32`` or ``"bf16"``/``"fp16"``/``"fp32"``); ``None`` keeps the stored dtype.
        max_shard_size: largest file (``"5GB"``, ``"200MB"`` or bytes); above it the weights are
            split into ``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json``.
        is_main_process: whether this process writes; default: rank 0.
        safe_serialization: must be True (safetensors is the only format written).
        state_dict_filter: export only the keys for which it returns True.
        save_config: also write ``config.json`` and ``generation_config.json`` (full models).

    Returns:
        The file names written into ``output_dir`` (on the main process; ``[]`` elsewhere).

    Raises:
        ValueError: ``safe_serialization=False``, or an unknown dtype.
        RuntimeError: the write failed on the main process (raised on every rank, so none hangs).
    """
    if not safe_serialization:
        raise ValueError("hf_zero writes safetensors only; pass safe_serialization=True")
    module = unwrap_model(model)
    dtype = resolve_dtype(dtype)
    if is_main_process is None:
        is_main_process = _rank() == 0
    output_dir = os.fspath(output_dir)

    adapter_keys = peft_adapter_key_map(module)
    state = module.state_dict(keep_vars=True)
    if adapter_keys is not None:
        names = [n for n in state if n in adapter_keys and (state_dict_filter is None or state_dict_filter(n))]
        weights_name = ADAPTER_WEIGHTS_NAME
    else:
        names = [n for n in state if isinstance(state[n], torch.Tensor) and (state_dict_filter is None or state_dict_filter(n))]
        weights_name = WEIGHTS_NAME
    dropped = {n for group in tied_groups(module, names) for n in group[1:]}
    names = [n for n in names if n not in dropped]
    lifted = lifted_keys(module)  # 0-dim parameters stored as (1,) for FSDP2: saved as they were
    out_key = (lambda n: adapter_keys[n]) if adapter_keys is not None else (lambda n: lifted.get(n, n))

    def nbytes(n: str) -> int:
        t = state[n]
        itemsize = (dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size())
        return t.numel() * itemsize

    plan = plan_shards(
        {out_key(n): nbytes(n) for n in names},
        max_shard_size if adapter_keys is None else 1 << 62,  # peft loads one adapter file
        weights_name=weights_name,
        total_parameters=sum(state[n].numel() for n in names),
    )
    source_of = {out_key(n): n for n in names}

    error: BaseException | None = None
    tmp: str | None = None
    written: list[str] = []
    try:
        if is_main_process:
            tmp = make_temp_dir(output_dir)
        for filename, keys in plan.files.items():
            shard: dict[str, torch.Tensor] = {}
            for key in keys:  # every rank walks the same keys in the same order (collectives)
                tensor = _gather_one(state[source_of[key]], dtype, keep=is_main_process and error is None)
                if tensor is not None and source_of[key] in lifted:
                    tensor = tensor.reshape(())
                if tensor is not None:
                    shard[key] = tensor
            if is_main_process and error is None:
                try:
                    write_safetensors(os.path.join(tmp, filename), shard)
                except BaseException as exc:  # keep gathering so the other ranks do not hang
                    error = exc
            del shard
        if is_main_process and error is None:
            written = _finish_export(module, tmp, output_dir, plan, adapter_keys is not None, save_config, dtype)
    except BaseException as exc:
        error = exc
    if tmp is not None and error is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    agree_on_error(error, f"saving the model to {output_dir}")
    return written if is_main_process else []


def _finish_export(
    module: nn.Module, tmp: str, output_dir: str, plan: ShardPlan, is_adapter: bool, save_config: bool, dtype
) -> list[str]:
    weights = list(plan.files)
    extra: list[str] = []
    if is_adapter:
        peft_config = copy.deepcopy(module.peft_config[module.active_adapter])
        # As PeftModel.save_pretrained: the saved config is for inference and names its base model.
        peft_config.inference_mode = True
        if getattr(peft_config, "base_model_name_or_path", None) is None:
            base = getattr(getattr(module, "base_model", None), "model", None)
            peft_config.base_model_name_or_path = getattr(getattr(base, "config", None), "_name_or_path", None)
        peft_config.save_pretrained(tmp)
        last = [ADAPTER_CONFIG_NAME]
        stale = lambda name: name in (ADAPTER_WEIGHTS_NAME, ADAPTER_CONFIG_NAME)  # noqa: E731
    else:
        if save_config:
            extra = save_model_config(module, tmp, dtype)
        last = []
        if plan.index is not None:
            write_json(os.path.join(tmp, WEIGHTS_INDEX_NAME), plan.index)
            last = [WEIGHTS_INDEX_NAME]
        stale = _is_weight_file
    order = weights + extra + last
    publish_files(tmp, output_dir, order, stale=stale)
    return order
