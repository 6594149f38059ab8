"""Find a DeepSpeed ZeRO checkpoint on disk and say what it is, before reading any tensor.

What DeepSpeed 0.19.8 writes under the Trainer (``checkpoint-N/``): ``latest`` (the text
``global_stepN``) and ``global_stepN/`` holding

- ZeRO-1/2: ``mp_rank_00_model_states.pt`` (the whole 16-bit module, ``param_shapes``,
  ``shared_params``, ``buffer_names``, ``frozen_param_*``, ``dp_world_size``) and one
  ``zero_pp_rank_R_mp_rank_00_optim_states.pt`` per data-parallel rank;
- ZeRO-3: ``zero_pp_rank_R_mp_rank_00_model_states.pt`` per rank (placeholders; shapes in
  ``param_shapes``) and the optimizer files;
- in bf16 the optimizer files are named ``bf16_zero_pp_rank_R_...``.

:func:`find_deepspeed_checkpoint` turns a path into a :class:`DeepSpeedLayout` (stage, world size
from the files, dtype prefix, the files sorted by rank number) or None when the path is not a
DeepSpeed checkpoint; layouts hf_zero does not read (pipeline or tensor parallel, MoE expert files,
universal checkpoints), a world size the files contradict and a missing rank file are errors that
say what to do. Only rank 0's model-states file is opened here (memory-mapped, with the restricted
loader).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from hf_zero.checkpoint.deepspeed_files.restricted_load import load_deepspeed_file
from hf_zero.checkpoint.errors import CheckpointError

__all__ = ["DeepSpeedLayout", "find_deepspeed_checkpoint", "is_deepspeed_checkpoint"]

LATEST_NAME = "latest"
_ZERO12_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_ZERO3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_PIPELINE = re.compile(r"^layer_\d+-model_\d+-model_states\.pt$")
_EXPERT = re.compile(r"expp_rank_|expert_")
_HOW_TO = ("convert it with DeepSpeed's own tools where DeepSpeed is installed (zero_to_fp32.py, or "
           "ds_to_universal.py), or resume it under DeepSpeed")


@dataclass(frozen=True)
class DeepSpeedLayout:
    """A DeepSpeed ZeRO checkpoint's files, as found on disk.

    Attributes:
        checkpoint_dir: the folder holding ``latest`` (a Trainer ``checkpoint-N``), or the tag
            folder itself when given directly.
        tag_dir: the ``global_stepN`` folder holding the rank files.
        stage: 1, 2 or 3 (1 and 2 share one layout; the optimizer files say which).
        world_size: the data-parallel ranks that saved it (one optimizer file each).
        optim_prefix: ``"bf16_"`` for a bf16 run, else ``""``.
        model_files: the model-states files by rank (one at ZeRO-1/2).
        optim_files: the optimizer-states files by rank.
        model_state: rank 0's model-states dict (tensors memory-mapped).
    """

    checkpoint_dir: str
    tag_dir: str
    stage: int
    world_size: int
    optim_prefix: str
    model_files: tuple[str, ...]
    optim_files: tuple[str, ...]
    model_state: dict

    @property
    def ds_version(self) -> str | None:
        return self.model_state.get("ds_version")


def is_deepspeed_checkpoint(path: str | os.PathLike, tag: str | None = None) -> bool:
    """Whether ``path`` looks like a DeepSpeed checkpoint (``latest``, a ``global_step*`` folder with
    rank files, or such a folder itself); reads no pickle."""
    try:
        return _tag_dir(os.path.abspath(os.fspath(path)), tag) is not None
    except CheckpointError:
        return True  # DeepSpeed-shaped, but wrong in a way find_deepspeed_checkpoint explains


def find_deepspeed_checkpoint(path: str | os.PathLike, tag: str | None = None) -> DeepSpeedLayout | None:
    """The DeepSpeed checkpoint at ``path``, or None if ``path`` is not one.

    Args:
        path: a Trainer ``checkpoint-N`` folder (with ``latest``), a folder given to DeepSpeed's
            ``save_checkpoint``, or a ``global_stepN`` folder itself.
        tag: the sub-folder to read instead of the one ``latest`` names (DeepSpeed's ``tag``).

    Raises:
        FileNotFoundError: ``path`` (or the folder ``tag``/``latest`` names) does not exist.
        CheckpointError: a DeepSpeed checkpoint hf_zero does not read, or whose files contradict
            each other or lack a rank (the message says which file and what to do).
    """
    given = os.path.abspath(os.fspath(path))
    if not os.path.isdir(given):
        raise FileNotFoundError(f"checkpoint directory {given} does not exist")
    tag_dir = _tag_dir(given, tag)
    if tag_dir is None:
        return None
    names = sorted(os.listdir(tag_dir))
    _refuse_unread_layouts(tag_dir, names)
    zero3 = {int(m[1]): m for m in map(_ZERO3_MODEL.match, names) if m}
    zero12 = {int(m[1]): m for m in map(_ZERO12_MODEL.match, names) if m}
    optim = [m for m in map(_OPTIM.match, names) if m]
    if zero3 and zero12:
        raise CheckpointError(f"{tag_dir} holds both ZeRO-3 (zero_pp_rank_*_model_states.pt) and ZeRO-1/2 "
                              "(mp_rank_00_model_states.pt) files: two runs saved into one folder; keep one run's files")
    if not zero3 and not zero12:
        raise CheckpointError(f"{tag_dir} has no *_model_states.pt file: not a complete DeepSpeed checkpoint "
                              "(a save that did not finish?); use another checkpoint")
    if any(int(m[3]) != 0 for m in optim) or any(int(m[2]) != 0 for m in zero3.values()) or set(zero12) - {0}:
        raise CheckpointError(f"{tag_dir} holds files of several model-parallel ranks (mp_rank_01...): a tensor "
                              f"or pipeline parallel checkpoint, which hf_zero does not read; {_HOW_TO}")
    prefixes = {m[1] or "" for m in optim}
    if len(prefixes) > 1:
        raise CheckpointError(f"{tag_dir} holds both bf16_zero_pp_rank_* and zero_pp_rank_* optimizer files: two "
                              "runs saved into one folder; keep one run's files")
    prefix = prefixes.pop() if prefixes else ""
    optim_by_rank = {int(m[2]): os.path.join(tag_dir, m[0]) for m in optim}
    model_files = (tuple(os.path.join(tag_dir, zero3[r][0]) for r in sorted(zero3)) if zero3
                   else (os.path.join(tag_dir, zero12[0][0]),))
    first_model = model_files[0]
    if zero3 and 0 not in zero3:
        raise CheckpointError(f"{tag_dir}: zero_pp_rank_0_mp_rank_00_model_states.pt is missing: the checkpoint is "
                              "incomplete; copy the file from where it was saved or use another checkpoint")
    state = load_deepspeed_file(first_model)
    if not isinstance(state, dict):
        raise CheckpointError(f"{first_model} holds a {type(state).__name__}, not DeepSpeed's model-states dict")
    _refuse_parallel_state(first_model, state)
    world = state.get("dp_world_size")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise CheckpointError(f"{first_model}: 'dp_world_size' is {world!r}, not a rank count: not a DeepSpeed "
                              "ZeRO checkpoint hf_zero reads")
    expected = _optim_name(prefix, 0)
    for rank in range(world):
        if rank not in optim_by_rank:
            raise CheckpointError(
                f"{tag_dir}: {_optim_name(prefix, rank)} is missing ({first_model} says {world} ranks saved it "
                f"(dp_world_size), and each writes one optimizer file like {expected}): the checkpoint is "
                "incomplete; copy the missing file from where it was saved, or use another checkpoint")
        if zero3 and rank not in zero3:
            raise CheckpointError(f"{tag_dir}: zero_pp_rank_{rank}_mp_rank_00_model_states.pt is missing ({world} "
                                  "ranks saved this ZeRO-3 checkpoint): the checkpoint is incomplete; copy the "
                                  "missing file from where it was saved, or use another checkpoint")
    extra = sorted(set(optim_by_rank) - set(range(world))) or sorted(set(zero3) - set(range(world)))
    if extra:
        raise CheckpointError(f"{tag_dir} holds files of rank {extra[0]}, but {first_model} says {world} ranks saved "
                              "it (dp_world_size): files of another run are mixed in; keep one run's files")
    stage = _stage(first_model, state, zero3=bool(zero3))
    return DeepSpeedLayout(
        checkpoint_dir=given,
        tag_dir=tag_dir,
        stage=stage,
        world_size=world,
        optim_prefix=prefix,
        model_files=model_files,
        optim_files=tuple(optim_by_rank[r] for r in range(world)),
        model_state=state,
    )


def _optim_name(prefix: str, rank: int) -> str:
    return f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _has_rank_files(folder: str) -> bool:
    try:
        names = os.listdir(folder)
    except OSError:
        return False
    return any(_ZERO12_MODEL.match(n) or _ZERO3_MODEL.match(n) or _OPTIM.match(n) or _PIPELINE.match(n) for n in names)


def _tag_dir(given: str, tag: str | None) -> str | None:
    """The ``global_stepN`` folder of the checkpoint at ``given``, or None if it is not DeepSpeed's."""
    if tag is not None:
        _check_tag(tag, f"tag={tag!r}")
        folder = os.path.join(given, tag)
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"{folder} does not exist (tag={tag!r}); the tags there: "
                                    f"{', '.join(_tags(given)) or 'none'}")
        return folder if _has_rank_files(folder) else None
    latest = os.path.join(given, LATEST_NAME)
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8", errors="replace") as f:
            name = f.read(256).strip()
        _check_tag(name, f"{latest} holds {name!r}")
        folder = os.path.join(given, name)
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"{latest} names {name}, but {folder} does not exist: the checkpoint is "
                                    f"incomplete; pass the tag to read (those there: {', '.join(_tags(given)) or 'none'})")
        return folder
    if _has_rank_files(given):
        return given
    tags = _tags(given)
    if len(tags) > 1:
        raise CheckpointError(f"{given} holds several DeepSpeed checkpoints ({', '.join(tags)}) and no 'latest' file; "
                              "name one (its folder, or tag=...)")
    return os.path.join(given, tags[0]) if tags else None


