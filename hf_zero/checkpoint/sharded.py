"""Resumable sharded checkpoints of a ``ZeroEngine`` with ``torch.distributed.checkpoint`` (DCP).

A checkpoint directory holds::

    .metadata, __<rank>_<i>.distcp      DCP: model, optimizer, lr scheduler, loss scaler, counters
    hf_zero_rng_<rank>.pth              each rank's RNG states (python, numpy, torch CPU, CUDA)
    hf_zero_extra_state.json            the caller's ``extra_state`` (rank 0), when given
    config.json, generation_config.json the model's config (lets ``hf-zero consolidate`` output load)
    adapter_config.json                 for a peft model
    hf_zero_checkpoint.json             the marker: written last; without it the checkpoint is incomplete

Model and optimizer entries are keyed by parameter name (FQN); at stages 2/3 they are DTensors, so
DCP reshards them when the world size changes. At stage 1 each rank's optimizer only has state for
the parameters it owns (``ZeroRedundancyOptimizer``); each rank writes the per-FQN entries it owns
and the param groups are written from the global optimizer (all parameter names), so the optimizer
state is rank-independent and any world size reads back the FQNs it owns then.

Saves are atomic: everything is written into ``<checkpoint_dir>.tmp-<id>`` and the directory is
renamed to its final name once the marker is written. When ``checkpoint_dir`` already exists (a
save of the same step, or the Trainer's files saved there first) its other files are hard-linked
into the new directory and the two are swapped (:mod:`~hf_zero.checkpoint.atomic_dir`), so a
complete checkpoint is at that path at every moment.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import time
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hf_zero.checkpoint.atomic_dir import recover_replaced, replace_directory
from hf_zero.checkpoint.errors import CheckpointError, IncompleteCheckpointError, refused_file
from hf_zero.checkpoint.safe_load import SafeFileSystemReader, load_state_dict, load_torch_file
from hf_zero.distributed import device as accel
from hf_zero.distributed.collectives import agree_on_error as _agree_on_error, broadcast_object
from hf_zero.engine.scalar_params import lifted_keys
from hf_zero.checkpoint.export16 import peft_adapter_key_map, tied_groups, unwrap_model
from hf_zero.checkpoint.pretrained_files import save_model_config

__all__ = [
    "CheckpointError",
    "IncompleteCheckpointError",
    "MARKER_NAME",
    "FORMAT_VERSION",
    "save_checkpoint",
    "load_checkpoint",
    "read_marker",
    "load_rng_state",
    "resolve_checkpoint_dir",
]

logger = logging.getLogger("hf_zero")

MARKER_NAME = "hf_zero_checkpoint.json"
EXTRA_STATE_NAME = "hf_zero_extra_state.json"
RNG_NAME = "hf_zero_rng_{rank}.pth"
FORMAT_NAME = "hf_zero.sharded"
FORMAT_VERSION = 1
# Files DCP writes; with ours they are what a new save replaces in an existing directory.
_DCP_METADATA = ".metadata"


# ----------------------------------------------------------------------------------------------- ranks
def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def agree_on_error(error: BaseException | None, what: str) -> None:
    """:func:`hf_zero.distributed.collectives.agree_on_error` raising :class:`CheckpointError` on
    the ranks that did not fail. Every rank must call it."""
    _agree_on_error(error, what, error_type=CheckpointError)


@contextlib.contextmanager
def _dcp_errors(what: str) -> Iterator[None]:
    """DCP's ``CheckpointException`` (a BaseException holding tracebacks) as a short CheckpointError."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        failures = "; ".join(
            f"rank {rank}: {type(pair[0]).__name__}: {pair[0]}" for rank, pair in sorted(exc.failures.items())
        )
        raise CheckpointError(f"{what} failed on {failures}") from exc


# ----------------------------------------------------------------------------------------------- optimizer form
def _param_fqns(module: nn.Module) -> dict[int, str]:
    """``id(param) -> name`` (first name of a tied parameter, as DCP's state-dict helpers use)."""
    names: dict[int, str] = {}
    for name, param in module.named_parameters():
        names.setdefault(id(param), name)
    return names


def _global_param_groups(engine: Any, module: nn.Module, local_groups: list[dict]) -> list[dict]:
    """Param groups naming every parameter, from the optimizer the engine steps.

    At stage 1 the local optimizer only lists the parameters this rank owns; the
    ``ZeroRedundancyOptimizer`` around it has the global groups (its hyperparameters are synced
    from the local optimizer after each step). Elsewhere the local groups are already global.
    """
    optimizer = engine.optimizer
    local = engine.stage.local_optimizer(optimizer)
    if local is optimizer:
        return local_groups
    fqns = _param_fqns(module)
    return [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [fqns[id(p)] for p in group["params"]]}
        for group in optimizer.param_groups
    ]


