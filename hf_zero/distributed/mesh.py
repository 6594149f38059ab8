"""The device mesh a sharded stage runs on: flat, or hierarchical from the DeepSpeed keys users set.

``mics_shard_size: N`` (MiCS) becomes FSDP2 over a 2-D ``(replicate, shard)`` mesh of
``(world / N, N)`` ranks (HSDP): parameters, gradients and optimizer state are sharded inside each
group of N consecutive ranks and replicated across the groups; the forward's and backward's
all-gathers and the gradient reduce-scatters stay inside a group, and one all-reduce across the
groups completes the gradients. ``zero_hpz_partition_size: M`` (ZeRO++ hpZ) becomes
``fully_shard(reshard_after_forward=M)``: after the forward each unit keeps its parameters sharded
over groups of M consecutive ranks instead of the whole shard group, so the backward's all-gathers
stay inside such a group (a node when M is its GPU count), at the memory of 1/M instead of
1/shard-size parameters between forward and backward. Both are torch's own mechanisms; this module
only checks the sizes against the world and the nodes and builds the mesh.

Ranks are numbered node by node (torchrun's ``--nnodes`` launch does), so groups of consecutive
ranks that divide the ranks per node (or are a multiple of them) never straddle a node boundary
in part.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MeshError", "MeshPlan", "build_mesh", "plan_mesh"]

_MICS = "zero_optimization.mics_shard_size"
_HPZ = "zero_optimization.zero_hpz_partition_size"


class MeshError(ValueError):
    """The config's group sizes do not fit this launch (world size, ranks per node)."""


@dataclass(frozen=True)
class MeshPlan:
    """The mesh shape and the reshard-after-forward choice of a sharded stage."""

    world: int
    shard: int
    """Ranks a parameter is sharded over (the world, or ``mics_shard_size``)."""
    replicate: int
    """Groups the shards are replicated across (1 on a flat mesh)."""
    reshard_after_forward: bool | int
    """FSDP2's argument: True (stage 3), False (stage 2), or the hpZ group size."""
    hpz_same_as_shard: bool = False
    """``zero_hpz_partition_size`` equals the shard group (ZeRO++'s one-node example, 8 on 8 GPUs):
    the secondary copy would be the primary one, so nothing changes."""

    @property
    def hierarchical(self) -> bool:
        return self.replicate > 1

    def describe(self) -> str:
        """One line for the start-up log: what the keys became."""
        parts = []
        if self.hpz_same_as_shard:
            parts.append(f"{_HPZ} equals the shard group of {self.shard} ranks: no secondary partition, nothing changes")
        if self.hierarchical:
            parts.append(f"{_MICS}={self.shard}: parameters, gradients and optimizer state sharded inside "
                         f"{self.replicate} groups of {self.shard} ranks, replicated across them "
                         f"(FSDP2 over a {self.replicate} x {self.shard} replicate x shard mesh)")
        else:
            parts.append(f"sharded over all {self.world} ranks")
        if isinstance(self.reshard_after_forward, int) and not isinstance(self.reshard_after_forward, bool):
            parts.append(f"{_HPZ}={self.reshard_after_forward}: after the forward, parameters stay sharded over "
                         f"groups of {self.reshard_after_forward} ranks, so the backward's all-gathers stay inside "
                         "them (FSDP2 reshard_after_forward="
                         f"{self.reshard_after_forward})")
        return "; ".join(parts)


def plan_mesh(stage: int, world: int, ranks_per_node: int, mics_shard_size: int = -1,
              hpz_partition_size: int = 1) -> MeshPlan:
    """The mesh of a stage-2/3 run from the config's group sizes.

    Raises:
        MeshError: a size that does not divide the world size, or that splits a node's ranks
            between groups partly (a group must divide the ranks per node or be a multiple of it).

    >>> plan_mesh(3, 16, 8, mics_shard_size=8)
    MeshPlan(world=16, shard=8, replicate=2, reshard_after_forward=True, hpz_same_as_shard=False)
    >>> plan_mesh(3, 16, 8, hpz_partition_size=8).reshard_after_forward
    8
    >>> plan_mesh(3, 8, 8, hpz_partition_size=8).reshard_after_forward  # one node: nothing to do
    True
    """
    reshard: bool | int = stage == 3
    same = False
    shard = world
    if mics_shard_size > 0 and mics_shard_size != world:
        _check_group(_MICS, mics_shard_size, world, ranks_per_node)
        shard = mics_shard_size
    if stage == 3 and hpz_partition_size > 1 and hpz_partition_size == shard:
        same = True  # a secondary partition over the whole shard group is the primary one
    elif stage == 3 and hpz_partition_size > 1:
        if hpz_partition_size > shard or shard % hpz_partition_size:
            where = f"the shard group of {shard} ranks" + (f" ({_MICS})" if shard != world else " (the world size)")
            raise MeshError(
                f"{_HPZ}={hpz_partition_size} must divide {where} (torch's reshard_after_forward=int): use the "
                "ranks of one node, or 1 to switch hpZ off"
            )
        _check_group(_HPZ, hpz_partition_size, world, ranks_per_node)
        reshard = hpz_partition_size
    return MeshPlan(world=world, shard=shard, replicate=world // shard, reshard_after_forward=reshard,
                    hpz_same_as_shard=same)


def _check_group(key: str, size: int, world: int, ranks_per_node: int) -> None:
    if size > world or world % size:
        raise MeshError(f"{key}={size} does not divide the world size {world}: use a divisor of {world} "
                        f"(such as the {ranks_per_node} ranks of a node), or switch it off")
    if size % ranks_per_node and ranks_per_node % size:
        raise MeshError(
            f"{key}={size} splits the {ranks_per_node} ranks of a node between groups of {size} ranks: a group must "
            f"hold whole nodes or divide a node's ranks (use {ranks_per_node}, a divisor of it, or a multiple)"
        )


def build_mesh(device_type: str, plan: MeshPlan):
    """The ``DeviceMesh`` for ``plan``: 1-D over the world, or 2-D ``("replicate", "shard")``."""
    from torch.distributed.device_mesh import init_device_mesh

    if not plan.hierarchical:
        return init_device_mesh(device_type, (plan.world,))
    return init_device_mesh(device_type, (plan.replicate, plan.shard), mesh_dim_names=("replicate", "shard"))
