"""The global gradient norm over every rank's gradient shards, host- or device-resident.

Stages 2/3 with optimizer offload: each rank holds fp32 shards of every parameter's gradient on the
host (and, with a partial ``ratio``, some on the accelerator). The norm is taken as
``torch.nn.utils.get_total_norm`` takes it over DTensors: per-tensor norms of the local shards, one
all-reduce of their p-th powers, then the norm of the per-tensor norms, so clipping scales the
gradients by the very factor the non-offloaded path uses.

On a hierarchical (replicate x shard) mesh (``mics_shard_size``) the reduction runs over the shard
group only: after FSDP2's all-reduce across replicas every replica holds the same gradient shards,
so the shard group already holds every gradient once. This is what ``get_total_norm`` does with
(Replicate, Shard) DTensors, and it is exact; an all-reduce over all ranks divided by the replica
count would round differently (a sum of three equal fp32 values is not always 3x exactly).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def sharded_total_norm(grads: list[torch.Tensor], norm_type: float, comm_device: torch.device | None,
                       group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The ``norm_type`` norm of the gradients of every rank, as a host fp32 scalar.

    Args:
        grads: this rank's gradient shards, in the same parameter order on every rank.
        norm_type: p (``inf`` for the max norm).
        comm_device: where the all-reduce runs (the mesh device), or None in one process.
        group: the ranks that together hold every gradient once (the shard group of a
            replicate x shard mesh); None: all ranks (a flat mesh).

    >>> sharded_total_norm([torch.tensor([3.0]), torch.tensor([4.0])], 2.0, None)
    tensor(5.)
    """
    if math.isinf(norm_type):
        # A max needs no fixed order: this rank's largest entry, then the largest over ranks
        # (empty shards skipped: the inf-norm of nothing is undefined for torch).
        nonempty = [g for g in grads if g.numel()]
        local = torch.zeros(())
        if nonempty:
            local = norms_on_host(nonempty, norm_type).max()
        if comm_device is not None:
            t = local.reshape(1).to(comm_device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            local = t.to("cpu").reshape(())
        return local
    if not grads:
        return torch.zeros(())
    norms = norms_on_host(grads, norm_type)
    if comm_device is not None:
        t = (norms**norm_type).to(comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        norms = t.to("cpu") ** (1.0 / norm_type)
    return torch.linalg.vector_norm(norms, norm_type)


def norms_on_host(tensors: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Per-tensor norms as one fp32 host vector, in order. Host and device gradients mix with
    partial offload (``ratio``); the device ones come over in one copy per device instead of one
    blocking ``.to("cpu")`` per tensor (review F11)."""
    norms = torch._foreach_norm(tensors, norm_type)
    out = torch.empty(len(norms), dtype=torch.float32)
    by_device: dict[torch.device, list[int]] = {}
    for i, n in enumerate(norms):
        by_device.setdefault(n.device, []).append(i)
    for index in by_device.values():
        out[index] = torch.stack([norms[i] for i in index]).to("cpu", torch.float32)
    return out
