"""DeepSpeed's stage-3 tuning knobs on FSDP2: prefetch depth, persistent units, gradient division.

DeepSpeed decides these per parameter from a recorded trace; FSDP2 decides them per unit (a
transformer block, see ``wrap_policy.py``) when the model is sharded. The mapping, unit by unit:

``stage3_prefetch_bucket_size`` (elements; stage 3, only when the config sets it)
    DeepSpeed keeps fetching upcoming parameters while fewer than this many elements are in
    flight. Here: unit *i* prefetches the units that follow it in the forward (precede it in the
    backward), adding the next one while the elements already added are fewer than the bucket
    size -- anything up to one unit's size prefetches one unit (FSDP2's own default), a larger
    value several. Set with ``FSDPModule.set_modules_to_forward_prefetch`` /
    ``set_modules_to_backward_prefetch``. FSDP2 cannot switch its one-unit prefetch off (an empty
    list means "the default"), so 0 -- DeepSpeed's "no prefetch" -- also leaves one unit. Without
    the key FSDP2's one-unit prefetch stays (the DeepSpeed default, 5e7, would prefetch every block
    of a small model at once).
``stage3_max_live_parameters`` (elements; stage 3, only when the config sets it)
    DeepSpeed stops prefetching when the gathered parameters would exceed it. Here: a unit adds a
    unit to its prefetch only while its own elements plus the prefetched ones stay within it (the
    root -- embeddings, head -- is gathered throughout and not counted, as DeepSpeed's persistent
    ones), down to FSDP2's one unit.
``stage3_param_persistence_threshold`` (elements; stage 3, only when the config sets it)
    DeepSpeed never partitions a parameter with fewer elements; it stays gathered, so it costs no
    all-gather. FSDP2 gathers a unit's parameters in one collective whatever their sizes, so a
    small parameter inside a block costs nothing extra and is sharded with it; what is left of
    DeepSpeed's trade-off is a unit *all* of whose parameters are below the threshold: it is kept
    gathered from its forward to its backward (``reshard_after_forward=False``), one all-gather
    per step instead of two, for the memory of one small gathered unit.
``gradient_predivide_factor`` / ``prescale_gradients`` (stages 2 and 3)
    DeepSpeed divides each gradient by ``f`` before the reduction and multiplies the sum by
    ``f / world`` after it (``prescale_gradients``: by ``1 / world`` before, nothing after); the
    result is the mean either way, only the rounding and the range of the summed values differ.
    FSDP2's ``set_gradient_divide_factor`` sets the *total* divisor and chooses the split itself
    (a pre-multiplied sum on NCCL, a split near the square root for fp16), and the post-reduce
    hook would run before FSDP2's own post-division and is the one hf_zero's optimizer offload
    uses. So the divide factor is set to 1 (FSDP2 scales nothing) and the reduce-scatter
    (``set_custom_reduce_scatter``) runs DeepSpeed's pre-division, sum and post-scaling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from hf_zero.config.schema import ZeroConfig

__all__ = ["GradientDivision", "StageKnobs", "PrefetchPlan", "plan_prefetch", "apply_prefetch", "persistent_units",
           "apply_gradient_division"]


@dataclass(frozen=True)
class GradientDivision:
    """DeepSpeed's reduction factors: divide by ``pre`` before the sum, multiply by ``post`` after."""

    pre: float
    post: float

    @classmethod
    def from_config(cls, prescale_gradients: bool, predivide_factor: float, world_size: int) -> GradientDivision | None:
        """The factors DeepSpeed uses, or None when the config asks for its default (average
        after the sum), which FSDP2's own averaging already is."""
        if prescale_gradients:
            return cls(pre=float(world_size), post=1.0)
        if predivide_factor == 1.0:
            return None
        return cls(pre=float(predivide_factor), post=float(predivide_factor) / world_size)


@dataclass(frozen=True)
class StageKnobs:
    """The knobs a config sets for FSDP2, each None where FSDP2's own behaviour stays."""

    prefetch_bucket: int | None = None
    """``stage3_prefetch_bucket_size`` when the config sets it."""
    max_live: int | None = None
    """``stage3_max_live_parameters`` when the config sets it."""
    persistence_threshold: int | None = None
    """``stage3_param_persistence_threshold`` when the config sets it."""
    division: GradientDivision | None = None
    """``prescale_gradients`` / ``gradient_predivide_factor`` when they differ from the default."""

    @classmethod
    def from_config(cls, config: ZeroConfig, world_size: int) -> StageKnobs:
        """What ``config`` asks of FSDP2. The stage-3 knobs count only at stage 3 and only when
        written in the config (``"auto"`` included): their DeepSpeed defaults would change the
        schedule of every small model that never asked for it."""
        zero, explicit = config.zero_optimization, set(config.explicit_keys)

        def given(field: str) -> int | None:
            if zero.stage != 3 or f"zero_optimization.{field}" not in explicit:
                return None
            return int(getattr(zero, field))

        division = None
        if zero.stage in (2, 3):
            division = GradientDivision.from_config(config.prescale_gradients, config.gradient_predivide_factor,
                                                    world_size)
        return cls(prefetch_bucket=given("prefetch_bucket_size"), max_live=given("max_live_parameters"),
                   persistence_threshold=given("param_persistence_threshold"), division=division)