def _restore_param_groups(engine: Any, module: nn.Module, template: list[dict], saved: list[dict]) -> list[dict]:
    """Saved hyperparameters on this rank's groups; the global stage-1 groups get them too.

    Groups are matched by parameter name (a group's params are its identity), falling back to
    the position for groups that own no parameters on this rank.
    """
    group_of: dict[str, int] = {}
    for i, group in enumerate(saved):
        for name in group["params"]:
            group_of[name] = i

    def hyper(names: list[str], position: int) -> dict:
        index = next((group_of[n] for n in names if n in group_of), position if position < len(saved) else None)
        if index is None:
            return {}
        return {k: v for k, v in saved[index].items() if k != "params"}

    restored = [{**group, **hyper(list(group["params"]), i)} for i, group in enumerate(template)]
    optimizer = engine.optimizer
    local = engine.stage.local_optimizer(optimizer)
    if local is not optimizer:
        # ZeroRedundancyOptimizer copies its global groups' hyperparameters into the local optimizer
        # before every step, so the loaded learning rate etc. must be set there too.
        fqns = _param_fqns(module)
        for i, group in enumerate(optimizer.param_groups):
            group.update(hyper([fqns[id(p)] for p in group["params"]], i))
    return restored


# ----------------------------------------------------------------------------------------------- rng
def _rng_state() -> dict[str, Any]:
    import numpy as np

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        # numpy's key array as a tensor so the file loads with weights_only=True.
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "cpu": torch.get_rng_state(),
    }
    accel_state = accel.get_rng_state()
    if accel_state is not None:
        state["cuda"] = accel_state
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        accel.set_rng_state(state["cuda"])


