"""Turn a sharded hf_zero checkpoint into safetensors that ``from_pretrained`` loads, offline.

Runs in one CPU process with no process group and no GPU (``hf-zero consolidate CKPT OUT``): it
reads the DCP metadata (through :mod:`hf_zero.checkpoint.safe_load`, which runs nothing from the
checkpoint), then reads the model's tensors shard file by shard file (memory peaks at
about one output shard, ``max_shard_size``), casts them, and writes ``model.safetensors`` or
``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``. The config, generation
config, tokenizer and remote-code files found in the checkpoint directory are copied, so the output
is a complete model directory. A checkpoint of a peft model consolidates to its adapter
(``adapter_model.safetensors`` + ``adapter_config.json``).

A DeepSpeed ZeRO checkpoint (a Trainer ``checkpoint-N`` with ``latest`` and ``global_stepN/``)
consolidates too, read by :mod:`hf_zero.checkpoint.deepspeed_files` (restricted unpickling, one
rank's file at a time): the tensors, names and values of DeepSpeed's ``zero_to_fp32.py``.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import warnings
from typing import Any

import torch

from hf_zero.checkpoint.export16 import resolve_dtype
from hf_zero.checkpoint.pretrained_files import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    make_temp_dir,
    plan_shards,
    write_json,
    write_safetensors,
)
from hf_zero.checkpoint.safe_load import SafeFileSystemReader, load_state_dict
from hf_zero.checkpoint.sharded import MARKER_NAME, CheckpointError, read_marker, resolve_checkpoint_dir

__all__ = ["consolidate_checkpoint", "COPIED_FILE_PATTERNS"]

# Files of a model directory that are not weights: copied from the checkpoint when present.
COPIED_FILE_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "*.tiktoken",
    "chat_template.*",
    "preprocessor_config.json",
    "processor_config.json",
    "configuration_*.py",
    "modeling_*.py",
    "tokenization_*.py",
)
_MODULE_PREFIX = "module."


def consolidate_checkpoint(
    checkpoint_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "fp32",
    max_shard_size: int | str = "5GB",
    progress: bool = True,
) -> list[str]:
    """Write the model weights of a sharded checkpoint as a ``from_pretrained`` directory.

    Args:
        checkpoint_dir: a directory written by :func:`hf_zero.checkpoint.sharded.save_checkpoint`,
            or a Trainer checkpoint folder holding one such directory (its tokenizer and config
            files are copied too).
        output_dir: where to write; must not exist or be empty. Written into a temporary
            directory next to it and renamed, so an interrupted run leaves no partial output.
        dtype: ``"fp32"`` (the fp32 master weights, exact), ``"bf16"`` or ``"fp16"``.
        max_shard_size: largest output file (``"5GB"``, ``"500MB"`` or bytes).
        progress: show a tqdm bar over the tensors.

    Returns:
        The file names written into ``output_dir``.

    Raises:
        FileNotFoundError: ``checkpoint_dir`` does not exist.
        IncompleteCheckpointError: the checkpoint has no marker (its save did not finish).
        FileExistsError: ``output_dir`` exists and is not empty.
        CheckpointError: the checkpoint lacks tensors its marker lists, or one of its files holds
            something hf_zero never writes there (the error names the file; nothing from it runs).
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from tqdm.auto import tqdm

    from hf_zero.checkpoint.deepspeed_files.layout import find_deepspeed_checkpoint

    given = os.path.abspath(os.fspath(checkpoint_dir))
    out = os.path.abspath(os.fspath(output_dir))
    target = resolve_dtype(dtype)
    deepspeed = find_deepspeed_checkpoint(given) if os.path.isdir(given) and not _is_hf_zero_checkpoint(given) else None
    if deepspeed is not None:
        return _consolidate_deepspeed(deepspeed, out, target, max_shard_size, progress)
    src = resolve_checkpoint_dir(given)
    info = read_marker(src)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise FileExistsError(f"output directory {out} exists and is not empty; choose a new one")

    reader = SafeFileSystemReader(src)
    metadata = reader.read_metadata()  # read once, checked; every load below reuses it
    stored: dict[str, TensorStorageMetadata] = {
        k[len(_MODULE_PREFIX):]: v
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith(_MODULE_PREFIX) and isinstance(v, TensorStorageMetadata)
    }
    names = list(info.get("params") or stored)
    missing = [n for n in names if n not in stored]
    if missing:
        raise CheckpointError(f"{src}: the marker lists tensors the DCP data lacks: {', '.join(missing[:5])}")
    dropped = {n for group in info.get("tied") or [] for n in group[1:]}
    adapter_keys: dict[str, str] | None = info.get("peft_adapter_keys")
    if adapter_keys is not None:
        names = [n for n in names if n in adapter_keys]
        out_key = lambda n: adapter_keys[n]  # noqa: E731
        weights_name = ADAPTER_WEIGHTS_NAME
        max_shard_size = 1 << 62  # peft loads one adapter file
    else:
        scalars: dict[str, str] = info.get("scalar_keys") or {}  # saved under their original names, as 0-dim
        out_key = lambda n: scalars.get(n, n)  # noqa: E731
        weights_name = WEIGHTS_NAME
    names = [n for n in names if n not in dropped]

    def out_dtype(n: str) -> torch.dtype:
        saved = stored[n].properties.dtype
        return target if target is not None and saved.is_floating_point else saved

    def numel(n: str) -> int:
        count = 1
        for d in stored[n].size:
            count *= d
        return count

    plan = plan_shards(
        {out_key(n): numel(n) * out_dtype(n).itemsize for n in names},
        max_shard_size,
        weights_name=weights_name,
        total_parameters=sum(numel(n) for n in names),
    )
    source_of = {out_key(n): n for n in names}

    tmp = make_temp_dir(out)
    try:
        bar = tqdm(total=len(names), desc="Consolidating", unit="tensor", disable=not progress)
        for filename, keys in plan.files.items():
            # Read one output shard's tensors per DCP load: bounded memory, few passes over the files.
            request = {
                _MODULE_PREFIX + source_of[k]: torch.empty(
                    tuple(stored[source_of[k]].size), dtype=stored[source_of[k]].properties.dtype
                )
                for k in keys
            }
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
                load_state_dict(request, reader, no_dist=True)
            shard = {}
            for k in keys:
                value = request.pop(_MODULE_PREFIX + source_of[k]).to(out_dtype(source_of[k]))
                shard[k] = value.reshape(()) if k != source_of[k] and adapter_keys is None else value
                bar.update(1)
            write_safetensors(os.path.join(tmp, filename), shard)
            del shard, request
        bar.close()
        # The checkpoint's own config first, then the tokenizer etc. of the Trainer folder around it.
        return _publish(tmp, out, plan, [src, given], adapter=adapter_keys is not None, dtype=target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _is_hf_zero_checkpoint(path: str) -> bool:
    try:
        resolved = resolve_checkpoint_dir(path)
    except CheckpointError:
        return True  # hf_zero's (several of them): its own error follows
    return any(os.path.isfile(os.path.join(resolved, name)) for name in (MARKER_NAME, ".metadata"))


def _consolidate_deepspeed(layout: Any, out: str, target: torch.dtype | None, max_shard_size: int | str,
                           progress: bool) -> list[str]:
    """:func:`consolidate_checkpoint` for a DeepSpeed ZeRO checkpoint (a :class:`DeepSpeedLayout`).

    Every tensor of DeepSpeed's ``zero_to_fp32`` output under its name (a shared parameter such as
    ``lm_head.weight`` written as a copy of the one it shares: safetensors holds no shared tensors),
    cast to ``target`` if given (non-float buffers keep their dtype), as DeepSpeed's ``dtype`` option.
    """
    from tqdm.auto import tqdm

    from hf_zero.checkpoint.deepspeed_files.fp32_weights import DeepSpeedWeights

    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise FileExistsError(f"output directory {out} exists and is not empty; choose a new one")
    weights = DeepSpeedWeights(layout)
    names = list(weights.entries) + list(weights.aliases)
    source = {n: weights.aliases.get(n, n) for n in names}
    entry = {n: weights.entries[source[n]] for n in names}

    def out_dtype(n: str) -> torch.dtype:
        saved = entry[n].dtype
        return (target or torch.float32) if saved.is_floating_point else saved

    plan = plan_shards({n: entry[n].numel * out_dtype(n).itemsize for n in names}, max_shard_size,
                       total_parameters=sum(entry[n].numel for n in weights.entries if weights.entries[n].kind != "buffer"))
    tmp = make_temp_dir(out)
    try:
        bar = tqdm(total=len(names), desc="Consolidating", unit="tensor", disable=not progress)
        for filename, keys in plan.files.items():
            read = weights.read(dict.fromkeys(source[k] for k in keys))  # one rank file at a time
            shard: dict[str, torch.Tensor] = {}
            for k in keys:
                value = read[source[k]].to(out_dtype(k))
                # A shared parameter's second name gets a copy: safetensors holds no shared tensors.
                shard[k] = value.clone() if any(v.data_ptr() == value.data_ptr() for v in shard.values()) else value
            write_safetensors(os.path.join(tmp, filename), shard)
            bar.update(len(keys))
            del shard, read
        bar.close()
        sources = [layout.checkpoint_dir, os.path.dirname(layout.tag_dir)]
        return _publish(tmp, out, plan, sources, adapter=False, dtype=target or torch.float32)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: str, out: str, plan: Any, sources: list[str], *, adapter: bool,
             dtype: torch.dtype | None) -> list[str]:
    """Finish the output built in ``tmp`` (index, config and tokenizer files from ``sources``) and
    move it to ``out`` in one rename, so no half-written output ever carries its name."""
    written = list(plan.files)
    if plan.index is not None:
        write_json(os.path.join(tmp, WEIGHTS_INDEX_NAME), plan.index)
        written.append(WEIGHTS_INDEX_NAME)
    written += _copy_model_files(sources, tmp, adapter=adapter, dtype=dtype)
    if os.path.isdir(out):
        os.rmdir(out)  # empty (checked by the caller)
    os.replace(tmp, out)
    return written


def _copy_model_files(sources: list[str], dst: str, *, adapter: bool, dtype: torch.dtype | None) -> list[str]:
    # An adapter folder gets the tokenizer but not the base model's config (it has no base weights).
    patterns = COPIED_FILE_PATTERNS
    if adapter:
        patterns = (ADAPTER_CONFIG_NAME,) + tuple(p for p in patterns if p not in ("config.json", "generation_config.json"))
    copied: list[str] = []
    for src in dict.fromkeys(sources):
        for name in sorted(os.listdir(src)):
            path = os.path.join(src, name)
            if name not in copied and os.path.isfile(path) and any(fnmatch.fnmatch(name, p) for p in patterns):
                shutil.copy2(path, os.path.join(dst, name))
                copied.append(name)
    if not adapter and dtype is not None and "config.json" in copied:
        _set_config_dtype(os.path.join(dst, "config.json"), dtype)
    return copied


def _set_config_dtype(path: str, dtype: torch.dtype) -> None:
    """Record the written dtype in config.json, as ``save_pretrained`` does."""
    import json

    with open(path, encoding="utf-8") as f:
        config: dict[str, Any] = json.load(f)
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    write_json(path, config)
