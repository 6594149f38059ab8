"""The four ZeRO stages, each on PyTorch's own distributed building blocks.

====== ============================================ ==========================================
stage  parameters / gradients / optimizer state     built on
====== ============================================ ==========================================
0      replicated / all-reduced / replicated        ``DistributedDataParallel``
1      replicated / all-reduced / sharded           DDP + ``ZeroRedundancyOptimizer``
2      gathered for fwd+bwd / reduce-scattered /    FSDP2 ``fully_shard(reshard_after_forward=False)``
       sharded
3      sharded, gathered per block / reduce-        FSDP2 ``fully_shard(reshard_after_forward=True)``
       scattered / sharded
====== ============================================ ==========================================

A stage wraps the model *in place* (FSDP2) or around it (DDP), builds the optimizer over the final
parameters, tells the engine which module to call, and answers "what are the gradients and what is
their global norm". Stages know nothing about loss scaling, accumulation counters or schedulers.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hf_zero.config.schema import ZeroOptimizationConfig
from hf_zero.distributed.env import DistEnv
from hf_zero.distributed.mesh import MeshError, MeshPlan, plan_mesh
from hf_zero.engine.fsdp_knobs import (
    StageKnobs,
    apply_gradient_division,
    apply_prefetch,
    persistent_units,
    plan_prefetch,
)
from hf_zero.engine.optimizer_recipe import OptimizerRecipe, constructor_defaults
from hf_zero.engine.wrap_policy import find_wrap_units
from hf_zero.engine.sharded_access import guard_direct_calls
from hf_zero.engine.scalar_params import lift_scalar_params
from hf_zero.precision.masters import MasterCast, cast_to_master_dtypes
from hf_zero.precision.policy import PrecisionPolicy
from hf_zero.utils.logging import get_logger

if TYPE_CHECKING:
    from hf_zero.offload.manager import OffloadManager

__all__ = ["Stage", "ReplicatedStage", "FullyShardedStage", "make_stage", "local_tensor"]

_BYTES_PER_MB = 1024 * 1024

logger = get_logger()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds (the shard of a DTensor, else ``t`` itself)."""
    return t.to_local() if isinstance(t, DTensor) else t


class Stage(Protocol):
    """What the engine needs from a sharding strategy."""

    stage: int

    def wrap(self, model: nn.Module) -> nn.Module:
        """Shard/wrap ``model``; return the module the engine calls for forward."""

    def build_optimizer(self, recipe: OptimizerRecipe, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer over the wrapped model's trainable parameters."""

    def set_gradient_sync(self, enabled: bool) -> None:
        """Whether the next backward reduces gradients across ranks."""

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Context around the forward (autocast for stages 0/1)."""

    def local_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer that owns this rank's state (for state dicts and byte counts)."""


class ReplicatedStage:
    """Stages 0 and 1: every rank holds the whole model; DDP all-reduces the gradients.

    Stage 1 additionally shards the optimizer state (and so the fp32 update) with torch's
    ``ZeroRedundancyOptimizer``: each rank steps the parameters it owns and broadcasts them.
    """

    def __init__(
        self,
        stage: int,
        zero: ZeroOptimizationConfig,
        env: DistEnv,
        precision: PrecisionPolicy,
        offload: OffloadManager | None = None,
    ):
        if stage not in (0, 1):
            raise ValueError(f"ReplicatedStage handles stages 0 and 1, not {stage}")
        self.stage = stage
        self.zero = zero
        self.env = env
        self.precision = precision
        self.offload = offload
        self.ddp: nn.parallel.DistributedDataParallel | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from hf_zero.engine.materialize import has_meta_params

        if has_meta_params(model):
            raise ValueError(
                f"the model was loaded on the meta device (hf_zero's low-memory loading, used for ZeRO-3), "
                f"but stage {self.stage} keeps a full copy on every rank; load it normally "
                "(HF_ZERO_LOW_MEMORY_LOADING=0) or use stage 3"
            )

        model.to(self.env.device)
        if self.offload is None:
            # fp32 masters for a 16-bit checkpoint; the forward runs under autocast. (With an
            # offloaded optimizer the masters live on the host and the device keeps 16 bit.)
            _log_cast(cast_to_master_dtypes(model, self.precision.compute_dtype, frozen_in_compute_dtype=False),
                      self.env)
        # DDP broadcasts rank 0's parameters and buffers at construction: one starting point.
        # DeepSpeed sizes buckets in elements; DDP in MB of fp32 gradients.
        bucket_mb = max(1, int(int(self.zero.reduce_bucket_size) * 4 / _BYTES_PER_MB))
        self.ddp = nn.parallel.DistributedDataParallel(
            model,
            device_ids=[self.env.device.index] if self.env.device.type == "cuda" else None,
            bucket_cap_mb=min(bucket_mb, 1024),
            # Gradients live in the all-reduce buckets instead of beside them: one fp32 copy of
            # the gradients per rank, not two.
            gradient_as_bucket_view=True,
        )
        if self.offload is not None:
            # Offload: the optimizer's comm hook reduces (with the same compression) and copies
            # each bucket to the host; DDP takes a single comm hook.
            self.offload.prepare_ddp(self.ddp)
            return self.ddp
        if self.precision.reduce_dtype == torch.bfloat16:
            self.ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif self.precision.reduce_dtype == torch.float16:
            self.ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return self.ddp

    def build_optimizer(self, recipe: OptimizerRecipe, model: nn.Module) -> torch.optim.Optimizer:
        if self.offload is not None:
            return self.offload.build_optimizer(recipe, model)
        groups = recipe.param_groups(model)
        if self.stage == 0:
            return recipe.build(groups)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # Build once (no state is allocated before the first step) to learn the class and defaults
        # that ZeroRedundancyOptimizer needs to construct each rank's local optimizer.
        probe = recipe.build(groups)
        opt_cls = type(probe)
        defaults = constructor_defaults(probe)
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])}
            for g in probe.param_groups
            if g["params"]
        ]
        del probe
        return ZeroRedundancyOptimizer(groups, optimizer_class=opt_cls, **defaults)

    def set_gradient_sync(self, enabled: bool) -> None:
        # What DDP.no_sync() sets; a flag lets the engine decide per micro-step without a context.
        assert self.ddp is not None
        self.ddp.require_backward_grad_sync = enabled

    def forward_context(self) -> contextlib.AbstractContextManager:
        return self.precision.autocast(self.env.device)

    def local_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return getattr(optimizer, "optim", optimizer)