def _tags(given: str) -> list[str]:
    return sorted(n for n in os.listdir(given) if os.path.isdir(os.path.join(given, n)) and _has_rank_files(os.path.join(given, n)))


def _check_tag(tag: str, where: str) -> None:
    # A tag is a folder name inside the checkpoint: a path elsewhere would read files the checkpoint does not own.
    if not tag or tag in (".", "..") or "/" in tag or "\\" in tag or "\x00" in tag:
        raise CheckpointError(f"{where}: not a checkpoint tag (a folder name such as global_step100)")


def _refuse_unread_layouts(tag_dir: str, names: list[str]) -> None:
    if os.path.isdir(os.path.join(tag_dir, "zero")) or any(n.endswith("universal_checkpoint_info") for n in names):
        raise CheckpointError(f"{tag_dir} is a DeepSpeed universal checkpoint (its zero/ folder holds one file per "
                              "parameter), which hf_zero does not read; use the checkpoint it was converted from "
                              "(its global_stepN folder)")
    moe = [n for n in names if _EXPERT.search(n)]
    if moe:
        raise CheckpointError(f"{tag_dir} holds Mixture-of-Experts files ({moe[0]}), which hf_zero does not read; {_HOW_TO}")
    pipe = [n for n in names if _PIPELINE.match(n)]
    if pipe:
        raise CheckpointError(f"{tag_dir} holds pipeline-parallel layer files ({pipe[0]}), which hf_zero does not read; {_HOW_TO}")


