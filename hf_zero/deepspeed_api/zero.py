"""``deepspeed.zero`` for hf_zero: ``GatheredParameters``, ``Init``, ``ZeroParamStatus`` and the
``ds_*`` attributes scripts read on the parameters of a sharded model.

At stages 2 and 3 hf_zero's parameters are FSDP2 ``DTensor`` shards between steps. DeepSpeed's
scripts gather them with ``zero.GatheredParameters`` and read ``param.data`` inside the block
(Qwen's ``maybe_zero_3``), or edit them there with ``modifier_rank`` (transformers' embedding
resize). So that the *same parameter object* the script holds shows the full tensor inside the
block, :class:`GatheredParameters` swaps the object's contents with a full copy
(``torch.utils.swap_tensors``, which keeps the object's identity, attributes and its place in the
module and the optimizer) and swaps them back on exit, writing the edits of ``modifier_rank``
into every rank's shard first.
"""

from __future__ import annotations

import contextlib
import copyreg
import itertools
import weakref
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hf_zero.utils.logging import get_logger

__all__ = [
    "ZeroParamStatus",
    "ZeroParamType",
    "ZeroStageEnum",
    "GatheredParameters",
    "Init",
    "register_external_parameter",
    "set_z3_leaf_modules",
    "tag_zero_params",
    "is_zero_param",
]

logger = get_logger()


class ZeroParamStatus(Enum):
    """DeepSpeed's parameter states (same names and values)."""

    AVAILABLE = 1  # whole on every rank (inside GatheredParameters)
    NOT_AVAILABLE = 2  # sharded (between steps at stages 2 and 3)
    INFLIGHT = 3  # being gathered (never seen by scripts under hf_zero)


class ZeroParamType(Enum):
    """DeepSpeed's parameter kinds (same names and values)."""

    NORMAL = 1
    PARTITIONED = 2
    REMOTE = 3


class ZeroStageEnum(int, Enum):
    """DeepSpeed's ``deepspeed.runtime.zero.config.ZeroStageEnum`` (same names and values)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


# ------------------------------------------------------------------------------------------ ds_* tags
_ids = itertools.count()
_engines: weakref.WeakSet = weakref.WeakSet()  # engines that tagged their model: for resident params


def is_zero_param(param: Any) -> bool:
    """DeepSpeed's test: the parameter carries a ``ds_id``."""
    return hasattr(param, "ds_id")


def tag_zero_params(trainer: Any) -> None:
    """Give every sharded parameter of the trainer's model DeepSpeed's attributes: ``ds_id``,
    ``ds_status`` (``NOT_AVAILABLE``), ``ds_numel`` and ``ds_shape`` (the full size), so that a
    script's ``hasattr(param, "ds_id")`` sends it through ``GatheredParameters``.

    Registered as a ZeroTrainer engine listener by :func:`hf_zero.enable_deepspeed_compat`. Tags
    go on the DTensor parameters (stages 2 and 3; hf_zero's stage 2 also shards parameters between
    steps, unlike DeepSpeed's), never on the whole parameters of stages 0 and 1.
    """
    engine = trainer.zero_engine
    if engine is None:
        return
    _engines.add(engine)
    for param in engine.module.parameters():
        if isinstance(param, DTensor) and not hasattr(param, "ds_id"):
            param.ds_id = next(_ids)
            param.ds_status = ZeroParamStatus.NOT_AVAILABLE
            param.ds_numel = param.numel()  # a DTensor's numel and shape are the full tensor's
            param.ds_shape = param.shape


# ------------------------------------------------------------------------------------------ gathering
class _GatheredParameter(torch.Tensor):
    """What a DTensor parameter is inside :class:`GatheredParameters`: a plain tensor whose
    operations return plain tensors (as ``nn.Parameter``'s do). ``swap_tensors`` needs both sides
    to declare the same slots, hence DTensor's."""

    __slots__ = tuple(copyreg._slotnames(DTensor))
    __torch_function__ = torch._C._disabled_torch_function_impl


def _as_list(params: Any) -> list[torch.Tensor]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    return list(params)