@dataclass(frozen=True)
class PrefetchPlan:
    """For each unit in forward order: how many following units its forward prefetches and how
    many preceding units its backward prefetches."""

    forward: tuple[int, ...]
    backward: tuple[int, ...]


def _own_numel(unit: nn.Module, units: Sequence[nn.Module]) -> list[int]:
    """Element counts of the parameters ``unit`` itself shards (not those of units inside it)."""
    inner = {id(p) for u in units if u is not unit and any(u is m for m in unit.modules())
             for p in u.parameters()}
    return [p.numel() for p in unit.parameters() if id(p) not in inner]


def _depth(sizes: Sequence[int], own: int, bucket: int | None, max_live: int | None) -> int:
    """How many of the units of ``sizes`` (in the order they run next) to prefetch: DeepSpeed's
    count, but never fewer than FSDP2's own one unit (FSDP2 cannot switch its prefetch off: an
    empty explicit list means "the default")."""
    k, in_flight = 0, 0
    for size in sizes:
        if bucket is None and k >= 1:  # no bucket given: FSDP2's one unit ahead at most
            break
        if bucket is not None and in_flight >= bucket:
            break
        if max_live is not None and own + in_flight + size > max_live:
            break
        k, in_flight = k + 1, in_flight + size
    return max(k, min(1, len(sizes)))


def plan_prefetch(units: Sequence[nn.Module], bucket: int | None, max_live: int | None) -> PrefetchPlan | None:
    """The prefetch depth of each unit (``units`` in forward order), or None when every unit keeps
    FSDP2's default (one unit ahead in both directions)."""
    sizes = [sum(_own_numel(u, units)) for u in units]
    n = len(units)
    forward = tuple(_depth(sizes[i + 1:], sizes[i], bucket, max_live) for i in range(n))
    backward = tuple(_depth(sizes[:i][::-1], sizes[i], bucket, max_live) for i in range(n))
    # FSDP2 prefetches one unit in each direction by itself (the first unit has nothing before it,
    # the last nothing after).
    default_f = tuple(min(1, n - 1 - i) for i in range(n))
    default_b = tuple(min(1, i) for i in range(n))
    if forward == default_f and backward == default_b:
        return None
    return PrefetchPlan(forward=forward, backward=backward)


def apply_prefetch(units: Sequence[nn.Module], plan: PrefetchPlan) -> None:
    """Give each FSDP2 unit its explicit forward/backward prefetch lists."""
    for i, unit in enumerate(units):
        unit.set_modules_to_forward_prefetch(list(units[i + 1:i + 1 + plan.forward[i]]))
        unit.set_modules_to_backward_prefetch(list(units[max(0, i - plan.backward[i]):i][::-1]))


def persistent_units(units: Sequence[nn.Module], threshold: int) -> list[nn.Module]:
    """The units all of whose own parameters have fewer than ``threshold`` elements."""
    out = []
    for unit in units:
        sizes = _own_numel(unit, units)
        if sizes and max(sizes) < threshold:
            out.append(unit)
    return out


class _DividedReduceScatter:
    """FSDP2's reduce-scatter with DeepSpeed's division: ``input / pre``, summed, then ``* post``.

    FSDP2 calls it with the flat gradient buffer of one unit (its own to change) and the op it
    would use; the op is ignored because FSDP2 is told to divide by 1 (:func:`apply_gradient_division`).
    """

    def __init__(self, division: GradientDivision):
        self.division = division

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: object = None, async_op: bool = False) -> None:
        if self.division.pre != 1.0:
            input_tensor.div_(self.division.pre)
        dist.reduce_scatter_tensor(output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group)
        if self.division.post != 1.0:
            output_tensor.mul_(self.division.post)


def apply_gradient_division(modules: Sequence[nn.Module], division: GradientDivision) -> None:
    """Make every FSDP2 module in ``modules`` reduce its gradients with ``division``."""
    from torch.distributed.fsdp import FSDPModule

    if not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise RuntimeError(
            f"gradient_predivide_factor / prescale_gradients need FSDP2's set_custom_reduce_scatter, which torch "
            f"{torch.__version__} lacks; remove them from the config (the gradients are averaged either way) or "
            "install a newer torch"
        )
    try:  # the base class FSDP2 documents for custom reduce-scatters
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

        comm_cls = type("DividedReduceScatter", (_DividedReduceScatter, ReduceScatter), {})
    except ImportError:
        comm_cls = _DividedReduceScatter
    comm = comm_cls(division)
    for module in modules:
        module.set_gradient_divide_factor(1.0)
        module.set_custom_reduce_scatter(comm)
