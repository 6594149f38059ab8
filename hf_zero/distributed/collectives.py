"""Small typed wrappers over torch.distributed collectives used by the engine."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_reduce_flag", "all_reduce_max_float", "broadcast_object"]


def all_reduce_flag(flag: bool | torch.Tensor, device: torch.device) -> bool:
    """True on every rank when ``flag`` is true on any rank (e.g. "my gradients overflowed")."""
    t = torch.as_tensor(flag, dtype=torch.float32, device=device).reshape(1).clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def all_reduce_max_float(value: float, device: torch.device) -> float:
    """The largest ``value`` over all ranks."""
    t = torch.tensor([value], dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s ``obj`` on every rank (identity with one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