def _full_copy(param: DTensor) -> torch.Tensor:
    """The whole tensor of ``param`` on the device of its local shard (a collective)."""
    from hf_zero.distributed.collectives import on_mesh_device

    with torch.no_grad():
        local = param.to_local()
        full = on_mesh_device(param.detach()).full_tensor().to(local.device)
        if full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
            # One rank (or one shard holding everything): the "gathered" tensor is the shard itself,
            # and read-only blocks must not change the shard.
            full = full.clone()
        return full


def _broadcast_from(full: torch.Tensor, shard: DTensor, src: int) -> torch.Tensor:
    """``src``'s ``full`` on every rank of ``shard``'s mesh (``src`` is a global rank, as in DeepSpeed)."""
    mesh = shard.device_mesh
    buf = full.detach().to(mesh.device_type).contiguous()
    # A 2-D (replicate, shard) mesh spans the world: broadcast over it (``src`` is a global rank).
    dist.broadcast(buf, src=src, group=mesh.get_group() if mesh.ndim == 1 else None)
    return buf


def _write_shard(param: DTensor, full: torch.Tensor) -> None:
    """Copy this rank's slice of ``full`` into ``param``'s local shard (its storage is FSDP's)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    with torch.no_grad():
        local = param.to_local()
        local.copy_(full[index].to(device=local.device, dtype=local.dtype))


def _owning_engines(params: list[torch.Tensor]) -> list[Any]:
    ids = {id(p) for p in params}
    return [e for e in list(_engines) if any(id(p) in ids for p in e.module.parameters())]


class GatheredParameters:
    """DeepSpeed's ``deepspeed.zero.GatheredParameters`` on hf_zero's shards.

    Inside the block each given sharded parameter is the whole tensor (the same Python object:
    ``param.data``, ``param.shape``, in-place edits all see the full tensor; ``ds_status`` is
    ``AVAILABLE``). Parameters that are not sharded (stages 0/1, a model the Trainer has not
    sharded yet, a meta model of low-memory loading) are left as they are, as DeepSpeed ignores
    parameters without ``ds_id``. Every rank must enter the block with the same parameters, in
    the same order (gathering is a collective).

    Args:
        params: a parameter, or an iterable of them (``None`` entries are skipped).
        modifier_rank: the global rank whose edits made inside the block are kept: on exit its
            tensors are broadcast and every rank's shard takes its slice. ``None``: edits are
            dropped (read-only use).
        fwd_module: accepted for DeepSpeed's signature; unused (FSDP2 gathers for forwards itself).
        enabled: ``False`` makes the block do nothing.

    Raises:
        RuntimeError: ``modifier_rank`` on a model whose optimizer is offloaded (the host's fp32
            masters would overwrite the edit at the next step), or a parameter that cannot be
            swapped (someone holds a weak reference or an autograd graph to it).

    Example::

        with deepspeed.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
            if torch.distributed.get_rank() == 0:
                model.lm_head.weight.data[-2:] = 0.0    # every rank's shard gets the new rows
    """

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: nn.Module | None = None,
                 enabled: bool = True):
        seen: set[int] = set()
        self.params: list[DTensor] = []
        for p in _as_list(params):
            if isinstance(p, DTensor) and id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        self.modifier_rank = modifier_rank
        self.enabled = bool(enabled) and bool(self.params)
        self._swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> None:
        if not self.enabled:
            return None
        engines = _owning_engines(self.params)
        if self.modifier_rank is not None and any(e.offload is not None and e.offload.owns_optimizer for e in engines):
            raise RuntimeError(
                "GatheredParameters(modifier_rank=...) on a model whose optimizer is offloaded "
                "(offload_optimizer): the fp32 master weights on the host would overwrite the edit at the "
                "next step. Make the edit before the Trainer shards the model (before train()), or train "
                "without offload_optimizer."
            )
        self._stack = contextlib.ExitStack()
        for engine in engines:  # NVMe-swapped parameter shards are read back (and written after an edit)
            self._stack.enter_context(engine.params_resident(write_back=self.modifier_rank is not None))
        try:
            for param in self.params:
                whole = torch.Tensor._make_subclass(_GatheredParameter, _full_copy(param), param.requires_grad)
                whole.__dict__.update(param.__dict__)  # ds_* and any attribute the script set
                if "ds_status" in whole.__dict__:
                    whole.ds_status = ZeroParamStatus.AVAILABLE
                _swap(param, whole)
                self._swapped.append((param, whole))  # `whole` now holds the shard
        except BaseException:
            self._restore(write=False)
            raise
        return None

    def __exit__(self, *exc_info: Any) -> None:
        if not self.enabled:
            return None
        self._restore(write=self.modifier_rank is not None)
        return None

    def _restore(self, write: bool) -> None:
        try:
            # While swapped, `param` is the whole tensor and `holder` the DTensor shard.
            edited = [_broadcast_from(param, holder, self.modifier_rank) for param, holder in self._swapped] if write else []
            for param, holder in reversed(self._swapped):
                _swap(param, holder)  # the object is the DTensor shard again
            for (param, _), full in zip(self._swapped, edited):
                _write_shard(param, full)
        finally:
            self._swapped = []
            if self._stack is not None:
                self._stack.close()
                self._stack = None


def _swap(a: torch.Tensor, b: torch.Tensor) -> None:
    try:
        torch.utils.swap_tensors(a, b)
    except RuntimeError as exc:
        raise RuntimeError(
            f"GatheredParameters cannot show the full tensor through this parameter object ({exc}). "
            "Gather the whole model instead: `with hf_zero.gathered_parameters(model): ...` (read-only), "
            "or trainer.model_wrapped._zero3_consolidated_16bit_state_dict() for its state dict."
        ) from exc


# ------------------------------------------------------------------------------------------ Init
class Init:
    """DeepSpeed's ``deepspeed.zero.Init`` as hf_zero's low-memory loading.

    Inside the block, at ZeRO stage 2 or 3, ``from_pretrained`` builds the model on the meta device
    on every rank but each node's local rank 0, which loads it (``hf_zero.engine.materialize``);
    the engine later fills every rank's shards from rank 0. That is what ``zero.Init`` is for
    (no rank but one holds the whole model). Models built directly (``Model(config)``,
    ``from_config``) are built whole, then sharded by the engine. At stages 0/1, with
    ``enabled=False``, or with no zero config known yet, the block changes nothing.

    Args:
        module: DeepSpeed partitions an existing module given here; hf_zero shards it when the
            engine is built, so it is accepted and left alone.
        config_dict_or_path: the DeepSpeed config; its stage decides (else the config of the
            latest ``TrainingArguments`` with a zero config). ``config`` is its older name.
        enabled: ``False`` makes the block do nothing.
        **kwargs: DeepSpeed's other options (``remote_device``, ``pin_memory``, ``dtype``, ``mpu``,
            ``data_parallel_group``...), accepted and unused: the zero config governs placement.
    """

    def __init__(self, module: nn.Module | None = None, *, config_dict_or_path: Any = None, config: Any = None,
                 enabled: bool = True, **kwargs: Any):
        self.module = module
        self.config = config_dict_or_path if config_dict_or_path is not None else config
        self.enabled = enabled
        self._context: contextlib.AbstractContextManager | None = None

    def _sharded_run(self) -> bool:
        from hf_zero.integration.arguments import latest_zero_config

        config = self.config if self.config is not None else latest_zero_config()
        if config is None:
            return False
        stage = getattr(config, "stage", None)
        if stage is None:
            from hf_zero.config.parse import parse_config

            stage = parse_config(config).stage
        return int(stage) >= 2

    def __enter__(self) -> Init:
        from hf_zero.engine.materialize import low_memory_loading

        self._context = low_memory_loading() if self.enabled and self._sharded_run() else contextlib.nullcontext()
        self._context.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        context, self._context = self._context, None
        if context is not None:
            context.__exit__(*exc_info)


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's hint that ``module``'s forward uses a parameter another module owns: nothing
    to do under hf_zero. The root unit's parameters are gathered for the whole forward; one
    transformer block reading another block's parameter is not supported (DESIGN's wrap units)."""
    return None


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: list[Any]) -> list[nn.Module]:
    """DeepSpeed's way to gather an MoE block as one unit: nothing to do under hf_zero, which
    gathers whole transformer blocks. Returns the modules that match (classes or class names),
    as DeepSpeed does."""
    classes = tuple(c for c in leaf_module_classes if isinstance(c, type))
    names = {c for c in leaf_module_classes if isinstance(c, str)}
    return [m for m in model.modules() if isinstance(m, classes) or type(m).__name__ in names]