_LAYOUT_ATTR = "_hf_zero_layout"
"""Set on a model hf_zero sharded: the layout, so a later engine can re-use the shards."""


class FullyShardedStage:
    """Stages 2 and 3 with FSDP2: one ``fully_shard`` unit per transformer block, then the root.

    Stage 3 frees each block's gathered parameters after its forward (gathering them again for
    backward); stage 2 keeps them gathered from forward to backward, trading memory for one
    all-gather per step. Both keep fp32 parameter shards (the master copy), reduce-scatter
    gradients into fp32 shards and shard the optimizer state with them (frozen parameters are
    stored in the compute dtype: ``precision/masters.py``).
    """

    def __init__(
        self,
        stage: int,
        zero: ZeroOptimizationConfig,
        env: DistEnv,
        precision: PrecisionPolicy,
        offload: OffloadManager | None = None,
        knobs: StageKnobs | None = None,
    ):
        if stage not in (2, 3):
            raise ValueError(f"FullyShardedStage handles stages 2 and 3, not {stage}")
        self.stage = stage
        self.zero = zero
        self.env = env
        self.precision = precision
        self.offload = offload
        self.knobs = knobs or StageKnobs()
        """DeepSpeed's prefetch/persistence/division knobs as FSDP2 settings (``fsdp_knobs.py``)."""
        self.units: list[nn.Module] = []
        self.root: nn.Module | None = None
        self.fsdp_extra: dict[str, Any] = {}
        """More ``fully_shard`` arguments (a frozen model's ``offload_policy``: ``engine/frozen.py``)."""

    def _layout(self) -> dict[str, Any]:
        """What a sharded model's layout depends on; a second engine may only re-use an equal one."""
        plan = self.mesh_plan()
        return {
            "stage": self.stage,
            "world_size": self.env.world_size,
            "shard_group": plan.shard,
            "hpz": plan.reshard_after_forward if not isinstance(plan.reshard_after_forward, bool) else 1,
            "dtype": str(self.precision.compute_dtype).removeprefix("torch."),
            "offload": self.offload is not None,
        }

    def mesh_plan(self) -> MeshPlan:
        """The mesh shape and reshard choice from ``mics_shard_size`` / ``zero_hpz_partition_size``
        (``distributed/mesh.py``); ranks per node from the launcher's ``LOCAL_WORLD_SIZE``."""
        ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", self.env.world_size))
        return plan_mesh(self.stage, self.env.world_size, max(1, ranks_per_node),
                         self.zero.mics_shard_size, self.zero.hpz_partition_size)

    def _reuse(self, model: nn.Module) -> nn.Module:
        """A model an earlier engine sharded (a second Trainer on the same model, a notebook's
        next run): its shards are the trained weights, so they are kept as they are, as DeepSpeed
        keeps already-partitioned parameters."""
        from torch.distributed.fsdp import FSDPModule

        earlier = getattr(model, _LAYOUT_ATTR, None)
        if earlier is None:
            raise ValueError(
                f"{type(model).__name__} is already sharded with fully_shard, not by hf_zero; pass the "
                "unsharded model and hf_zero shards it"
            )
        now = self._layout()
        if earlier["offload"] or now["offload"]:
            raise ValueError(
                "this model was sharded by an earlier hf_zero engine and its optimizer or parameters are "
                "offloaded, whose master weights that engine holds; keep training with the same trainer, or "
                "save it (trainer.save_model(DIR)) and build the new trainer on from_pretrained(DIR)"
            )
        if earlier != now:
            diff = ", ".join(f"{k} {earlier[k]} then, {now[k]} now" for k in now if earlier[k] != now[k])
            raise ValueError(
                f"this model was sharded by an earlier hf_zero engine with another layout ({diff}); use the "
                "same zero config, or save it (trainer.save_model(DIR)) and load it anew with from_pretrained"
            )
        self.units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
        self.root = model
        # An evaluation forward leaves stage-2 parameters gathered, and while they are, the
        # module holds the gathered copies: an optimizer built now would step those, and its
        # updates would be dropped at the next reshard. Back to the shards first.
        for unit in [*self.units, model]:
            unit.reshard()
        return model

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        from hf_zero.distributed.mesh import build_mesh
        from hf_zero.engine.materialize import sharded_from_rank0

        if isinstance(model, FSDPModule):
            return self._reuse(model)
        plan = self.mesh_plan()
        mesh = build_mesh(self.env.device.type, plan)
        if self.env.is_main and (plan.hierarchical or plan.hpz_same_as_shard
                                 or plan.reshard_after_forward not in (True, False)):
            logger.info("hf_zero: %s", plan.describe())
        kwargs = dict(
            mesh=mesh,
            reshard_after_forward=plan.reshard_after_forward,
            mp_policy=self.precision.fsdp_mp_policy(),
        )
        lifted = lift_scalar_params(model)  # FSDP2 cannot shard 0-dim parameters
        if lifted and self.env.is_main:
            logger.info("hf_zero: 0-dim parameters stored as 1-element shards (saved as scalars): %s", ", ".join(lifted))
        # Every rank's shards come from rank 0: ranks that loaded on the meta device (low-memory
        # loading) and ranks that built other weights (per-process seeds) start where rank 0 does.
        # With several ranks, every rank's parameters go to the meta device on entry (rank 0 keeps
        # its full tensors, as loaded, for the fill), so the fp32 master cast below allocates
        # nothing: each shard is cast as rank 0 scatters it, and no rank ever holds a full fp32
        # copy of the model (a 70B bf16 model would need 280 GB of host RAM on rank 0 for it).
        # An offloaded optimizer's parameters are 16-bit on the accelerator; their fp32 masters
        # come from the fill (OffloadManager.wants/take), never through an fp32 device shard.
        capture = self.offload if self.offload is not None and self.offload.opt_cfg.device != "none" else None
        with sharded_from_rank0(model, mesh, sync_all=True, release_parameters=True, master_capture=capture):
            _log_cast(cast_to_master_dtypes(model, self.precision.compute_dtype, frozen_in_compute_dtype=True),
                      self.env)
            self.units = find_wrap_units(model)
            if self.offload is not None:
                kwargs.update(self.offload.prepare_fsdp(model, self.units, mesh=mesh))
            kwargs.update(self.fsdp_extra)
            # stage3_param_persistence_threshold: units whose parameters are all small stay gathered
            # from forward to backward (fsdp_knobs.py says why per unit, not per parameter).
            threshold = self.knobs.persistence_threshold
            persistent = {id(u) for u in persistent_units(self.units, threshold)} if threshold is not None else set()
            for unit in self.units:
                fully_shard(unit, **{**kwargs, "reshard_after_forward": False} if id(unit) in persistent else kwargs)
            fully_shard(model, **kwargs)
        self.root = model
        self._apply_knobs(model, persistent)
        if self.offload is not None:
            self.offload.after_fsdp(model, self.units)
        guard_direct_calls(model, self.stage)  # a submodule called outside forward: say what to do
        setattr(model, _LAYOUT_ATTR, self._layout())
        return model

    def _apply_knobs(self, model: nn.Module, persistent: set[int]) -> None:
        """Prefetch depth per unit and DeepSpeed's gradient division, on the sharded modules."""
        knobs = self.knobs
        position = {id(m): i for i, m in enumerate(model.modules())}
        in_forward_order = sorted(self.units, key=lambda u: position[id(u)])
        plan = None
        if knobs.prefetch_bucket is not None or knobs.max_live is not None:
            plan = plan_prefetch(in_forward_order, knobs.prefetch_bucket, knobs.max_live)
            if plan is not None:
                apply_prefetch(in_forward_order, plan)
        if knobs.division is not None:
            apply_gradient_division([*self.units, model], knobs.division)
        if self.env.is_main and (plan is not None or persistent or knobs.division is not None):
            parts = []
            if plan is not None:
                parts.append(f"prefetch depth per block forward {list(plan.forward)}, backward {list(plan.backward)}")
            if persistent:
                parts.append(f"{len(persistent)} of {len(self.units)} blocks kept gathered from forward to backward "
                             "(all their parameters below stage3_param_persistence_threshold)")
            if knobs.division is not None:
                parts.append(f"gradients divided by {knobs.division.pre:g} before the reduction, "
                             f"multiplied by {knobs.division.post:g} after")
            logger.info("hf_zero: %s", "; ".join(parts))

    def build_optimizer(self, recipe: OptimizerRecipe, model: nn.Module) -> torch.optim.Optimizer:
        if self.offload is not None:
            return self.offload.build_optimizer(recipe, model)
        optimizer = recipe.build(recipe.param_groups(model))
        if self.mesh_plan().hierarchical and type(optimizer).__module__.startswith("hf_zero."):
            # hf_zero's own optimizers (Muon, Lamb, ...) compute norms over the shards of a 1-D mesh.
            raise MeshError(
                f"zero_optimization.mics_shard_size with the {type(optimizer).__name__} optimizer is not supported "
                "yet (it takes whole-parameter norms over a flat shard group); use AdamW/Adam/SGD, or remove "
                "mics_shard_size"
            )
        return optimizer

    @property
    def defers_replica_all_reduce(self) -> bool:
        """MiCS: whether the all-reduce across the replicas waits for the accumulation boundary.

        As DeepSpeed's MiCS does: each micro-step reduce-scatters inside the shard group and FSDP2
        sums the reduced shards (in the fp32 reduce dtype), and only the boundary's micro-step
        all-reduces them across the replicas, so the traffic that crosses nodes is divided by the
        accumulation steps. Not with a 16-bit ``communication_data_type`` (the sum would be kept in
        16 bit) nor with an offloaded optimizer (it takes every micro-step's gradients to the host,
        so the device does not hold them).
        """
        return (self.mesh_plan().hierarchical and self.offload is None
                and self.precision.reduce_dtype == torch.float32)

    def set_gradient_sync(self, enabled: bool) -> None:
        # ZeRO-2/3 reduce-scatter every micro-step so that gradients stay sharded (DeepSpeed does
        # the same); accumulation then happens in the fp32 gradient shards. MiCS's all-reduce
        # across the replicas runs at the boundary only (defers_replica_all_reduce).
        if self.root is not None and self.defers_replica_all_reduce:
            self.root.set_requires_all_reduce(enabled, recurse=True)

    def check_gradients_complete(self) -> None:
        """Before clipping or stepping: no unit may still hold micro-steps' gradients that were
        never all-reduced across the MiCS replicas (the boundary's backward does that; a boundary
        micro-step run outside the engine's forward would leave the replicas apart)."""
        if self.root is None or not self.defers_replica_all_reduce:
            return
        from hf_zero.distributed.fsdp_internals import param_groups

        for module in self.root.modules():
            for group in param_groups(module):
                if getattr(group, "_partial_reduce_output", None) is not None:
                    raise RuntimeError(
                        "zero_optimization.mics_shard_size: gradients of this accumulation window were not "
                        "all-reduced across the replicas (the last micro-step ran outside the engine's forward or "
                        "forward_context, which tell FSDP2 where the window ends); run every micro-step through "
                        "engine(...) or `with engine.forward_context():`"
                    )

    def forward_context(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def local_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer


def _log_cast(cast: MasterCast, env: DistEnv) -> None:
    line = cast.describe()
    if line and env.is_main:
        logger.info("%s", line)


def make_stage(
    zero: ZeroOptimizationConfig,
    env: DistEnv,
    precision: PrecisionPolicy,
    offload: OffloadManager | None = None,
    knobs: StageKnobs | None = None,
) -> Stage:
    """The :class:`Stage` for ``zero.stage``; ``offload`` plugs in the offload backends, ``knobs``
    the FSDP2 settings of DeepSpeed's tuning keys (stages 2/3; :meth:`StageKnobs.from_config`)."""
    if zero.stage in (0, 1):
        return ReplicatedStage(zero.stage, zero, env, precision, offload)
    if zero.stage in (2, 3):
        return FullyShardedStage(zero.stage, zero, env, precision, offload, knobs)
    raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {zero.stage!r}")
