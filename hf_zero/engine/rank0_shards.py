"""Low-memory loading, step 2: every rank's FSDP2 shards filled from rank 0's full weights.

:func:`sharded_from_rank0` wraps the sharding: before ``fully_shard``, rank 0 keeps references to
its full parameters (no copy); after it, the ranks holding meta tensors allocate their shards
(``to_empty``) and every rank receives its shard of each parameter from rank 0, one tensor at a
time (a scatter, so no rank but rank 0 ever holds a full tensor); buffers are broadcast whole.
The engine does this also when every rank holds real weights, so that ranks that built different
weights still start from rank 0's, as with DDP. Step 1 (building on the meta device) is
:mod:`hf_zero.engine.meta_loading`; :mod:`hf_zero.engine.materialize` tells the whole story.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hf_zero.distributed import device as accel

__all__ = ["capture_full_state", "fill_sharded_from_rank0", "has_meta_params", "sharded_from_rank0"]

_SOURCE = 0  # rank of the mesh's process group that holds the real weights


# --------------------------------------------------------------------------------------- sharding
def has_meta_params(model: nn.Module) -> bool:
    """True when some parameter of ``model`` is on the meta device (a DTensor's shard included)."""
    return any(_is_meta(p) for p in model.parameters())


def _is_meta(t: torch.Tensor) -> bool:
    return t.is_meta or (hasattr(t, "_local_tensor") and t._local_tensor.is_meta)


def _has_meta_tensors(model: nn.Module) -> bool:
    return has_meta_params(model) or any(_is_meta(b) for b in model.buffers())


def _group_and_device(mesh) -> tuple[Any, torch.device]:
    """The process group (None: the default one) and the device collectives run on."""
    if mesh is None:
        if dist.get_backend() == "nccl":
            return None, accel.current_device()
        return None, torch.device("cpu")
    if mesh.ndim > 2:
        raise ValueError(f"hf_zero fills shards on a 1-D or 2-D mesh, got a {mesh.ndim}-D one")
    if mesh.device_type == "cpu":
        device = torch.device("cpu")
    else:
        module = getattr(torch, mesh.device_type)
        device = torch.device(mesh.device_type, module.current_device())
    if mesh.mesh.flatten().tolist() == list(range(dist.get_world_size())):
        # The same ranks in the same order: use the default group. (A gloo group that
        # init_device_mesh created and that ran collectives often aborts the process at exit,
        # "terminate called without an active exception", even after destroy_process_group().)
        return None, device
    return mesh.get_group(), device


def _group_rank(group) -> int:
    return dist.get_rank(group)


def _group_size(group) -> int:
    return dist.get_world_size(group)


def _flags(model: nn.Module, group, device: torch.device) -> tuple[bool, bool]:
    """(some rank has meta tensors, the source rank has meta tensors), agreed by all ranks."""
    mine = _has_meta_tensors(model)
    flags = torch.tensor([int(mine), int(mine and _group_rank(group) == _SOURCE)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return bool(flags[0]), bool(flags[1])


def capture_full_state(model: nn.Module, mesh=None, *, sync_all: bool = True) -> dict[str, torch.Tensor] | None:
    """Collective; call before ``fully_shard``. On the source rank (rank 0 of the mesh) returns
    ``{name: tensor}`` aliasing its full parameters (no copy), ``{}`` on the other ranks; None in a
    single process, and None when ``sync_all`` is False and no rank has meta tensors (then
    :func:`fill_sharded_from_rank0` does nothing).

    Args:
        sync_all: True (the engine's choice): every rank's shards come from rank 0 even when all
            ranks hold real weights, so ranks that built different weights (a LoRA made before
            the Trainer seeds, per-process random seeds) start from one point, as DDP and
            DeepSpeed do. False: fill only ranks that hold meta tensors.

    Raises:
        RuntimeError: the source rank itself has meta tensors (nothing to fill the others from).
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        if _has_meta_tensors(model):
            raise RuntimeError(
                "the model has parameters on the meta device and there is no other rank to load them from"
            )
        return None
    group, device = _group_and_device(mesh)
    any_meta, source_meta = _flags(model, group, device)
    if source_meta:
        raise RuntimeError(
            "rank 0 holds parameters on the meta device, so there are no weights to shard from: load the "
            "model with from_pretrained (inside hf_zero.engine.materialize.low_memory_loading() at most), "
            "not on the meta device"
        )
    if not any_meta and not sync_all:
        return None
    if _group_rank(group) != _SOURCE:
        return {}
    return {name: p.detach() for name, p in model.named_parameters()}


def _release_parameters(model: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Replace every parameter by a meta tensor of its shape and dtype, keeping ties and the
    parameter's attributes; returns ``(module, name, original)`` for :func:`_restore_parameters`.
    New Parameter objects are fine here: ``fully_shard`` replaces them with DTensor parameters
    right after anyway. Subclasses (quantized weights) are left alone; :func:`_allocate_meta` and
    the fill treat a partly meta model as before."""
    originals: list[tuple[nn.Module, str, nn.Parameter]] = []
    replacement: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is None or type(param) is not nn.Parameter or param.is_meta:
                continue
            new = replacement.get(id(param))
            if new is None:
                new = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
                new.__dict__.update(param.__dict__)
                replacement[id(param)] = new
            originals.append((module, key, param))
            module._parameters[key] = new
    return originals


def _restore_parameters(originals: list[tuple[nn.Module, str, nn.Parameter]]) -> None:
    for module, key, param in originals:
        module._parameters[key] = param


def fill_sharded_from_rank0(
    model: nn.Module,
    full_state: dict[str, torch.Tensor] | None,
    mesh=None,
    *,
    param_device: torch.device | str | None = None,
    method: str = "scatter",
    master_capture: Any = None,
) -> None:
    """Collective; call after ``fully_shard`` with what :func:`capture_full_state` returned. Ranks
    with meta tensors allocate them; every rank then receives its shard of each parameter from
    the source rank, one parameter at a time, and every buffer whole. The source's entries are
    dropped from ``full_state`` as they are sent, so its full copy is freed progressively.

    Args:
        param_device: where to allocate the shards of meta parameters; by default the mesh's
            device, or the CPU for FSDP units with ``CPUOffloadPolicy``.
        method: ``"scatter"`` (each rank receives only its shard) or ``"broadcast"`` (each rank
            receives the full tensor and keeps its slice; more traffic and memory, any placement).
        master_capture: an object with ``wants(name) -> bool`` and ``take(name, shard)``: the
            parameters it wants travel in fp32, and ``take`` gets this rank's fp32 shard (a
            temporary on the device) before the shard is cast into the parameter. An offloaded
            optimizer's 16-bit parameters get their fp32 master weights this way, so no fp32
            copy of them is ever allocated on the accelerator.
    """
    if full_state is None:
        return
    if method not in ("scatter", "broadcast"):
        raise ValueError(f"method must be 'scatter' or 'broadcast', got {method!r}")
    group, device = _group_and_device(mesh)
    rank = _group_rank(group)
    is_source = rank == _SOURCE
    params = list(model.named_parameters())
    buffers = list(model.named_buffers())
    _check_same_structure(params, buffers, group, device)
    if is_source:
        missing = [name for name, _ in params if name not in full_state]
        if missing:
            raise RuntimeError(f"no captured full tensor for parameters {missing[:5]} (captured before fully_shard?)")
    _allocate_meta(model, device, param_device)
    params = list(model.named_parameters())  # to_empty may swap tensors
    buffers = list(model.named_buffers())
    with torch.no_grad():
        for name, param in params:
            full = full_state.pop(name) if is_source else None
            on_shard = None
            if master_capture is not None and master_capture.wants(name):
                on_shard = lambda shard, _name=name: master_capture.take(_name, shard)  # noqa: E731
            _fill_param(param, full, group, device, method, on_shard)
            del full
        for _, buf in buffers:
            _broadcast_into(buf, group, device)
    full_state.clear()


@contextlib.contextmanager
def sharded_from_rank0(
    model: nn.Module, mesh=None, *, sync_all: bool = True, release_parameters: bool = False, **fill_kwargs: Any
) -> Iterator[None]:
    """Wrap the ``fully_shard`` calls: captures rank 0's full parameters on entry and fills every
    rank's shards on exit (see the module docstring). With ``sync_all=False``, a no-op beyond one
    tiny all-reduce when no rank holds meta tensors. With ``release_parameters``, every rank's
    parameters are meta tensors inside the block, so a dtype change there allocates nothing; if
    the block raises, rank 0's parameters are put back.

    Example (what ``FullyShardedStage.wrap`` does)::

        with sharded_from_rank0(model, mesh):
            for block in blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
    """
    full_state = capture_full_state(model, mesh, sync_all=sync_all)
    # release_parameters: every rank's parameters go to the meta device (rank 0's weights live on
    # in full_state, which the fill empties tensor by tensor), so that a dtype change made inside
    # the block (the fp32 master cast) allocates nothing. Rank 0 keeps its originals until the
    # block has run (they alias full_state: no extra memory), to give the model back if it fails;
    # on the other ranks they would be replaced by rank 0's weights anyway, and are dropped.
    keep: list[tuple[nn.Module, str, nn.Parameter]] = []
    if release_parameters and full_state is not None:
        originals = _release_parameters(model)
        keep = originals if full_state else []
        del originals
    try:
        yield
    except BaseException:
        _restore_parameters(keep)  # rank 0's model as it was (the other ranks' are on the meta device)
        if full_state is not None:
            full_state.clear()
        raise
    keep.clear()  # the fill frees rank 0's tensors one by one: nothing else may hold them
    fill_sharded_from_rank0(model, full_state, mesh, **fill_kwargs)


def _check_same_structure(params, buffers, group, device) -> None:
    """Every rank must list the same parameters and buffers in the same order (the fill sends
    one collective per tensor); a mismatch is an error rather than a hang or wrong weights."""
    desc = "|".join(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in [*params, *buffers])
    digest = zlib.crc32(desc.encode())
    t = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if int(t[0]) != digest or int(t[1]) != -digest:
        raise RuntimeError(
            "ranks hold differently structured models (parameter/buffer names, shapes or dtypes differ), so "
            "rank 0's weights cannot be sharded onto them: build the model the same way on every rank"
        )


def _offloaded_params(model: nn.Module) -> set[int]:
    """ids of parameters in FSDP units with a CPU offload policy (their shards live on the CPU)."""
    from hf_zero.distributed.fsdp_internals import param_groups

    ids: set[int] = set()
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    except ImportError:  # pragma: no cover
        return ids
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        try:
            groups = param_groups(module)
        except Exception:  # noqa: BLE001 - torch-private; without it the caller passes param_device
            continue
        for group in groups:
            if isinstance(group.offload_policy, CPUOffloadPolicy):
                ids.update(id(fp.sharded_param) for fp in group.fsdp_params)
    return ids


def _allocate_meta(model: nn.Module, device: torch.device, param_device) -> None:
    """Give meta parameters and buffers storage (uninitialised; filled next). Buffers that hold
    data keep it: on the source rank they are what the fill broadcasts."""
    if not _has_meta_tensors(model):
        return
    kept = [(m, k, b) for m in model.modules() for k, b in m._buffers.items() if b is not None and not b.is_meta]
    _allocate(model, device, param_device)  # to_empty: every tensor gets new, uninitialised storage
    for module, key, buf in kept:
        module._buffers[key] = buf.to(module._buffers[key].device)


def _allocate(model: nn.Module, device: torch.device, param_device) -> None:
    offloaded = _offloaded_params(model)
    target = torch.device(param_device) if param_device is not None else device
    if offloaded and param_device is None:
        # CPU-offloaded FSDP units keep their shards on the CPU, their buffers on the device.
        model.to_empty(device="cpu")
        for module in model.modules():
            for key, buf in list(module._buffers.items()):
                if buf is not None and buf.device != device:
                    module._buffers[key] = buf.to(device)
        for name, p in model.named_parameters():
            if id(p) not in offloaded and p.device != device:
                raise RuntimeError(f"{name}: mixed CPU-offloaded and on-device FSDP units; pass param_device")
        return
    model.to_empty(device=target)
    for module in model.modules():
        for key, buf in list(module._buffers.items()):
            if buf is not None and buf.device != device:
                module._buffers[key] = buf.to(device)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


def _fill_param(param: torch.Tensor, full: torch.Tensor | None, group, device, method: str,
                on_shard: Any = None) -> None:
    """This rank's shard of ``param`` from the source's ``full`` tensor. With ``on_shard``, the
    values travel in fp32 and ``on_shard(fp32 shard)`` sees them before they are cast into the
    parameter (the fp32 master weights of a 16-bit parameter)."""
    placements = getattr(param, "placements", None)
    local = _local(param)
    wire = torch.float32 if on_shard is not None else local.dtype
    if placements is None or all(p.is_replicate() for p in placements):
        _broadcast_into(local, group, device, src_tensor=full, wire_dtype=wire, on_value=on_shard)
        return
    if len(placements) > 1:
        # A 2-D (replicate, shard) mesh (mics_shard_size): every rank takes its slice of the whole
        # tensor; the scatter below serves one shard group only.
        _broadcast_and_slice(param, local, full, group, device, wire, on_shard)
        return
    if not placements[0].is_shard():
        raise NotImplementedError(f"filling a DTensor with placements {placements} from rank 0")
    dim = placements[0].dim
    if method == "broadcast":
        _broadcast_and_slice(param, local, full, group, device, wire, on_shard)
        return
    world = _group_size(group)
    shape = list(param.shape)
    shape[dim] = -(-shape[dim] // world)  # every rank's chunk, padded to the first one's size
    direct = (list(local.shape) == shape and local.is_contiguous() and local.device == device
              and wire == local.dtype and on_shard is None)
    out = local if direct else torch.empty(shape, dtype=wire, device=device)
    chunks = None
    if full is not None:
        src = full.to(device=device, dtype=wire)
        pieces = torch.chunk(src, world, dim=dim) if src.shape[dim] else ()
        chunks = []
        for r in range(world):
            piece = pieces[r] if r < len(pieces) else None
            if piece is not None and list(piece.shape) == shape and piece.is_contiguous():
                chunks.append(piece)  # a view of the full tensor: no copy
                continue
            padded = torch.zeros(shape, dtype=wire, device=device)
            if piece is not None:
                padded.narrow(dim, 0, piece.shape[dim]).copy_(piece)
            chunks.append(padded)
        del src, pieces
    dist.scatter(out, chunks, group=group, group_src=_SOURCE)
    del chunks
    if not direct:
        shard = out.narrow(dim, 0, local.shape[dim])
        if on_shard is not None:
            on_shard(shard)
        local.copy_(shard)


def _broadcast_and_slice(param, local, full, group, device, wire: torch.dtype | None = None, on_shard: Any = None) -> None:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    wire = wire or local.dtype
    buf = full.to(device=device, dtype=wire) if full is not None else torch.empty(
        param.shape, dtype=wire, device=device
    )
    dist.broadcast(buf, group=group, group_src=_SOURCE)
    local_shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    index = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
    if on_shard is not None:
        on_shard(buf[index])
    local.copy_(buf[index])


def _broadcast_into(target: torch.Tensor, group, device, src_tensor: torch.Tensor | None = None,
                    wire_dtype: torch.dtype | None = None, on_value: Any = None) -> None:
    """Broadcast the source rank's tensor (``src_tensor`` there, else ``target`` itself) into
    ``target`` on every rank (in ``wire_dtype``, shown to ``on_value`` first, when given)."""
    is_source = _group_rank(group) == _SOURCE
    source = src_tensor if (is_source and src_tensor is not None) else target
    wire = wire_dtype or target.dtype
    if target.device == device and target.is_contiguous() and (source is target) and wire == target.dtype and on_value is None:
        dist.broadcast(target, group=group, group_src=_SOURCE)
        return
    buf = source.to(device=device, dtype=wire).contiguous() if is_source else torch.empty(
        target.shape, dtype=wire, device=device
    )
    dist.broadcast(buf, group=group, group_src=_SOURCE)
    if on_value is not None:
        on_value(buf)
    target.copy_(buf)
