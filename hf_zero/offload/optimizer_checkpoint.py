"""The offloaded optimizer's state in checkpoints: name-keyed for ``torch.distributed.checkpoint``
(DTensors over host shards at stages 2/3, so offloaded and non-offloaded runs read each other's
checkpoints) and index-keyed for ``torch.optim.Optimizer.state_dict``. A mixin of
:class:`hf_zero.offload.host_optimizer.OffloadedOptimizer` (its attributes).
"""

from __future__ import annotations

from typing import Any

import torch

from hf_zero.distributed import device as accel
from hf_zero.offload.base import OffloadError, alloc_host
from hf_zero.offload.host_layout import _SETTING, _Chunk, _local, _Piece, host_dtensor

__all__: list[str] = []


class _OptimizerCheckpoint:
    """Save and load of the offloaded optimizer's hyper-parameters, state and fp32 masters."""

    def checkpoint_state(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """``(optimizer_state, masters)`` keyed by parameter name, for ``torch.distributed.checkpoint``.

        The optimizer part has the layout of ``get_optimizer_state_dict`` (``{"state": {fqn:
        {key: tensor}}, "param_groups": [{..., "params": [fqn, ...]}]}``); at stages 2/3 its
        tensors are DTensors over host shards, so an offloaded run and a non-offloaded one read
        each other's checkpoints. ``masters`` holds the fp32 weights of the host-stepped
        parameters (they replace the 16-bit device values in the model's entries). With CPU
        offload the tensors are the live storage (a load fills them in place); with NVMe they are
        host copies read from the swap files (the whole shard is in memory while saving).
        """
        self._flush_prefetch()
        state: dict[str, Any] = {}
        masters: dict[str, torch.Tensor] = {}
        values = self._materialize()
        for slot in self.slots:
            master, per_key, other = values[id(slot)]
            entry: dict[str, Any] = {}
            for key, value in other.items():
                entry[key] = value
            for key, flat in per_key.items():
                entry[key] = host_dtensor(flat.view(slot.local_shape), slot.like)
            state[slot.name] = entry
            masters[slot.name] = host_dtensor(master.view(slot.local_shape), slot.like)
        if self._device_opt is not None:
            for group in self._device_opt.param_groups:
                for p in group["params"]:
                    st = self._device_opt.state.get(p)
                    if not st:
                        st = {key: _zeros_like_state(value, p) for key, value in self._state_template().items()}
                        self._device_opt.state[p] = st
                    state[self._names[id(p)]] = dict(st)
        groups = []
        for group in self.param_groups:
            groups.append({
                **{k: v for k, v in group.items() if k != "params"},
                "params": [self._names[id(p)] for p in group["params"]],
            })
        return {"state": state, "param_groups": groups}, masters

    def owners(self) -> dict[str, int] | None:
        """``{parameter name: rank holding its fp32 master}`` at stages 0/1 (each rank steps whole
        parameters it owns); None at stages 2/3, where every rank holds the master of its shards."""
        if self._owner is None:
            return None
        return {self._names[id(p)]: self._owner[id(p)] for g in self.param_groups for p in g["params"]}

    def _state_template(self) -> dict[str, Any]:
        template = {key: None for key in self._state_keys}
        template.update(self._state_other)
        return template

    def _materialize(self) -> dict[int, tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]]:
        """Per slot: (flat fp32 master, {key: flat state}, {key: other state}); zeros for state
        not created yet, so that a state dict used as a load template has every entry."""
        out = {}
        for slot in self.slots:
            first = slot.pieces[0] if slot.pieces else None
            inner_state = {}
            if first is not None:
                chunk = self._chunk_of(first)
                inner_state = chunk.optimizer.state.get(first.tensor, {})
            other = {}
            for key, default in self._state_other.items():
                value = inner_state.get(key, default)
                other[key] = value.clone() if torch.is_tensor(value) else value
            if not self._nvme:
                for key in self._state_keys:
                    if key not in slot.state:
                        slot.state[key] = alloc_host(slot.numel, torch.float32, pin=False, setting=_SETTING)
                out[id(slot)] = (slot.master, dict(slot.state), other)
            else:
                out[id(slot)] = (
                    torch.zeros(slot.numel, dtype=torch.float32),
                    {key: torch.zeros(slot.numel, dtype=torch.float32) for key in self._state_keys},
                    other,
                )
        if self._nvme:
            self._read_all_into(out)
        return out

    def _chunk_of(self, piece: _Piece) -> _Chunk:
        for chunk in self.chunks:
            if any(p is piece for p in chunk.pieces):
                return chunk
        raise KeyError(piece.slot.name)

    def load_checkpoint_state(self, optim_state: dict[str, Any], masters: dict[str, torch.Tensor]) -> None:
        """Inverse of :meth:`checkpoint_state`: hyper-parameters, state and fp32 masters.

        Also writes the masters into the device parameters (cast to their dtype), so that the
        model computes with exactly the loaded weights.
        """
        self._flush_prefetch()
        saved_groups = optim_state.get("param_groups", [])
        for group, saved in zip(self.param_groups, saved_groups):
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
        entries = optim_state.get("state", {})
        loaded = {}
        for slot in self.slots:
            if slot.name not in masters:
                raise OffloadError(f"the checkpoint has no weights for {slot.name}")
            entry = entries.get(slot.name, {})
            master = _local(masters[slot.name]).reshape(-1).to("cpu", torch.float32)
            per_key = {}
            for key in self._state_keys:
                if key in entry and torch.is_tensor(entry[key]):
                    per_key[key] = _local(entry[key]).reshape(-1).to("cpu", torch.float32)
            other = {key: entry[key] for key in self._state_other if key in entry}
            loaded[id(slot)] = (master, per_key, other, bool(per_key))
        if self._nvme:
            self._write_all_from(loaded)
        else:
            for slot in self.slots:
                master, per_key, _, _ = loaded[id(slot)]
                _copy_if_other(slot.master, master)
                for key, value in per_key.items():
                    if key not in slot.state:
                        slot.state[key] = alloc_host(slot.numel, torch.float32, pin=False, setting=_SETTING)
                    _copy_if_other(slot.state[key], value)
        for chunk in self.chunks:
            state = chunk.optimizer.state
            for piece in chunk.pieces:
                _, per_key, other, has_state = loaded[id(piece.slot)]
                if not has_state:
                    state.pop(piece.tensor, None)
                    piece.adopted = False
                    continue
                st = {key: (value.clone() if torch.is_tensor(value) else value) for key, value in other.items()}
                if not self._nvme:
                    for key in per_key:
                        st[key] = piece.slot.state[key][piece.start : piece.end]
                state[piece.tensor] = st
                piece.adopted = True
        if self._device_opt is not None:
            for group in self._device_opt.param_groups:
                for p in group["params"]:
                    entry = entries.get(self._names[id(p)])
                    if entry:
                        self._device_opt.state[p] = {k: v for k, v in entry.items()}
        copies = accel.PendingCopies()
        for slot in self.slots:
            master = loaded[id(slot)][0] if self._nvme else slot.master
            if slot.numel:
                self._write_param(slot, 0, master, copies)
        copies.wait()

    # torch.optim.Optimizer API: index-keyed, local tensors (what Trainer._save_optimizer_and_scheduler
    # would write outside hf_zero's sharded checkpoints).
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        optim_state, masters = self.checkpoint_state()
        index = {}
        for group in self.param_groups:
            for p in group["params"]:
                index[self._names[id(p)]] = len(index)
        state = {}
        for name, entry in optim_state["state"].items():
            local = {k: (_local(v) if torch.is_tensor(v) else v) for k, v in entry.items()}
            if name in masters:
                local["master"] = _local(masters[name])
            state[index[name]] = local
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in optim_state["param_groups"]]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        names = [self._names[id(p)] for g in self.param_groups for p in g["params"]]
        state = {}
        masters = {}
        for i, entry in state_dict["state"].items():
            entry = dict(entry)
            if "master" in entry:
                masters[names[int(i)]] = entry.pop("master")
            state[names[int(i)]] = entry
        groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state_dict["param_groups"]]
        for slot in self.slots:
            masters.setdefault(slot.name, _local(slot.param.data).float())
        self.load_checkpoint_state({"state": state, "param_groups": groups}, masters)


def _zeros_like_state(template: Any, param: torch.Tensor) -> Any:
    if template is None:
        return torch.zeros_like(param, dtype=torch.float32)
    if torch.is_tensor(template):
        return torch.zeros_like(template)
    return template


def _copy_if_other(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.data_ptr() == src.data_ptr() and dst.numel() == src.numel():
        return
    dst.copy_(src.reshape(dst.shape))
