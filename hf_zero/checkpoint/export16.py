"""Export the full weights of a (possibly sharded) model as safetensors that ``from_pretrained`` loads.

``save_16bit_model`` is what ``stage3_gather_16bit_weights_on_model_save`` asks for and what
``ZeroTrainer.save_model`` writes: every rank gathers the full weights **one tensor at a time**
(``DTensor.full_tensor()`` is a collective, so every rank calls it in the same order), and the
writing rank appends each tensor to its safetensors file as soon as it has it
(:mod:`~hf_zero.checkpoint.safetensors_stream`), so host memory on that rank peaks at about one
tensor, never the whole model.

The output is what ``transformers``' ``save_pretrained`` writes (:mod:`~hf_zero.checkpoint.pretrained_files`):
``model.safetensors``, or ``model-00001-of-0000N.safetensors`` shards plus
``model.safetensors.index.json``, and ``config.json`` / ``generation_config.json`` (and a
remote-code model's ``*.py``); tied weights are written once (the tied copy is re-tied by
``from_pretrained``), ``_keys_to_ignore_on_save`` are left out, and weights transformers 5 re-lays
out on load are written back in the checkpoint layout (:mod:`~hf_zero.checkpoint.save_conversions`).
For a peft model only the adapter is written (``adapter_model.safetensors`` +
``adapter_config.json``, keys as ``get_peft_model_state_dict`` makes them), which
``PeftModel.from_pretrained(base, dir)`` loads.

Writes are atomic: files are written into a temporary directory next to ``output_dir`` and moved
in (the whole directory by one rename when ``output_dir`` does not exist yet; else file by file,
weights first and the file that makes the set complete, the index or the adapter config, last);
an interrupted export never leaves a complete-looking but partial model.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import shutil
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hf_zero.checkpoint.pretrained_files import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    is_weight_file,
    make_temp_dir,
    plan_shards,
    publish_files,
    save_model_config,
    write_json,
)
from hf_zero.checkpoint.safetensors_stream import SafetensorsStreamWriter
from hf_zero.checkpoint.save_conversions import save_key_map
from hf_zero.distributed.collectives import agree_on_error, on_mesh_device
from hf_zero.engine.scalar_params import lifted_keys, restore_scalar_keys

__all__ = [
    "save_16bit_model",
    "gather_full_state_dict",
    "unwrap_model",
    "params_resident",
    "resolve_dtype",
    "tied_groups",
    "peft_adapter_key_map",
]

logger = logging.getLogger("hf_zero")

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


class _Masters:
    """The fp32 masters of an offloaded optimizer (``OffloadManager.fp32_masters``), for an fp32
    export: with ``offload_optimizer`` the model holds 16-bit copies, and casting those up would
    export 16-bit values in fp32 clothing."""

    def __init__(self, tensors: dict[str, torch.Tensor], owners: dict[str, int] | None):
        self.tensors = tensors
        self.owners = owners

    def covers(self, name: str) -> bool:
        """Whether ``name`` has a master (the same answer on every rank: it decides collectives)."""
        return name in self.owners if self.owners is not None else name in self.tensors

    def gather(self, name: str, like: torch.Tensor, keep: bool) -> torch.Tensor | None:
        """The full fp32 master of ``name``; every rank must call it (a collective)."""
        if self.owners is None:  # stages 2/3: this rank's shard, as a DTensor like the parameter
            return _gather_one(self.tensors[name], torch.float32, keep)
        # Stages 0/1: the owner holds the whole master; it is sent to the others.
        owner = self.owners[name]
        if _rank() == owner:
            full = self.tensors[name].detach().to(like.device, torch.float32, copy=True)
        else:
            full = torch.empty(like.shape, dtype=torch.float32, device=like.device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(full, src=owner)
        return _cpu_copy(full, like) if keep else None


def _offload_masters(model: Any, dtype: torch.dtype | None) -> _Masters | None:
    """The masters to export for an fp32 export of an engine whose optimizer is offloaded."""
    if dtype != torch.float32 or isinstance(model, nn.Module):
        return None
    offload = getattr(model, "offload", None)
    if offload is None or not callable(getattr(offload, "fp32_masters", None)):
        return None
    tensors, owners = offload.fp32_masters()
    return _Masters(tensors, owners) if tensors or owners else None


def _gather_value(name: str, value: torch.Tensor, dtype: torch.dtype | None, keep: bool,
                  masters: _Masters | None) -> torch.Tensor | None:
    if masters is not None and masters.covers(name):
        return masters.gather(name, value, keep)
    return _gather_one(value, dtype, keep)


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
    with params_resident(model):
        module = unwrap_model(model)
        return _gather_state(module, dtype, state_dict_filter, _offload_masters(model, resolve_dtype(dtype)))


def params_resident(model: Any) -> contextlib.AbstractContextManager:
    """Given a ``ZeroEngine``, its NVMe-swapped parameter shards read back for the gather."""
    resident = getattr(model, "params_resident", None)
    if callable(resident) and not isinstance(model, nn.Module):
        return resident()
    return contextlib.nullcontext()


def _gather_state(module: nn.Module, dtype, state_dict_filter, masters: _Masters | None = None) -> dict[str, torch.Tensor]:
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
        tensor = _gather_value(name, state[name], dtype, keep, masters)
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
    extra_files: Callable[[str], Iterable[str]] | None = None,
    progress: bool = False,
) -> list[str]:
    """Gather the full weights and write them as a ``from_pretrained``-loadable directory.

    Every rank must call it, in the same order as the other collectives; only the main process
    writes. For a peft model only the active adapter is written. The main process holds one
    tensor at a time: each file's header is written first (shapes are known before gathering) and
    every tensor is appended as soon as it is gathered, so a 70B model saves on a host that could
    not hold it. Weights that transformers 5 re-lays out on load (fused MoE experts) are written in
    the original layout, as ``save_pretrained`` writes them.

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
        extra_files: called on the main process with the temporary directory before anything is
            published; writes more files there (a tokenizer, ``training_args.bin``) and returns
            their names, so they appear together with the weights.
        progress: show a progress bar over the tensors on the main process.

    Returns:
        The file names written into ``output_dir`` (on the main process; ``[]`` elsewhere).

    Raises:
        ValueError: ``safe_serialization=False``, or an unknown dtype.
        RuntimeError: the write failed on the main process (raised on every rank, so none hangs).
    """
    if not safe_serialization:
        raise ValueError("hf_zero writes safetensors only; pass safe_serialization=True")
    with params_resident(model):
        dtype = resolve_dtype(dtype)
        return _save_16bit(unwrap_model(model), os.fspath(output_dir), dtype, max_shard_size,
                           _rank() == 0 if is_main_process is None else is_main_process,
                           state_dict_filter, save_config, extra_files, progress, _offload_masters(model, dtype))


def _save_16bit(module, output_dir, dtype, max_shard_size, is_main_process, state_dict_filter, save_config,
                extra_files, progress, masters: _Masters | None = None) -> list[str]:
    adapter_keys = peft_adapter_key_map(module)
    state = module.state_dict(keep_vars=True)
    ignored = set(getattr(module, "_keys_to_ignore_on_save", None) or ())
    if adapter_keys is not None:
        names = [n for n in state if n in adapter_keys and (state_dict_filter is None or state_dict_filter(n))]
        weights_name = ADAPTER_WEIGHTS_NAME
    else:
        names = [
            n for n in state
            if isinstance(state[n], torch.Tensor) and n not in ignored and (state_dict_filter is None or state_dict_filter(n))
        ]
        weights_name = WEIGHTS_NAME
    dropped = {n for group in tied_groups(module, names) for n in group[1:]}
    names = [n for n in names if n not in dropped]
    lifted = lifted_keys(module)  # 0-dim parameters stored as (1,) for FSDP2: saved as they were
    out_key = (lambda n: adapter_keys[n]) if adapter_keys is not None else (lambda n: lifted.get(n, n))
    source_of = {out_key(n): n for n in names}

    def entry(n: str) -> tuple[tuple[int, ...], torch.dtype]:
        t = state[n]
        shape = () if n in lifted else tuple(t.shape)
        return shape, (dtype if dtype is not None and t.is_floating_point() else t.dtype)

    entries = {out_key(n): entry(n) for n in names}
    keymap = save_key_map(module, entries, enabled=adapter_keys is None)
    plan = plan_shards(
        {k: math.prod(shape) * dt.itemsize for k, (shape, dt) in entries.items()},
        max_shard_size if adapter_keys is None else 1 << 62,  # peft loads one adapter file
        weights_name=weights_name,
        total_parameters=sum(state[n].numel() for n in names),
    )

    error: BaseException | None = None
    tmp: str | None = None
    written: list[str] = []
    weight_map: dict[str, str] = {}
    bar = _progress_bar(len(names), progress and is_main_process)
    try:
        if is_main_process:
            tmp = make_temp_dir(output_dir)
        for filename, keys in plan.files.items():
            groups = keymap.groups(keys)
            writer = None
            if is_main_process and error is None:
                try:  # anything failing here must not stop this rank's gathers: the others wait in them
                    header = {k: v for group in groups for k, v in keymap.outputs(group).items()}
                    writer = SafetensorsStreamWriter(os.path.join(tmp, filename), header, metadata={"format": "pt"})
                    weight_map.update(dict.fromkeys(header, filename))
                except BaseException as exc:
                    error = exc
            for group in groups:  # every rank walks the same keys in the same order (collectives)
                keep = writer is not None and error is None
                gathered: dict[str, torch.Tensor] = {}
                for key in group:
                    tensor = _gather_value(source_of[key], state[source_of[key]], dtype, keep, masters)
                    if tensor is not None:
                        gathered[key] = tensor.reshape(()) if source_of[key] in lifted else tensor
                bar.update(len(group))
                if keep:
                    try:
                        for name, tensor in keymap.convert(gathered).items():
                            writer.write(name, tensor)
                    except BaseException as exc:
                        error = exc
                del gathered
            if writer is not None:
                try:
                    writer.close() if error is None else writer.abort()
                except BaseException as exc:
                    error = exc
        if is_main_process and error is None:
            index = plan.index
            if index is not None and keymap.converts:  # file keys differ from the state dict's
                index = {**index, "weight_map": weight_map}
            written = _finish_export(module, tmp, output_dir, plan.files, index, adapter_keys is not None,
                                     save_config, dtype, extra_files)
    except BaseException as exc:
        error = exc
    finally:
        bar.close()
    if tmp is not None and error is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    agree_on_error(error, f"saving the model to {output_dir}")
    return written if is_main_process else []


def _progress_bar(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Saving model", unit="tensor", disable=not enabled)


def _finish_export(
    module: nn.Module,
    tmp: str,
    output_dir: str,
    files: dict[str, list[str]],
    index: dict[str, Any] | None,
    is_adapter: bool,
    save_config: bool,
    dtype: torch.dtype | None,
    extra_files: Callable[[str], Iterable[str]] | None,
) -> list[str]:
    weights = list(files)
    extra: list[str] = list(extra_files(tmp)) if extra_files is not None else []
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
            extra += [n for n in save_model_config(module, tmp, dtype) if n not in extra]
        last = []
        if index is not None:
            write_json(os.path.join(tmp, WEIGHTS_INDEX_NAME), index)
            last = [WEIGHTS_INDEX_NAME]
        stale = is_weight_file
    # The tokenizer and config go in before the weights, and the file that completes the set last.
    order = [n for n in extra if n not in weights + last] + weights + last
    publish_files(tmp, output_dir, order, stale=stale)
    return order