# ----------------------------------------------------------------------------------------------- marker
def read_marker(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """The marker of a complete checkpoint.

    Raises:
        FileNotFoundError: ``checkpoint_dir`` does not exist.
        IncompleteCheckpointError: it has no marker (its save was interrupted), or not a readable one.
    """
    path = os.path.abspath(os.fspath(checkpoint_dir))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    marker = os.path.join(path, MARKER_NAME)
    if not os.path.isfile(marker):
        raise IncompleteCheckpointError(
            f"{path} is not a complete hf_zero checkpoint: {MARKER_NAME} is missing (the save that wrote it "
            "did not finish, or it is not an hf_zero checkpoint); resume from an earlier checkpoint"
        )
    try:
        with open(marker, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError) as exc:
        raise IncompleteCheckpointError(f"{marker} cannot be read ({exc}); the checkpoint is incomplete") from exc
    if info.get("format") != FORMAT_NAME or int(info.get("format_version", 0)) > FORMAT_VERSION:
        raise CheckpointError(
            f"{marker}: format {info.get('format')!r} version {info.get('format_version')!r} is not one this "
            f"hf_zero reads ({FORMAT_NAME!r} up to version {FORMAT_VERSION}); upgrade hf_zero"
        )
    return info


def _model_entries(module: nn.Module) -> dict[str, dict[str, Any]]:
    """``{key: {"shape", "dtype"}}`` of the model's state dict (full shapes, also for DTensors)."""
    entries = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):
            entries[name] = {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
    return entries


def _buffer_keys(module: nn.Module) -> set[str]:
    """State-dict keys of the model that are buffers (not parameters)."""
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    return set(module.state_dict(keep_vars=True)) - params


def _resized_buffers(info: dict[str, Any], module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Buffers whose shape changed since the checkpoint was saved (a history that grows as the
    model trains): ``{key: saved shape}``. They are read in the saved shape, and the module's own
    ``load_state_dict`` takes them, as the plain Trainer's resume does."""
    saved = {k: tuple(v["shape"]) for k, v in info.get("params", {}).items()}
    current = {k: tuple(v["shape"]) for k, v in _model_entries(module).items()}
    return {k: saved[k] for k in _buffer_keys(module) & set(saved) & set(current) if saved[k] != current[k]}


def _check_model_matches(info: dict[str, Any], module: nn.Module, path: str) -> None:
    saved = {k: tuple(v["shape"]) for k, v in info.get("params", {}).items()}
    current = {k: tuple(v["shape"]) for k, v in _model_entries(module).items()}
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    resized = _resized_buffers(info, module)
    wrong = sorted(k for k in set(saved) & set(current) if saved[k] != current[k] and k not in resized)
    if missing or unexpected or wrong:
        lines = [f"{path} was saved from a different model:"]
        if missing:
            lines.append(f"  not in the checkpoint ({len(missing)}): {', '.join(missing[:5])}")
        if unexpected:
            lines.append(f"  not in this model ({len(unexpected)}): {', '.join(unexpected[:5])}")
        for k in wrong[:5]:
            lines.append(f"  {k}: shape {list(saved[k])} in the checkpoint, {list(current[k])} here")
        raise CheckpointError("\n".join(lines))


# ----------------------------------------------------------------------------------------------- save
def save_checkpoint(
    engine: Any, checkpoint_dir: str | os.PathLike, *, extra_state: dict | None = None, model_only: bool = False
) -> None:
    """Save the engine's full training state so a run can resume, on any world size.

    Every rank must call it. Writes model, optimizer (sharded as trained), lr scheduler, loss
    scaler, step counters, every rank's RNG states and ``extra_state`` into ``checkpoint_dir``.
    With ``model_only`` (the Trainer's ``--save_only_model``) it writes the model's weights (fp32
    masters of trained parameters) and the counters only: ``hf-zero consolidate`` reads it, a
    resume refuses it.

    Args:
        engine: the ``ZeroEngine``.
        checkpoint_dir: final directory (on a filesystem every rank sees). If it exists, its other
            files (e.g. the Trainer's) are kept and the checkpoint's own files are replaced.
        extra_state: JSON-serialisable state of the caller (rank 0's is saved), returned by
            :func:`load_checkpoint`.

    Raises:
        CheckpointError: the save failed on some rank (raised on every rank; no final directory
            or marker is left behind).
        TypeError: ``extra_state`` is not JSON-serialisable.
    """
    import torch.distributed.checkpoint as dcp

    rank = _rank()
    final = os.path.abspath(os.fspath(checkpoint_dir))
    tmp = f"{final}.tmp-{broadcast_object(uuid.uuid4().hex[:12])}"
    module = unwrap_model(engine)
    started = time.perf_counter()

    error: BaseException | None = None
    extra_json: str | None = None
    if rank == 0:
        try:
            if extra_state is not None:
                extra_json = json.dumps(extra_state, indent=2, sort_keys=True)
            _remove_stale_temp_dirs(final)
            os.makedirs(tmp)
        except BaseException as exc:
            error = exc
    agree_on_error(error, f"creating {tmp}")

    try:
        try:
            state = _portable_state(engine, module, saving=True)
            if model_only:
                state = {"module": state["module"], "counters": state["counters"]}
        except BaseException as exc:
            error = exc
        agree_on_error(error, "collecting the engine state")
        # DCP agrees on errors across ranks itself (it raises CheckpointException everywhere).
        with _dcp_errors(f"writing {final}"):
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp))
        del state
        if not model_only:
            try:
                torch.save(_rng_state(), os.path.join(tmp, RNG_NAME.format(rank=rank)))
            except BaseException as exc:
                error = exc
            agree_on_error(error, "saving RNG states")
        if rank == 0:
            try:
                _finish_save(engine, module, tmp, final, extra_json, model_only)
            except BaseException as exc:
                error = exc
        agree_on_error(error, f"finishing {final}")
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if rank == 0:
        logger.info("hf_zero: saved checkpoint %s in %.1f s", final, time.perf_counter() - started)


def _portable_state(engine: Any, module: nn.Module, *, saving: bool = False) -> dict[str, Any]:
    state = engine.state_dict(saving=saving)
    if "optimizer" in state and engine.optimizer is not None:
        state["optimizer"] = {
            "state": state["optimizer"]["state"],
            "param_groups": _global_param_groups(engine, module, state["optimizer"]["param_groups"]),
        }
    return state


def _remove_stale_temp_dirs(final: str) -> None:
    """Temporary directories of earlier saves to the same name that were killed mid-way."""
    parent, base = os.path.split(final)
    if not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
        return
    recover_replaced(parent)  # a previous save killed mid-swap: its checkpoint comes back first
    for name in os.listdir(parent):
        if name.startswith(base + ".tmp-"):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _checkpoint_files(names: list[str]) -> list[str]:
    return [
        n for n in names
        if n.endswith(".distcp") or n in (_DCP_METADATA, EXTRA_STATE_NAME, MARKER_NAME)
        or (n.startswith("hf_zero_rng_") and n.endswith(".pth"))
    ]


