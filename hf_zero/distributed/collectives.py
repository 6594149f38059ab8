"""Small typed wrappers over torch.distributed collectives used by the engine."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "agree_on_error",
    "all_reduce_flag",
    "all_reduce_max_float",
    "broadcast_object",
    "collective_device",
    "on_mesh_device",
    "dtensor_total_norm",
]


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


def collective_device(group=None) -> torch.device:
    """Where a small tensor for a collective on ``group`` must live: the current accelerator when
    the group has no CPU backend (NCCL alone), host memory otherwise (gloo, "cpu:gloo,cuda:nccl")."""
    from hf_zero.distributed import device

    backend = str(dist.get_backend(group)) if dist.is_initialized() else "gloo"
    if "gloo" in backend or "cpu" in backend or not device.accelerator_available():
        return torch.device("cpu")
    return device.current_device()


def agree_on_error(
    error: BaseException | None,
    what: str,
    *,
    error_type: type[Exception] = RuntimeError,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Raise on every rank when ``what`` failed on any rank, so no rank waits in a later collective.

    Every rank must call it, with ``error=None`` when its part went well (also the ranks that did
    nothing). Costs one scalar all-reduce when no rank failed, plus an all-gather of the messages
    when one did. The failing rank re-raises its own exception (with its traceback); the others
    raise ``error_type`` quoting it, so every rank's log names the path or setting at fault.

    Example::

        error = None
        if rank == 0:
            try:
                write_files(out)
            except Exception as exc:  # a full disk: every rank must hear of it
                error = exc
        agree_on_error(error, f"writing {out}", error_type=CheckpointError)
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    flag = torch.tensor([0.0 if error is None else 1.0], device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if float(flag.item()) == 0.0:
        return
    messages: list[str | None] = [None] * dist.get_world_size(group)
    mine = None if error is None else f"{type(error).__name__}: {error}"
    dist.all_gather_object(messages, mine, group=group)
    if error is not None:
        raise error
    rank, message = next((r, m) for r, m in enumerate(messages) if m is not None)
    raise error_type(f"{what} failed on rank {rank}: {message}")


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s ``obj`` on every rank (identity with one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def on_mesh_device(value):
    """``value`` (a DTensor) with its local shard on its mesh's device type, ready for a collective.

    Offloaded shards (FSDP2's ``CPUOffloadPolicy``) live in host memory while the mesh is CUDA; an
    NCCL-only group refuses them ("No backend type associated with device type cpu"). torch's own
    ``_gather_state_dict`` moves them the same way. Placements, ``Partial`` included, are kept, so
    ``on_mesh_device(norm).full_tensor()`` reduces a partial norm on the accelerator.

    >>> on_mesh_device(grad_norm).full_tensor()  # doctest: +SKIP
    """
    from torch.distributed.tensor import DTensor

    mesh_type = value.device_mesh.device_type
    if value.device.type == mesh_type:
        return value
    local = value.to_local().to(mesh_type)
    return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                              shape=value.shape, stride=value.stride())


def dtensor_total_norm(grads, norm_type: float = 2.0) -> torch.Tensor | None:
    """The norm of FSDP2-sharded gradients with one collective, or None when ``grads`` are not all
    DTensors of one mesh sharded on one dimension (the caller then uses torch's
    ``get_total_norm``, which reduces one scalar per tensor: hundreds of latency-bound collectives
    per step on a real model).

    The same arithmetic as torch's on DTensors, so the same number: per-tensor norms of the local
    shards, their p-th powers summed over the shard group in one all-reduce of a vector, then the
    norm of the per-tensor norms (``offload/grad_norm.sharded_total_norm``, which the offloaded
    optimizer uses too). Replicated mesh dimensions (MiCS's replicas, which hold the same shards
    after FSDP2's all-reduce) take no part. Returns the norm on the local shards' device.

    >>> norm = dtensor_total_norm([p.grad for p in model.parameters()])  # doctest: +SKIP
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from hf_zero.offload.grad_norm import sharded_total_norm

    if not grads or not all(isinstance(g, DTensor) for g in grads):
        return None
    mesh, placements = grads[0].device_mesh, grads[0].placements
    if any(g.device_mesh != mesh or g.placements != placements for g in grads):
        return None
    sharded = [i for i, p in enumerate(placements) if isinstance(p, Shard)]
    if len(sharded) != 1 or not all(isinstance(p, (Shard, Replicate)) for p in placements):
        return None
    group = mesh.get_group(sharded[0])
    locals_ = [g.to_local() for g in grads]
    # Offloaded shards' gradients live in host memory: the reduction runs where the group reduces.
    norm = sharded_total_norm(locals_, float(norm_type), collective_device(group), group=group)
    return norm.to(locals_[0].device)
