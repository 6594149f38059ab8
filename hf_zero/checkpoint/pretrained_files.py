"""The files of a ``from_pretrained`` directory, as ``save_pretrained`` names them, and how they are
put in place without ever looking complete while partial.

- :func:`plan_shards`: which keys go to ``model.safetensors`` or ``model-0000i-of-0000N.safetensors``
  (huggingface_hub's splitter, the one ``save_pretrained`` uses) and the index to write.
- :func:`save_model_config`: ``config.json``, ``generation_config.json`` and, for a remote-code model
  (ChatGLM, ...), its ``configuration_*.py`` / ``modeling_*.py``, so the folder loads offline.
- :func:`make_temp_dir` / :func:`publish_files`: files are written into a temporary directory beside
  the output and moved in by rename, the file that makes the set complete last.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "CONFIG_NAME",
    "GENERATION_CONFIG_NAME",
    "WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "ShardPlan",
    "is_weight_file",
    "make_temp_dir",
    "plan_shards",
    "publish_files",
    "save_model_config",
    "write_json",
    "write_safetensors",
]

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
# transformers' shard names: model-00001-of-00003.safetensors
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


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
    for name in os.listdir(parent):  # left by an export that was killed
        if name.startswith(f".{base}.tmp-"):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
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


def is_weight_file(name: str) -> bool:
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
    written += _save_remote_code(module, directory, config)  # before the config: it adds auto_map
    config.save_pretrained(directory)
    written.append(CONFIG_NAME)
    can_generate = getattr(module, "can_generate", None)
    generation_config = getattr(module, "generation_config", None)
    if generation_config is not None and callable(can_generate) and can_generate():
        generation_config.save_pretrained(directory)
        written.append(GENERATION_CONFIG_NAME)
    return written


def _save_remote_code(module: nn.Module, directory: str, config: Any) -> list[str]:
    """Copy a remote-code model's ``*.py`` files, as ``save_pretrained`` does (else the folder only
    loads where the Hub is reachable)."""
    is_remote = getattr(module, "is_remote_code", None)  # transformers 5
    remote = is_remote() if callable(is_remote) else getattr(module, "_auto_class", None) is not None
    if not remote:
        return []
    from transformers.dynamic_module_utils import custom_object_save

    # FSDP2 swaps the class for a generated ``FSDP<Name>`` living in torch's module; the files to
    # copy are those of the user's class, so hand over a stand-in that names it.
    cls = next(c for c in type(module).__mro__ if not c.__name__.startswith("FSDP"))
    stand_in = type(cls.__name__, (), {"__module__": cls.__module__, "_auto_class": cls._auto_class})()
    copied = custom_object_save(stand_in, directory, config=config) or []
    return [os.path.basename(p) for p in copied]
