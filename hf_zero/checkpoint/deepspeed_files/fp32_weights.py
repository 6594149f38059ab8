"""DeepSpeed's ZeRO rank files -> the model's full fp32 tensors, as DeepSpeed's ``zero_to_fp32`` builds them.

The names, order and values are those of ``deepspeed.utils.zero_to_fp32``'s state dict: the
buffers (``buffer_names``, from rank 0's model-states ``module``, cast to fp32), the frozen
parameters (``frozen_param_shapes``: ZeRO-1/2 keep each whole in ``frozen_param_fragments``,
ZeRO-3 one piece per rank's model-states file), the trained parameters from the fp32 masters of
the optimizer files, then the shared parameters (``shared_params``: ``lm_head.weight`` is
``transformer.wte.weight``) as aliases.

- ZeRO-1/2: each param group ``g`` is one flat buffer in ``param_shapes[g]`` order (with
  ``param_alignment_paddings`` after each parameter), split into equal partitions of the buffer
  padded to a multiple of 2 x world size; rank ``r``'s ``single_partition_of_fp32_groups[g]`` holds
  its partition without the padding (``group_paddings``).
- ZeRO-3: each parameter, in ``param_shapes`` order (all groups), is split into
  ``ceil(numel / world)`` pieces, one per rank (the last padded); a rank's pieces follow each other
  through its ``fp32_flat_groups`` (its sub-groups).

:meth:`DeepSpeedWeights.read` reads the optimizer files one rank at a time (memory-mapped), copying
each rank's pieces of the requested tensors into place. :meth:`DeepSpeedWeights.read_optimizer_state`
does the same for Adam's ``exp_avg``/``exp_avg_sq`` (ZeRO-1/2: ``base_optimizer_state.state[g]``, the
partition with its padding; ZeRO-3: ``optimizer_state_dict.state[i]``, as long as sub-group ``i``) and
its ``step``: the per-parameter state DeepSpeed's ``ds_to_universal`` writes, for a resume.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from hf_zero.checkpoint.deepspeed_files.layout import DeepSpeedLayout
from hf_zero.checkpoint.deepspeed_files.restricted_load import load_deepspeed_file
from hf_zero.checkpoint.errors import CheckpointError

__all__ = ["DeepSpeedWeights", "WeightEntry"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class WeightEntry:
    """One tensor of the consolidated state dict: its shape, the dtype it comes out in
    (fp32 for trained parameters; frozen parameters and buffers as DeepSpeed returns them), and
    where it comes from (``"buffer"``, ``"frozen"`` or ``"trained"``)."""

    shape: torch.Size
    dtype: torch.dtype
    kind: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class DeepSpeedWeights:
    """The full tensors of a DeepSpeed ZeRO checkpoint.

    Attributes:
        layout: the checkpoint's files.
        entries: name -> :class:`WeightEntry`, in ``zero_to_fp32``'s order (without aliases).
        aliases: shared-parameter name -> the entry it is (``shared_params``).
    """

    def __init__(self, layout: DeepSpeedLayout, *, exclude_frozen_parameters: bool = False) -> None:
        self.layout = layout
        state = layout.model_state
        self._where = layout.model_files[0]
        module = self._get(state, "module", dict)
        buffer_names = self._get(state, "buffer_names", list)
        shapes = self._get(state, "param_shapes", list)
        if not all(isinstance(g, dict) for g in shapes):
            raise self._bad("param_shapes", "is not a list of name -> shape tables")
        self.param_groups: list[list[tuple[str, torch.Size]]] = [[(n, self._shape(n, s)) for n, s in g.items()] for g in shapes]
        frozen = state.get("frozen_param_shapes") or {}
        if not isinstance(frozen, dict):
            raise self._bad("frozen_param_shapes", "is not a name -> shape table")
        self.frozen_shapes = {n: self._shape(n, s) for n, s in frozen.items()}
        self.entries: OrderedDict[str, WeightEntry] = OrderedDict()
        for name in buffer_names:
            value = module.get(name)
            if not isinstance(value, torch.Tensor):
                raise self._bad("module", f"lacks the buffer {name!r} that buffer_names lists")
            self.entries[name] = WeightEntry(value.shape, torch.float32 if value.is_floating_point() else value.dtype, "buffer")
        if not exclude_frozen_parameters:
            fragments = state.get("frozen_param_fragments") or {}
            for name, shape in self.frozen_shapes.items():
                piece = fragments.get(name) if isinstance(fragments, dict) else None
                if not isinstance(piece, torch.Tensor):
                    raise self._bad("frozen_param_fragments", f"lacks the frozen parameter {name!r}")
                self.entries[name] = WeightEntry(shape, piece.dtype, "frozen")
        for group in self.param_groups:
            for name, shape in group:
                self.entries[name] = WeightEntry(shape, torch.float32, "trained")
        shared = state.get("shared_params") or {}
        if not isinstance(shared, dict):
            raise self._bad("shared_params", "is not a name -> name table")
        self.aliases = {str(a): str(t) for a, t in shared.items() if t in self.entries}

    # --------------------------------------------------------------------------------------- reading
    @torch.no_grad()  # DeepSpeed's masters are saved with requires_grad: copies must not join a graph
    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The full tensors ``names`` (entries, not aliases), reading one rank's file at a time."""
        names = list(names)
        unknown = [n for n in names if n not in self.entries]
        if unknown:
            raise KeyError(f"not in the checkpoint: {', '.join(unknown[:5])}")
        out = {n: torch.empty(self.entries[n].shape, dtype=self.entries[n].dtype) for n in names}
        module = self.layout.model_state["module"]
        for n in names:
            kind = self.entries[n].kind
            if kind == "buffer":
                value = module[n]
                out[n].copy_(value.float() if value.is_floating_point() else value)
            elif kind == "frozen" and self.layout.stage < 3:
                out[n].copy_(self._frozen_piece(self.layout.model_state, n, self._where).reshape(self.entries[n].shape))
        frozen = [n for n in names if self.entries[n].kind == "frozen" and self.layout.stage == 3]
        if frozen:
            self._read_zero3_frozen(frozen, out)
        trained = [n for n in names if self.entries[n].kind == "trained"]
        if trained:
            self._read_trained(trained, {"fp32": out})
        return out

    @torch.no_grad()
    def read_optimizer_state(self, names: Iterable[str]) -> dict[str, dict[str, torch.Tensor]]:
        """Adam's state of the trained parameters ``names``, full size: ``{name: {"exp_avg",
        "exp_avg_sq", "step"}}`` (``step``: that of the parameter's group or sub-group, a 0-dim
        tensor), laid out as the fp32 masters are, one rank's file at a time."""
        names = list(names)
        untrained = [n for n in names if n not in self.entries or self.entries[n].kind != "trained"]
        if untrained:
            raise KeyError(f"no optimizer state (not a trained parameter of the checkpoint): {', '.join(untrained[:5])}")
        outs = {key: {n: torch.empty(self.entries[n].shape, dtype=torch.float32) for n in names}
                for key in _MOMENTS}
        steps: dict[str, torch.Tensor] = {}
        self._read_trained(names, outs, steps)
        return {n: {**{key: outs[key][n] for key in _MOMENTS}, "step": steps[n]} for n in names}

    def _read_trained(self, names: list[str], outs: dict[str, dict[str, torch.Tensor]],
                      steps: dict[str, torch.Tensor] | None = None) -> None:
        if self.layout.stage == 3:
            self._read_zero3(names, outs, steps)
        else:
            self._read_zero12(names, outs, steps)

    def _read_zero12(self, names: list[str], outs: dict[str, dict[str, torch.Tensor]],
                     steps: dict[str, torch.Tensor] | None) -> None:
        # Flat offset of each wanted parameter in its group's buffer.
        where: dict[str, tuple[int, int]] = {}
        ends: list[int] = []
        wanted = set(names)
        paddings = self._alignment_paddings
        for g, group in enumerate(self.param_groups):
            offset = 0
            for i, (name, shape) in enumerate(group):
                if name in wanted:
                    where[name] = (g, offset)
                offset += math.prod(shape) + (paddings[g][i] if paddings is not None else 0)
            ends.append(offset)
        flats = {key: {n: out[n].view(-1) for n in names} for key, out in outs.items()}
        copied = dict.fromkeys(names, 0)  # values written per tensor: each must be covered exactly once
        sizes: list[int] | None = None
        for rank, path in enumerate(self.layout.optim_files):
            sd = self._optimizer_dict(path, "single_partition_of_fp32_groups")
            parts = sd["single_partition_of_fp32_groups"]
            paddings = sd.get("group_paddings")
            if not isinstance(paddings, list) or len(paddings) != len(parts):
                raise self._bad_file(path, "group_paddings", f"is {paddings!r}, not one padding per group")
            if len(parts) != len(self.param_groups):
                raise self._bad_file(path, "single_partition_of_fp32_groups",
                                     f"has {len(parts)} groups, param_shapes {len(self.param_groups)}")
            rank_sizes = [part.numel() + pad for part, pad in zip(parts, paddings)]
            if sizes is None:
                sizes = rank_sizes
            elif rank_sizes != sizes:
                raise self._bad_file(path, "single_partition_of_fp32_groups", f"with group_paddings makes partitions "
                                     f"of {rank_sizes} values, rank 0's are {sizes}: files of different runs are mixed")
            sources = {key: parts if key == "fp32" else self._zero12_moments(path, sd, key, parts) for key in outs}
            if steps is not None and rank == 0:
                for name, (g, _) in where.items():
                    steps[name] = self._step(path, sd["base_optimizer_state"]["state"][g])
            for g, part in enumerate(parts):
                size = rank_sizes[g]  # the partition, padding included: the same on every rank
                start, stop = rank * size, rank * size + part.numel()
                if stop > start and ends[g] > self.layout.world_size * size:
                    raise self._bad_file(path, "single_partition_of_fp32_groups",
                                         f"group {g} holds {self.layout.world_size * size} values per {self.layout.world_size} "
                                         f"ranks, param_shapes need {ends[g]}")
                for name, (gi, offset) in where.items():
                    if gi != g:
                        continue
                    numel = math.prod(self.entries[name].shape)
                    lo, hi = max(offset, start), min(offset + numel, stop)
                    if lo < hi:
                        for key, source in sources.items():
                            flats[key][name][lo - offset:hi - offset].copy_(source[g][lo - start:hi - start])
                        copied[name] += hi - lo
            del sd, parts, sources
        short = [n for n in names if copied[n] != math.prod(self.entries[n].shape)]
        if short:
            raise self._bad_file(self.layout.optim_files[-1], "single_partition_of_fp32_groups",
                                 f"and the other ranks' cover {copied[short[0]]} of the "
                                 f"{math.prod(self.entries[short[0]].shape)} values of {short[0]!r} (padding where "
                                 "DeepSpeed puts none, or a partition cut short)")

    def _zero12_moments(self, path: str, sd: dict, key: str, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """``base_optimizer_state.state[g][key]`` of every group: the partition's Adam state, padding included."""
        base = sd.get("base_optimizer_state")
        state = base.get("state") if isinstance(base, dict) else None
        if not isinstance(state, dict) or sorted(state) != list(range(len(parts))):
            raise self._bad_file(path, "base_optimizer_state", "has not one Adam state per parameter group "
                                 "(hf_zero reads Adam/AdamW state: exp_avg, exp_avg_sq, step)")
        return [self._moment(path, state[g], key, part.numel()) for g, part in enumerate(parts)]

    @property
    def _alignment_paddings(self) -> list[list[int]] | None:
        if not hasattr(self, "_paddings_cache"):
            sd = self._optimizer_dict(self.layout.optim_files[0], "single_partition_of_fp32_groups")
            paddings = sd.get("param_alignment_paddings")
            if paddings is not None and not (
                isinstance(paddings, list) and len(paddings) == len(self.param_groups)
                and all(isinstance(p, list) and len(p) == len(g) for p, g in zip(paddings, self.param_groups))
            ):
                raise self._bad_file(self.layout.optim_files[0], "param_alignment_paddings", "has not one padding per parameter")
            self._paddings_cache = paddings
        return self._paddings_cache

    def _read_zero3(self, names: list[str], outs: dict[str, dict[str, torch.Tensor]],
                    steps: dict[str, torch.Tensor] | None) -> None:
        world = self.layout.world_size
        where: dict[str, int] = {}  # offset of the parameter's piece in every rank's flat data
        offset = 0
        wanted = set(names)
        for group in self.param_groups:
            for name, shape in group:
                if name in wanted:
                    where[name] = offset
                offset += math.ceil(math.prod(shape) / world)
        total = offset
        flats = {key: {n: out[n].view(-1) for n in names} for key, out in outs.items()}
        for rank, path in enumerate(self.layout.optim_files):
            sd = self._optimizer_dict(path, "fp32_flat_groups")
            groups = sd["fp32_flat_groups"]
            bounds = [0]
            for t in groups:
                bounds.append(bounds[-1] + t.numel())
            if bounds[-1] != total:
                raise self._bad_file(path, "fp32_flat_groups", f"holds {bounds[-1]} values; param_shapes need "
                                     f"{total} per rank at world size {world}")
            sources = {key: groups if key == "fp32" else self._zero3_moments(path, sd, key, groups) for key in outs}
            if steps is not None and rank == 0:
                state = sd["optimizer_state_dict"]["state"]
                for name, start in where.items():
                    sub = next(i for i in range(len(groups)) if bounds[i] <= start < bounds[i + 1] or bounds[i + 1] == total)
                    steps[name] = self._step(path, state[sub])
            for name, start in where.items():
                numel = math.prod(self.entries[name].shape)
                piece = math.ceil(numel / world)
                lo = rank * piece  # this rank's piece covers [lo, lo + piece) of the parameter
                take = min(piece, numel - lo)
                if take > 0:
                    for key, source in sources.items():
                        flats[key][name][lo:lo + take].copy_(_span(source, bounds, start, take))
            del sd, groups, sources

    def _zero3_moments(self, path: str, sd: dict, key: str, groups: list[torch.Tensor]) -> list[torch.Tensor]:
        """``optimizer_state_dict.state[i][key]`` of every sub-group, each as long as its fp32_flat_groups[i]."""
        inner = sd.get("optimizer_state_dict")
        state = inner.get("state") if isinstance(inner, dict) else None
        if not isinstance(state, dict) or sorted(state) != list(range(len(groups))):
            raise self._bad_file(path, "optimizer_state_dict", "has not one Adam state per fp32 sub-group "
                                 "(hf_zero reads Adam/AdamW state: exp_avg, exp_avg_sq, step)")
        moments = [self._moment(path, state[i], key, t.numel()) for i, t in enumerate(groups)]
        if any(m.numel() != t.numel() for m, t in zip(moments, groups)):
            raise self._bad_file(path, f"optimizer_state_dict.state[*][{key!r}]", "is not as long as fp32_flat_groups")
        return moments

    def _moment(self, path: str, state: Any, key: str, at_least: int) -> torch.Tensor:
        value = state.get(key) if isinstance(state, dict) else None
        if not (isinstance(value, torch.Tensor) and value.dim() == 1 and value.dtype == torch.float32
                and value.numel() >= at_least):
            raise self._bad_file(path, key, f"is not a flat fp32 tensor of at least {at_least} values "
                                 "(hf_zero reads Adam/AdamW state: exp_avg, exp_avg_sq, step)")
        return value

    def _step(self, path: str, state: Any) -> torch.Tensor:
        step = state.get("step") if isinstance(state, dict) else None
        if isinstance(step, (int, float)) and not isinstance(step, bool):
            step = torch.tensor(float(step))
        if not isinstance(step, torch.Tensor) or step.numel() != 1:
            raise self._bad_file(path, "step", f"is {step!r}, not Adam's step count")
        return step.reshape(()).clone()

    def _read_zero3_frozen(self, names: list[str], out: dict[str, torch.Tensor]) -> None:
        world = self.layout.world_size
        flats = {n: out[n].view(-1) for n in names}
        for rank, path in enumerate(self.layout.model_files):
            state = self.layout.model_state if rank == 0 else load_deepspeed_file(path)
            for name in names:
                piece = self._frozen_piece(state, name, path).reshape(-1)
                numel = flats[name].numel()
                size = math.ceil(numel / world)
                lo = rank * size
                take = min(size, numel - lo)
                if piece.numel() < max(take, 0):
                    raise self._bad_file(path, "frozen_param_fragments", f"{name!r} has {piece.numel()} values, not {take}")
                if take > 0:
                    flats[name][lo:lo + take].copy_(piece[:take])

    # --------------------------------------------------------------------------------------- checks
    def _optimizer_dict(self, path: str, key: str) -> dict[str, Any]:
        state = load_deepspeed_file(path)
        sd = state.get("optimizer_state_dict") if isinstance(state, dict) else None
        if not isinstance(sd, dict):
            raise self._bad_file(path, "optimizer_state_dict", "is missing: not a DeepSpeed ZeRO optimizer file")
        stage = sd.get("zero_stage")
        if int(stage if stage is not None else -1) != self.layout.stage:
            raise self._bad_file(path, "zero_stage", f"is {stage!r}, but {self._where} is a ZeRO-{self.layout.stage} checkpoint")
        count = sd.get("partition_count")
        counts = count if isinstance(count, list) else [count]
        if any(c != self.layout.world_size for c in counts):
            raise self._bad_file(path, "partition_count", f"is {count!r}, but {self._where} says {self.layout.world_size} "
                                 "ranks saved the checkpoint (dp_world_size) and there are as many optimizer files: "
                                 "files of different runs are mixed; keep one run's files")
        tensors = sd.get(key)
        if not isinstance(tensors, list) or not all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in tensors):
            raise self._bad_file(path, key, "is not a list of flat tensors")
        if any(t.dtype != torch.float32 for t in tensors):
            raise self._bad_file(path, key, f"holds {sorted({str(t.dtype) for t in tensors})}, not the fp32 masters")
        return sd

    def _frozen_piece(self, state: dict, name: str, path: str) -> torch.Tensor:
        fragments = state.get("frozen_param_fragments")
        piece = fragments.get(name) if isinstance(fragments, dict) else None
        if not isinstance(piece, torch.Tensor):
            raise self._bad_file(path, "frozen_param_fragments", f"lacks {name!r}")
        return piece

    def _shape(self, name: Any, shape: Any) -> torch.Size:
        if not isinstance(name, str) or not (isinstance(shape, (torch.Size, tuple, list)) and all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise self._bad("param_shapes", f"has the entry {name!r}: {shape!r}, not a name and a shape")
        return torch.Size(shape)

    def _get(self, state: dict, key: str, kind: type) -> Any:
        value = state.get(key)
        if not isinstance(value, kind):
            raise self._bad(key, f"is {type(value).__name__}, not a {kind.__name__}")
        return value

    def _bad(self, key: str, problem: str) -> CheckpointError:
        return self._bad_file(self._where, key, problem)

    @staticmethod
    def _bad_file(path: str, key: str, problem: str) -> CheckpointError:
        return CheckpointError(f"{path}: '{key}' {problem}; hf_zero reads DeepSpeed 0.19.x ZeRO checkpoints as "
                               "DeepSpeed's zero_to_fp32.py does, and this file does not match that layout")


def _span(groups: list[torch.Tensor], bounds: list[int], start: int, length: int) -> torch.Tensor:
    """``length`` values from ``start`` of the concatenation of ``groups`` (``bounds``: cumulative sizes)."""
    pieces = []
    position, end = start, start + length
    for g, t in enumerate(groups):
        lo, hi = max(position, bounds[g]), min(end, bounds[g + 1])
        if lo < hi:
            pieces.append(t[lo - bounds[g]:hi - bounds[g]])
            position = hi
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