def _finish_save(
    engine: Any, module: nn.Module, tmp: str, final: str, extra_json: str | None, model_only: bool = False
) -> None:
    if extra_json is not None:
        with open(os.path.join(tmp, EXTRA_STATE_NAME), "w", encoding="utf-8") as f:
            f.write(extra_json + "\n")
    adapter_keys = peft_adapter_key_map(module)
    if adapter_keys is not None:
        module.peft_config[module.active_adapter].save_pretrained(tmp)
    save_model_config(module, tmp, None)
    info = _marker(engine, module, adapter_keys, has_extra=extra_json is not None, model_only=model_only)
    _write_marker(os.path.join(tmp, MARKER_NAME), info)
    if os.path.exists(final):
        # The directory exists (a previous save of this step, or the Trainer's files): the new one
        # gets its other files as hard links (no copy, no extra space), then swaps with it, so a
        # complete checkpoint is at ``final`` at every moment.
        new = set(os.listdir(tmp))
        for name in os.listdir(final):
            if name not in new and name not in _checkpoint_files([name]):
                _link_tree(os.path.join(final, name), os.path.join(tmp, name))
    replace_directory(tmp, final)


def _link_tree(src: str, dst: str) -> None:
    """``src`` at ``dst`` by hard links (copies where the filesystem has none)."""

    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    if os.path.isdir(src) and not os.path.islink(src):
        shutil.copytree(src, dst, copy_function=link, symlinks=True)
    else:
        link(src, dst)