def _refuse_parallel_state(path: str, state: dict[str, Any]) -> None:
    dims = state.get("checkpoint_parallel_dimensions") or {}
    mp = state.get("mp_world_size", 1)
    pp = dims.get("pp_degree", 1) if isinstance(dims, dict) else 1
    tp = dims.get("tp_degree", 1) if isinstance(dims, dict) else 1
    if mp != 1 or pp != 1 or tp != 1:
        raise CheckpointError(f"{path}: saved with model parallelism (mp_world_size={mp}, pp_degree={pp}, "
                              f"tp_degree={tp}), which hf_zero does not read; {_HOW_TO}")


def _stage(path: str, state: dict[str, Any], *, zero3: bool) -> int:
    """The ZeRO stage the run's config names, checked against the file layout."""
    config = state.get("ds_config")
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None
    if zero3:
        if stage not in (None, 3):
            raise CheckpointError(f"{path}: a ZeRO-3 file layout, but its ds_config says stage {stage!r}")
        return 3
    if stage == 3:
        raise CheckpointError(f"{path}: a ZeRO-1/2 file layout, but its ds_config says stage 3")
    if stage not in (1, 2):
        raise CheckpointError(f"{path}: its ds_config says ZeRO stage {stage!r}: hf_zero reads ZeRO-1/2/3 "
                              f"checkpoints (stage 0 has no sharded files; its weights are in this file's 'module'); {_HOW_TO}")
    return int(stage)
