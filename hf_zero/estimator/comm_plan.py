"""The bytes hf_zero's collectives move per optimizer step, per process group: exact, from shapes.

What a step sends is decided by the engine's layout, so this module follows the engine, not the ZeRO
paper's round numbers:

* stages 2/3 are FSDP2 (``engine/stages.py``): each unit (a transformer block, then the root with
  the rest) all-gathers its parameters in the compute dtype, each padded on dim 0 to a multiple of
  the shard group (torch's ``_get_dim0_padded_size``), and reduce-scatters the trainable ones'
  gradients in ``reduce_dtype`` with the same padding, every micro-step. Stage 3 gathers every unit
  again for the backward (the root too: hf_zero passes ``reshard_after_forward=True`` explicitly,
  so FSDP2 does not skip the root's), over the hpZ group when ``zero_hpz_partition_size`` is set;
  units below ``stage3_param_persistence_threshold`` stay gathered. With ``mics_shard_size`` the
  reduce-scatter's output (the shard's gradients, summed over the micro-steps) is all-reduced across
  the replicas at the accumulation boundary (every micro-step with an offloaded optimizer or a
  16-bit reduce dtype). The gradient
  norm sums one fp32 per trainable tensor over the shard group in one all-reduce
  (``distributed.collectives.dtensor_total_norm``).
* stages 0/1 are DDP: one all-reduce of the trainable gradients per step (none in accumulation
  micro-steps); stage 1's ``ZeroRedundancyOptimizer`` then broadcasts the updated fp32 parameters
  from their owners.

``nbytes`` is the collective's buffer: an all-gather's output, a reduce-scatter's input, an
all-reduce's or broadcast's tensor, summed over the step's calls. That is what a hook on
``torch.distributed`` sees (``tests/distributed/hier_worker.py`` counts it and the tests compare it
with these numbers, exactly). What each GPU then *sends* depends on the algorithm:
:func:`bytes_sent` gives the two-level (inside the node, then across nodes) volumes.

Example:
    >>> units = [UnitShapes("model.layers.0", ((64, 64), (64,)))]
    >>> [(c.op, c.group, c.nbytes) for c in step_collectives(units, stage=3, world=4, gas=1,
    ...                                                       param_bytes=2)][:3]
    [('all_gather', 'shard', 8320), ('all_gather', 'shard', 8320), ('reduce_scatter', 'shard', 16640)]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

__all__ = ["Collective", "GroupShape", "Sent", "UnitShapes", "bytes_sent", "fsdp_units_of", "group_ranks",
           "group_shape", "step_collectives"]

FP32_BYTES = 4
"""fp32 masters (stage 1's broadcast) and the gradient norm's scalars."""


@dataclass(frozen=True)
class UnitShapes:
    """The parameters one FSDP2 unit shards itself (not those of units inside it)."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    trainable: tuple[bool, ...] = ()
    """Per shape; empty means all trainable."""

    def is_trainable(self, i: int) -> bool:
        return self.trainable[i] if self.trainable else True


@dataclass(frozen=True)
class Collective:
    """One kind of collective in an optimizer step."""

    op: str
    """``all_gather``, ``reduce_scatter``, ``all_reduce`` or ``broadcast``."""
    group: str
    """``world``, ``shard`` (the shard group: the world, or ``mics_shard_size``), ``replicate`` (the
    ranks holding the same shard, one per shard group) or ``hpz`` (``zero_hpz_partition_size``)."""
    nbytes: int
    """Buffer bytes summed over the step's calls (all-gather output, reduce-scatter input)."""
    calls: int | None
    """Collectives per step; None where torch decides (DDP's buckets, ZeroRedundancyOptimizer's
    broadcasts)."""
    what: str


def _padded_numel(shape: Sequence[int], factor: int) -> int:
    """torch FSDP2's ``_get_dim0_padded_size``: dim 0 rounded up to a multiple of ``factor``
    (a 0-dim parameter is stored as one element: ``engine/scalar_params.py``)."""
    if not shape:
        shape = (1,)
    rest = 1
    for d in shape[1:]:
        rest *= d
    return -(-shape[0] // factor) * factor * rest


def step_collectives(units: Sequence[UnitShapes], *, stage: int, world: int, gas: int, param_bytes: int,
                     reduce_bytes: int = FP32_BYTES, shard: int | None = None, hpz: int = 1,
                     persistence_threshold: int | None = None, fp16_dynamic: bool = False,
                     offload: bool = False) -> list[Collective]:
    """Every collective of one optimizer step of ``gas`` micro-steps, with its buffer bytes.

    Args:
        units: the FSDP2 units in any order, root included (:func:`fsdp_units_of`); at stages 0/1
            only their trainable shapes count.
        param_bytes: bytes of the compute dtype (the all-gather's dtype): 2 for bf16/fp16, 4 fp32.
        reduce_bytes: bytes of ``reduce_dtype`` (``communication_data_type``; fp32 unless set).
        shard: the shard group (``mics_shard_size``); None or the world size for a flat mesh.
        hpz: ``zero_hpz_partition_size`` (stage 3; 1 or the shard size: off).
        persistence_threshold: ``stage3_param_persistence_threshold`` when the config sets it.
        fp16_dynamic: fp16 with dynamic loss scaling (one overflow flag reduced per step).
        offload: an offloaded optimizer (MiCS then all-reduces every micro-step, not at the boundary).
    """
    shard = world if shard is None or shard <= 0 else shard
    out: list[Collective] = []
    trainable = [(s, u) for u in units for i, s in enumerate(u.shapes) if u.is_trainable(i)]
    if world == 1:
        return out
    if stage in (0, 1):
        grads = sum(_padded_numel(s, 1) for s, _ in trainable)
        out.append(Collective("all_reduce", "world", grads * reduce_bytes, None,
                              "gradients (DDP's buckets, once per step)"))
        if stage == 1:
            out.append(Collective("broadcast", "world", grads * FP32_BYTES, None,
                                  "updated fp32 parameters from their owners (ZeroRedundancyOptimizer)"))
    elif stage in (2, 3):
        gathered = [sum(_padded_numel(s, shard) for s in u.shapes) for u in units]
        reduced = [sum(_padded_numel(s, shard) for i, s in enumerate(u.shapes) if u.is_trainable(i)) for u in units]
        out.append(Collective("all_gather", "shard", gas * sum(gathered) * param_bytes, gas * len(units),
                              "parameters for the forward"))
        if stage == 3:
            again = [g for u, g in zip(units, gathered) if not _persistent(u, persistence_threshold)]
            group = "hpz" if 1 < hpz < shard else "shard"
            out.append(Collective("all_gather", group, gas * sum(again) * param_bytes, gas * len(again),
                                  "parameters again for the backward"))
        with_grads = [r for r in reduced if r]
        out.append(Collective("reduce_scatter", "shard", gas * sum(with_grads) * reduce_bytes, gas * len(with_grads),
                              "gradients, every micro-step"))
        if shard < world:  # at the boundary only, unless offloaded or 16-bit (stages.defers_replica_all_reduce)
            times = 1 if reduce_bytes == FP32_BYTES and not offload else gas
            out.append(Collective("all_reduce", "replicate", times * sum(with_grads) // shard * reduce_bytes,
                                  times * len(with_grads), "the shard's gradients across the replicas (MiCS)"))
        out.append(Collective("all_reduce", "shard", len(trainable) * FP32_BYTES, 1,
                              "the gradient norm: each trainable tensor's p-th power, one vector"))
    else:
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if fp16_dynamic:
        out.append(Collective("all_reduce", "world", FP32_BYTES, 1, "the fp16 overflow flag"))
    return [c for c in out if c.nbytes]


def _persistent(unit: UnitShapes, threshold: int | None) -> bool:
    """``engine/fsdp_knobs.persistent_units``: every own parameter below the threshold (root never)."""
    if threshold is None or unit.name == "" or not unit.shapes:
        return False
    return max(_padded_numel(s, 1) for s in unit.shapes) < threshold


def fsdp_units_of(model: Any) -> list[UnitShapes]:
    """The units the engine would shard ``model`` into (a real or a meta-device model), root last
    with the name ``""``: the engine's own choice (``engine/wrap_policy.find_wrap_units``)."""
    from hf_zero.engine.wrap_policy import find_wrap_units

    taken: set[int] = set()
    units = []
    for module in [*find_wrap_units(model), model]:  # innermost first, as fully_shard is applied
        own = [p for p in module.parameters() if id(p) not in taken]
        taken.update(id(p) for p in own)
        name = "" if module is model else next(n for n, m in model.named_modules() if m is module)
        units.append(UnitShapes(name, tuple(tuple(p.shape) for p in own), tuple(p.requires_grad for p in own)))
    return units


# --- who is in a group, and what each GPU sends ----------------------------------------------------


def group_ranks(group: str, rank: int, world: int, shard: int | None = None, hpz: int = 1) -> list[int]:
    """The ranks of ``rank``'s group of a kind (ranks numbered node by node, as torchrun does)."""
    shard = world if shard is None or shard <= 0 else shard
    if group == "world":
        return list(range(world))
    if group == "shard":
        first = rank - rank % shard
        return list(range(first, first + shard))
    if group == "replicate":
        return list(range(rank % shard, world, shard))
    if group == "hpz":
        first = rank - rank % hpz
        return list(range(first, first + hpz))
    raise ValueError(f"unknown group {group!r}")


@dataclass(frozen=True)
class GroupShape:
    """A process group seen from the cluster: ``nodes`` nodes of ``per_node`` ranks each."""

    nodes: int
    per_node: int

    @property
    def size(self) -> int:
        return self.nodes * self.per_node


def group_shape(ranks: Iterable[int], gpus_per_node: int) -> GroupShape:
    ranks = list(ranks)
    nodes = len({r // gpus_per_node for r in ranks})
    return GroupShape(nodes, len(ranks) // nodes)


@dataclass(frozen=True)
class Sent:
    """Bytes one GPU sends: over NVLink/PCIe to its node's GPUs, and over the network to other nodes."""

    intra: Fraction
    inter: Fraction

    def __add__(self, other: Sent) -> Sent:
        return Sent(self.intra + other.intra, self.inter + other.inter)


def bytes_sent(op: str, nbytes: int, shape: GroupShape) -> Sent:
    """What one GPU sends for a collective of ``nbytes`` over a group of ``shape``, by the two-level
    algorithm (NCCL's tree/ring across nodes moves about the same across the network per GPU):

    * all-gather of an output S over n = m nodes x g ranks: each GPU sends its S/n to its peers of
      the same local rank on the m - 1 other nodes, ``(m-1) S/n`` across nodes, then the node
      all-gathers the S/g it holds, ``(g-1)/g S`` inside the node. A reduce-scatter of an input S is
      the same in reverse; an all-reduce is both (2x); a broadcast from every owner of its part
      (stage 1) is counted as an all-gather of the whole.

    >>> bytes_sent("all_gather", 800, GroupShape(nodes=1, per_node=8))   # one node: a ring, 7/8 S
    Sent(intra=Fraction(700, 1), inter=Fraction(0, 1))
    >>> s = bytes_sent("all_reduce", 800, GroupShape(nodes=4, per_node=1))  # MiCS replicas, one per node
    >>> s.inter   # 2 (m-1)/m S: a reduce-scatter and an all-gather across the 4 nodes
    Fraction(1200, 1)
    """
    n, m, g = shape.size, shape.nodes, shape.per_node
    if n <= 1:
        return Sent(Fraction(0), Fraction(0))
    intra = Fraction(nbytes * (g - 1), g)
    inter = Fraction(nbytes * (m - 1), n)
    if op == "all_reduce":
        return Sent(2 * intra, 2 * inter)
    if op in ("all_gather", "reduce_scatter", "broadcast"):
        return Sent(intra, inter)
    raise ValueError(f"unknown collective {op!r}")