def _write_marker(path: str, info: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(info, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _marker(
    engine: Any, module: nn.Module, adapter_keys: dict[str, str] | None, *, has_extra: bool, model_only: bool = False
) -> dict[str, Any]:
    from hf_zero.version import __version__

    config = engine.config
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "hf_zero_version": __version__,
        "torch_version": torch.__version__,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "world_size": _world(),
        "stage": int(config.zero_optimization.stage),
        "dtype": config.compute_dtype_name,
        "global_steps": int(engine.global_steps),
        "micro_steps": int(engine.micro_steps),
        "model_class": type(module).__name__.removeprefix("FSDP"),
        "has_optimizer": engine.optimizer is not None and not model_only,
        "model_only": model_only,
        "extra_state": EXTRA_STATE_NAME if has_extra else None,
        "rng_files": [] if model_only else [RNG_NAME.format(rank=r) for r in range(_world())],
        "params": _model_entries(module),
        "tied": tied_groups(module),
        "peft_adapter_keys": adapter_keys,
        "scalar_keys": lifted_keys(module),  # 0-dim parameters stored as (1,) for FSDP2
    }


# ----------------------------------------------------------------------------------------------- load
def load_checkpoint(engine: Any, checkpoint_dir: str | os.PathLike, *, restore_rng: bool = True) -> dict | None:
    """Restore a checkpoint written by :func:`save_checkpoint` into ``engine``.

    Every rank must call it. The world size may differ from the one that saved (DCP reshards the
    stage 2/3 DTensors; stage 0/1 tensors are whole; stage 1 optimizer state is read per
    parameter name), and stages 2 and 3 read each other's checkpoints. RNG states: rank ``r``
    restores the states rank ``r`` saved; a rank the saving run did not have keeps its own (logged).

    Args:
        engine: a ``ZeroEngine`` built for the same model (and optimizer/scheduler kinds).
        checkpoint_dir: the directory ``save_checkpoint`` wrote.
        restore_rng: False to leave the generators alone (loading the best model at the end of a
            run, as DeepSpeed's ``load_checkpoint`` does).

    Returns:
        The ``extra_state`` given to ``save_checkpoint`` (None if none was).

    Raises:
        FileNotFoundError: ``checkpoint_dir`` does not exist.
        IncompleteCheckpointError: it has no marker (the save did not finish).
        CheckpointError: it was saved from another model, or misses optimizer state this engine
            needs, or one of its files holds something hf_zero never writes there (the error
            names the file; nothing from it has run: see :mod:`hf_zero.checkpoint.safe_load`).
    """
    path = os.path.abspath(os.fspath(checkpoint_dir))
    error: BaseException | None = None
    info: dict[str, Any] = {}
    module = unwrap_model(engine)
    reader: SafeFileSystemReader | None = None
    try:
        path = resolve_checkpoint_dir(path)
        info = read_marker(path)
        _check_model_matches(info, module, path)
        if engine.optimizer is not None and not info.get("has_optimizer", True):
            if info.get("model_only"):
                raise CheckpointError(
                    f"{path} holds the model's weights only (saved with --save_only_model): training cannot "
                    "resume from it. Turn it into a from_pretrained folder with `hf-zero consolidate`, or "
                    "save checkpoints without --save_only_model to resume"
                )
            raise CheckpointError(f"{path} has no optimizer state (saved by an engine without an optimizer)")
        # The metadata is read (and refused, if crafted) here, where every rank hears of a
        # refusal, rather than inside DCP's collectives.
        reader = SafeFileSystemReader(path)
        reader.read_metadata()
    except BaseException as exc:
        error = exc
    agree_on_error(error, f"reading {path}")
    assert reader is not None

    state = _portable_state(engine, module)
    for key, shape in _resized_buffers(info, module).items():
        current = state["module"][key]
        state["module"][key] = torch.empty(shape, dtype=current.dtype, device=current.device)
    local_groups = _local_param_groups(engine, module) if "optimizer" in state else None
    with warnings.catch_warnings():
        # DCP warns about keys it reshards and about the FSDP2 state-dict API being new.
        warnings.simplefilter("ignore", UserWarning)
        with _dcp_errors(f"reading {path}"):
            load_state_dict(state, reader)
    if local_groups is not None:
        state["optimizer"]["param_groups"] = _restore_param_groups(
            engine, module, local_groups, state["optimizer"]["param_groups"]
        )
    engine.load_state_dict(state)
    del state

    restored = not restore_rng
    try:
        restored = restored or load_rng_state(path)
    except BaseException as exc:  # a refused RNG file on one rank: the others must not train on
        error = exc
    agree_on_error(error, f"restoring the RNG states of {path}")
    if not restored:
        logger.info(
            "hf_zero: %s has no RNG state for rank %d (saved on %d ranks); this rank keeps its own",
            path, _rank(), info.get("world_size"),
        )
    if info.get("world_size") != _world() and _rank() == 0:
        logger.info(
            "hf_zero: resumed %s saved on %s ranks on %d ranks; the data order of the ranks may differ",
            path, info.get("world_size"), _world(),
        )
    extra_path = os.path.join(path, EXTRA_STATE_NAME)
    if os.path.exists(extra_path):
        with open(extra_path, encoding="utf-8") as f:
            return json.load(f)
    return None


def load_rng_state(checkpoint_dir: str | os.PathLike) -> bool:
    """Restore this rank's python, numpy, torch CPU (and CUDA) generators from a checkpoint.

    :func:`load_checkpoint` does it too; the Trainer calls this again where it re-seeds (at the
    start of the resumed epoch). Rank ``r`` reads what rank ``r`` saved.

    Returns:
        True if this rank's states were in the checkpoint and are restored; False if the saving
        run had fewer ranks (this rank keeps its own generators).

    Raises:
        CheckpointError: the file holds anything but the states hf_zero saves (it is read with
            ``torch.load(weights_only=True)``, so nothing in it runs).
    """
    path = os.path.join(os.fspath(checkpoint_dir), RNG_NAME.format(rank=_rank()))
    if not os.path.exists(path):
        return False
    state = load_torch_file(path)
    try:
        _set_rng_state(state)
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as exc:
        raise refused_file(path, f"it does not hold the RNG states hf_zero saves: {type(exc).__name__}: {exc}") from exc
    return True


def resolve_checkpoint_dir(path: str | os.PathLike) -> str:
    """The hf_zero checkpoint directory at ``path``, or the one subdirectory of ``path`` holding one.

    A Trainer checkpoint (``checkpoint-500/``) keeps the sharded state in a subdirectory next to
    the tokenizer and trainer files, so either directory may be given.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        IncompleteCheckpointError: no complete checkpoint there (an interrupted save, or none).
        CheckpointError: several subdirectories hold checkpoints.
    """
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if os.path.isfile(os.path.join(path, MARKER_NAME)) or os.path.isfile(os.path.join(path, _DCP_METADATA)):
        return path
    candidates = [
        os.path.join(path, name)
        for name in sorted(os.listdir(path))
        if os.path.isfile(os.path.join(path, name, MARKER_NAME)) or os.path.isfile(os.path.join(path, name, _DCP_METADATA))
    ]
    if len(candidates) > 1:
        raise CheckpointError(f"{path} holds several checkpoints ({', '.join(candidates)}); name one")
    return candidates[0] if candidates else path


def _local_param_groups(engine: Any, module: nn.Module) -> list[dict]:
    """This rank's optimizer param groups in the state-dict form (parameter names, no tensors)."""
    local = engine.stage.local_optimizer(engine.optimizer)
    fqns = _param_fqns(module)
    return [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [fqns[id(p)] for p in group["params"]]}
        for group in local.param_groups
    ]
