"""``deepspeed.utils.zero_to_fp32`` without DeepSpeed, for DeepSpeed's checkpoints and hf_zero's.

A DeepSpeed ZeRO checkpoint (``latest`` + ``global_step*/`` rank files) is read by
:mod:`hf_zero.checkpoint.deepspeed_files` (``torch.load(weights_only=True)`` with DeepSpeed's few
names as plain stand-ins: nothing from the checkpoint runs, where DeepSpeed's own functions unpickle
with ``weights_only=False``); the result is DeepSpeed's: same names, order and values, shared
parameters as one tensor, frozen parameters in their saved dtype. An hf_zero sharded checkpoint (a
Trainer ``checkpoint-N/`` folder, or its ``zero_state/``) is read through the safe reader ``hf-zero
consolidate`` uses: the model's fp32 state dict, keyed as ``model.state_dict()``, tied weights
sharing one tensor.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

__all__ = [
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "convert_zero_checkpoint_to_fp32_state_dict",
]

_MODULE_PREFIX = "module."  # how hf_zero's sharded checkpoint stores the model's entries


def _checkpoint_dir(checkpoint_dir: str | os.PathLike, tag: str | None) -> str:
    from hf_zero.checkpoint.sharded import resolve_checkpoint_dir

    path = os.fspath(checkpoint_dir)
    if tag is not None:
        # DeepSpeed's tag names a sub-folder (``global_step100``); for hf_zero it is a folder too
        # (``checkpoint-100`` under the output directory).
        path = os.path.join(path, tag)
    return resolve_checkpoint_dir(path)


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> OrderedDict:
    """The fp32 state dict of the model in an hf_zero checkpoint, in one CPU process.

    Args:
        checkpoint_dir: a Trainer checkpoint folder (``output/checkpoint-500``), or the
            ``zero_state`` folder inside it.
        tag: a sub-folder of ``checkpoint_dir`` to read instead (DeepSpeed's ``global_stepN``).
        exclude_frozen_parameters: keep only the trained parameters. hf_zero's checkpoint records
            them for peft models (the adapter's keys); for other models this raises.
        lazy_mode: DeepSpeed's lazy tensors; not offered (use ``hf-zero consolidate`` for models
            too large to hold in memory).

    Returns:
        ``{key: fp32 CPU tensor}`` in the model's state-dict order (non-float buffers keep their dtype).

    Raises:
        FileNotFoundError, IncompleteCheckpointError, CheckpointError: as ``hf-zero consolidate``.
        ValueError: ``lazy_mode``, or ``exclude_frozen_parameters`` for a checkpoint that does not
            say which parameters were frozen.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from hf_zero.checkpoint.safe_load import SafeFileSystemReader, load_state_dict
    from hf_zero.checkpoint.sharded import CheckpointError, read_marker

    if lazy_mode:
        raise ValueError("get_fp32_state_dict_from_zero_checkpoint(lazy_mode=True) is not offered by hf_zero; "
                         "write the weights to files with: hf-zero consolidate CHECKPOINT OUT_DIR")
    deepspeed = _deepspeed_layout(checkpoint_dir, tag)
    if deepspeed is not None:
        return _deepspeed_state_dict(deepspeed, exclude_frozen_parameters)
    src = _checkpoint_dir(checkpoint_dir, tag)
    info = read_marker(src)
    reader = SafeFileSystemReader(src)
    stored = {
        k[len(_MODULE_PREFIX):]: v
        for k, v in reader.read_metadata().state_dict_metadata.items()
        if k.startswith(_MODULE_PREFIX) and isinstance(v, TensorStorageMetadata)
    }
    names = list(info.get("params") or stored)
    missing = [n for n in names if n not in stored]
    if missing:
        raise CheckpointError(f"{src}: the marker lists tensors the checkpoint data lacks: {', '.join(missing[:5])}")
    if exclude_frozen_parameters:
        trained = info.get("peft_adapter_keys")
        if trained is None:
            raise ValueError(
                f"{src} does not record which parameters were frozen (only peft checkpoints do); call "
                "get_fp32_state_dict_from_zero_checkpoint without exclude_frozen_parameters and filter the keys"
            )
        names = [n for n in names if n in trained]
    alias_of = {other: group[0] for group in info.get("tied") or [] for other in group[1:] if group[0] in names}
    request = {
        _MODULE_PREFIX + n: torch.empty(tuple(stored[n].size), dtype=stored[n].properties.dtype)
        for n in names
        if n not in alias_of
    }
    load_state_dict(request, reader, no_dist=True)
    scalars: dict[str, Any] = info.get("scalar_keys") or {}  # 0-dim parameters stored as (1,) shards
    out: OrderedDict = OrderedDict()
    for name in names:
        if name in alias_of:
            out[name] = out[alias_of[name]]  # tied: the same tensor, as DeepSpeed restores shared params
            continue
        value = request.pop(_MODULE_PREFIX + name)
        if value.is_floating_point():
            value = value.float()
        out[scalars.get(name, name)] = value.reshape(()) if name in scalars else value
    return out


def _deepspeed_layout(checkpoint_dir: str | os.PathLike, tag: str | None) -> Any:
    """The DeepSpeed checkpoint at ``checkpoint_dir`` (``tag``: DeepSpeed's sub-folder), or None."""
    from hf_zero.checkpoint.deepspeed_files.layout import find_deepspeed_checkpoint, is_deepspeed_checkpoint

    path = os.fspath(checkpoint_dir)
    if not os.path.isdir(path) or not is_deepspeed_checkpoint(path, tag if tag is not None and
                                                              os.path.isdir(os.path.join(path, tag)) else None):
        return None
    return find_deepspeed_checkpoint(path, tag)


def _deepspeed_state_dict(layout: Any, exclude_frozen_parameters: bool) -> OrderedDict:
    from hf_zero.checkpoint.deepspeed_files.fp32_weights import DeepSpeedWeights

    weights = DeepSpeedWeights(layout, exclude_frozen_parameters=exclude_frozen_parameters)
    out: OrderedDict = OrderedDict(weights.read(weights.entries))
    for alias, target in weights.aliases.items():
        out[alias] = out[target]  # one tensor, as DeepSpeed's state dict
    return out


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str | os.PathLike,
                                         tag: str | None = None) -> nn.Module:
    """Load the fp32 weights of an hf_zero checkpoint into ``model`` (moved to the CPU), as
    DeepSpeed's function does (``strict=False``), and return it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike,
                                              max_shard_size: int | str = "5GB", safe_serialization: bool = True,
                                              tag: str | None = None, exclude_frozen_parameters: bool = False,
                                              **kwargs: Any) -> list[str]:
    """Write the fp32 weights of an hf_zero checkpoint as a ``from_pretrained`` folder
    (``hf-zero consolidate``); returns the file names written.

    ``output_dir`` is a folder (DeepSpeed's newer signature); the files are always safetensors.
    A peft checkpoint gives its adapter only, so ``exclude_frozen_parameters`` needs no action.
    Raises ValueError for a file name such as ``pytorch_model.bin`` (DeepSpeed's older signature).
    """
    from hf_zero.checkpoint.consolidate import consolidate_checkpoint

    out = os.fspath(output_dir)
    if os.path.splitext(out)[1] in (".bin", ".pt", ".pth", ".safetensors"):
        raise ValueError(f"convert_zero_checkpoint_to_fp32_state_dict: {out} is a file name; hf_zero writes a "
                         "from_pretrained folder: pass a directory (or run: hf-zero consolidate CHECKPOINT OUT_DIR)")
    deepspeed = _deepspeed_layout(checkpoint_dir, tag)
    if deepspeed is not None:
        if exclude_frozen_parameters:
            raise ValueError("convert_zero_checkpoint_to_fp32_state_dict(exclude_frozen_parameters=True) on a DeepSpeed "
                             "checkpoint is not offered by hf_zero: the folder it writes must load with from_pretrained; "
                             "use get_fp32_state_dict_from_zero_checkpoint(..., exclude_frozen_parameters=True)")
        return consolidate_checkpoint(deepspeed.tag_dir if tag is not None else deepspeed.checkpoint_dir, out,
                                      dtype="fp32", max_shard_size=max_shard_size)
    return consolidate_checkpoint(_checkpoint_dir(checkpoint_dir, tag), out, dtype="fp32", max_shard_size=max_shard_size)
