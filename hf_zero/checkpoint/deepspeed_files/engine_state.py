"""A DeepSpeed ZeRO checkpoint loaded into an hf_zero engine: the step after it is DeepSpeed's.

:func:`load_deepspeed_checkpoint` fills the engine's own state template (``engine.state_dict()``:
parameters as DTensor shards at stages 2/3, Adam's state per parameter name, loss scaler, counters)
from DeepSpeed's files, and loads it with ``engine.load_state_dict``:

- every parameter (and buffer) from the fp32 masters (:meth:`DeepSpeedWeights.read`); a shared
  parameter (``lm_head.weight``) from the one it shares;
- Adam's ``exp_avg``, ``exp_avg_sq`` and ``step`` per parameter
  (:meth:`DeepSpeedWeights.read_optimizer_state`);
- each optimizer group's learning rate from DeepSpeed's group holding the same parameters (it is
  the rate of the next step);
- the loss scaler's fields (``cur_scale``, and for a dynamic scaler ``cur_iter``,
  ``last_overflow_iter``, ``cur_hysteresis``; hf_zero's config keeps the hyper-parameters) and the
  step counters.

Full tensors are read, :data:`CHUNK_NUMEL` values at a time, and each rank keeps its own shard of
them, so the world size and the stage may differ from the run that saved. The learning-rate schedule's own state and the RNG states
are the Trainer's (``scheduler.pt``, ``rng_state_R.pth``): :mod:`hf_zero.integration` loads them.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hf_zero.checkpoint.deepspeed_files.fp32_weights import DeepSpeedWeights
from hf_zero.checkpoint.deepspeed_files.layout import DeepSpeedLayout, find_deepspeed_checkpoint
from hf_zero.checkpoint.deepspeed_files.restricted_load import load_deepspeed_file
from hf_zero.checkpoint.errors import CheckpointError
from hf_zero.distributed.collectives import agree_on_error

__all__ = ["load_deepspeed_checkpoint"]


def load_deepspeed_checkpoint(engine: Any, checkpoint_dir: str | os.PathLike, *, tag: str | None = None) -> DeepSpeedLayout:
    """Load DeepSpeed's ZeRO checkpoint at ``checkpoint_dir`` into ``engine`` (every rank calls it).

    Raises:
        CheckpointError: not a DeepSpeed checkpoint, one hf_zero does not read, or one of another
            model (the names differ) or of parameters trained differently (frozen in one only).
    """
    state = engine.state_dict()  # before anything can fail: every rank takes the same part in it
    error: BaseException | None = None
    try:
        layout = _read_into(state, checkpoint_dir, tag)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it before the collectives of the load
        error = exc
    # One rank's unreadable file (an I/O error, a file another node lacks) must not leave the other
    # ranks waiting in load_state_dict's collectives.
    agree_on_error(error, f"reading DeepSpeed's checkpoint {os.fspath(checkpoint_dir)}", error_type=CheckpointError)
    engine.load_state_dict(state)
    return layout


def _read_into(state: dict[str, Any], checkpoint_dir: str | os.PathLike, tag: str | None) -> DeepSpeedLayout:
    """Fill ``state`` (the engine's own ``state_dict()``) from DeepSpeed's files; touches no collective."""
    layout = find_deepspeed_checkpoint(checkpoint_dir, tag)
    if layout is None:
        raise CheckpointError(f"{os.fspath(checkpoint_dir)} is not a DeepSpeed checkpoint (no 'latest', no "
                              "global_step*/ folder with *_model_states.pt files)")
    weights = DeepSpeedWeights(layout)
    source = {**{n: n for n in weights.entries}, **weights.aliases}
    module_state: dict[str, Any] = state["module"]
    unknown = [k for k in module_state if k not in source]
    absent = [n for n in weights.entries if n not in module_state and weights.entries[n].kind != "buffer"]
    if unknown or absent:
        raise CheckpointError(
            f"{layout.tag_dir} is a checkpoint of another model: "
            + (f"the model has {', '.join(unknown[:3])}, which the checkpoint lacks" if unknown else "")
            + ("; " if unknown and absent else "")
            + (f"the checkpoint has {', '.join(absent[:3])}, which the model lacks" if absent else "")
            + "; resume with the model the DeepSpeed run trained")
    for keys in _chunks(list(module_state), lambda k: weights.entries[source[k]].numel):
        full = weights.read(dict.fromkeys(source[k] for k in keys))  # a bounded part of the model at a time
        for key in keys:
            _fill(module_state[key], full[source[key]])
        del full
    if "optimizer" in state:
        _fill_optimizer(state["optimizer"], weights, source, layout)
    if "loss_scaler" in state:
        scaler = _deepspeed_loss_scaler(layout)
        state["loss_scaler"] = {k: scaler.get(k, v) for k, v in state["loss_scaler"].items()}
    counters = state.get("counters", {})
    model_state = layout.model_state
    steps = int(model_state.get("global_steps", 0))
    config = model_state.get("ds_config") if isinstance(model_state.get("ds_config"), dict) else {}
    accumulation = int(config.get("gradient_accumulation_steps", 1) or 1)
    counters.update(global_steps=steps, micro_steps=steps * accumulation,
                    skipped_steps=int(model_state.get("skipped_steps", 0)))
    return layout


CHUNK_NUMEL = 128 * 2**20
"""Values (fp32: 512 MB) read as full tensors at a time: every rank reads the whole model, part by part,
re-opening the memory-mapped rank files for each part."""


def _chunks(keys: list[str], numel: Any) -> list[list[str]]:
    """``keys`` in order, grouped so that each group's ``numel`` adds up to at most :data:`CHUNK_NUMEL`
    (a larger tensor alone)."""
    groups: list[list[str]] = [[]]
    total = 0
    for key in keys:
        size = numel(key)
        if groups[-1] and total + size > CHUNK_NUMEL:
            groups.append([])
            total = 0
        groups[-1].append(key)
        total += size
    return [g for g in groups if g]


def _fill(template: Any, full: torch.Tensor) -> None:
    """Copy ``full`` (the whole tensor) into ``template``: a tensor, or this rank's shard of a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(template, DTensor):
        if tuple(template.shape) != tuple(full.shape):
            raise CheckpointError(f"shape {tuple(full.shape)} in the checkpoint, {tuple(template.shape)} in the model")
        local = distribute_tensor(full.to(template.dtype), template.device_mesh, template.placements, src_data_rank=None)
        template._local_tensor.copy_(local._local_tensor)
    elif isinstance(template, torch.Tensor):
        template.copy_(full.reshape(template.shape))
    else:
        raise CheckpointError(f"the engine's state holds a {type(template).__name__} where a tensor was expected")


def _fill_optimizer(optim_state: dict, weights: DeepSpeedWeights, source: dict[str, str], layout: DeepSpeedLayout) -> None:
    per_param = optim_state.get("state", {})
    names = {fqn: source.get(fqn, fqn) for fqn in per_param}
    frozen_here = [n for n in names.values() if n not in weights.entries or weights.entries[n].kind != "trained"]
    if frozen_here:
        raise CheckpointError(f"{layout.tag_dir}: the model trains {', '.join(frozen_here[:3])}, which the DeepSpeed "
                              "run did not (no optimizer state): freeze the same parameters as the run that saved")
    for fqns in _chunks(list(per_param), lambda f: 2 * weights.entries[names[f]].numel):
        moments = weights.read_optimizer_state(dict.fromkeys(names[f] for f in fqns))
        for fqn in fqns:
            entry, saved = per_param[fqn], moments[names[fqn]]
            missing = [k for k in entry if k not in saved]
            if missing:
                raise CheckpointError(f"{layout.tag_dir}: the engine's optimizer keeps {missing} for {fqn}; DeepSpeed's "
                                      "checkpoint holds Adam's exp_avg, exp_avg_sq and step: resume with Adam or AdamW")
            for key, value in entry.items():
                _fill(value, saved[key])
        del moments
    lrs = _learning_rates(weights, layout)
    for group in optim_state.get("param_groups", []):
        found = {lrs[source.get(p, p)] for p in group.get("params", []) if source.get(p, p) in lrs}
        if len(found) > 1:
            raise CheckpointError(f"{layout.tag_dir}: an optimizer group of the model holds parameters that DeepSpeed "
                                  f"stepped with different learning rates {sorted(found)}; group the parameters as the "
                                  "run that saved did")
        if found:
            group["lr"] = found.pop()


def _learning_rates(weights: DeepSpeedWeights, layout: DeepSpeedLayout) -> dict[str, float]:
    """Each trained parameter's learning rate in DeepSpeed's optimizer (that of the next step)."""
    sd = load_deepspeed_file(layout.optim_files[0])["optimizer_state_dict"]
    if layout.stage < 3:
        groups = sd["base_optimizer_state"]["param_groups"]  # group g <-> param_shapes[g]
        owner = {g: g for g in range(len(weights.param_groups))}
    else:
        groups = sd["optimizer_state_dict"]["param_groups"]  # params: the sub-groups it steps
        owner = {int(i): j for j, group in enumerate(groups) for i in group.get("params", [])}
    out: dict[str, float] = {}
    for i, params in enumerate(weights.param_groups):
        if i not in owner or owner[i] >= len(groups):
            raise CheckpointError(f"{layout.optim_files[0]}: no optimizer group holds the parameters of group {i}")
        for name, _ in params:
            out[name] = float(groups[owner[i]]["lr"])
    return out


def _deepspeed_loss_scaler(layout: DeepSpeedLayout) -> dict[str, Any]:
    scaler = load_deepspeed_file(layout.optim_files[0])["optimizer_state_dict"].get("loss_scaler")
    fields = dict(vars(scaler)) if scaler is not None else {}
    return {k: fields[k] for k in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis") if k in fields}
