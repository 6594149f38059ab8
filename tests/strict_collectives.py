"""Strict collectives for the CPU suite: a host-memory tensor entering a collective is an error.

On a GPU run NCCL refuses host tensors ("No backend type associated with device type cpu"): an
offloaded parameter or gradient shard, a pinned buffer, or a DTensor whose local shard lives in host
memory must be moved to the mesh's device before a collective (review finding F1). On CPU with gloo
every tensor is host memory and every collective accepts it, so this module tracks which tensors
*would* be host memory on a GPU run and fails where NCCL would:

* **Tags.** :func:`install` wraps the places where hf_zero puts tensors in host memory: FSDP2's
  ``CPUOffloadPolicy`` shards (``CpuParamOffload``: every parameter shard, and each gradient shard
  as FSDP2 hands it to the post-accumulate-grad hooks), NVMe-swapped parameter shards (tagged again
  at every swap-in, which gives them new storage) and the offload buffers (``offload.base._allocate``,
  pinned or pageable: the offloaded optimizer's gradient and master arenas, its staging blocks, the
  NVMe buffer pool). A tag is the tensor's storage address plus where it came from; the storage is
  held, and a tag whose storage has moved (a swapped-out shard) is dropped, so a reused address is
  not misreported.
* **No blind spots.** An offloaded optimizer whose host gradient or master buffer is not tagged
  raises :class:`StrictCollectiveError` when it is built: strict mode would not see those buffers
  enter a collective, so the run would prove nothing.
* **Propagation.** A :class:`~torch.overrides.TorchFunctionMode` tags results computed from host
  tensors (a norm of host gradients, a bf16 cast of a host shard) as host memory, as on a GPU where
  they would be computed on the CPU. 0-dim host tensors mixed with other tensors count as scalars.
* **Checks.** ``torch.distributed`` collectives and the DTensor entry points hf_zero uses
  (``full_tensor``, ``redistribute``) raise :class:`StrictCollectiveError` naming the tensor (shape,
  dtype, where it came from) when a tagged tensor, or a DTensor whose local shard is one, is passed.
* **The sanctioned moves.** ``collective_device()`` answers as on an NCCL-only group: its device
  objects stand for the accelerator, and ``.to(<that object>)`` of a host tensor returns a fresh,
  untagged copy; so does the device Muon picks for its all-to-all of a host shard (``optim/muon.py``
  ``_exchange_device``, which decides as on a GPU run). torch's full-state-dict gather
  (``get_model_state_dict(full_state_dict=True)``: ``_state_dict_utils._gather_state_dict``) runs
  as on a GPU too: it moves each DTensor to its mesh's device type before gathering it; and so
  does the stage-0/1 fp32 export's broadcast of a host master (``export16._Masters.gather``: the
  owner's ``.to(<the parameter's device>)``). :func:`hf_zero.distributed.collectives.on_mesh_device` (and FSDP2's own copy of
  offloaded shards before its all-gather, ``FSDPParam.all_gather_inputs``) run as on a GPU: inside it, a host tensor reports a device other than the mesh's, and ``.to(<mesh device>)``
  of a host tensor returns a fresh, untagged copy (the host-to-device copy). Outside it ``.to`` keeps
  the tier (``.to("cpu")`` of host memory stays host memory). A bypassed or broken
  ``on_mesh_device`` therefore leaves the host shard in the collective and fails here.

Limits: a
``.to(device)`` outside ``on_mesh_device`` never counts as a move to the device (no false errors, but
a correct move done elsewhere would be reported); ``torch.ops`` calls do not propagate tags.

Test-only: installed by the distributed test workers (:func:`install_from_env`) when
``HF_ZERO_STRICT_COLLECTIVES=1``, never by the package. Example::

    >>> from tests import strict_collectives
    >>> strict_collectives.install()               # doctest: +SKIP
    >>> strict_collectives.tag_host(t, "a host buffer")   # doctest: +SKIP
    >>> dist.all_reduce(t)                          # doctest: +SKIP  (StrictCollectiveError)
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

ENV = "HF_ZERO_STRICT_COLLECTIVES"

# c10d entry points that move tensor data between ranks (the *_object ones pickle into fresh byte
# tensors that call these, so they are covered).
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
    "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "reduce", "all_to_all",
    "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv",
)

# Counters a test reads to show the mode was not vacuous: tags made, host tensors moved by
# on_mesh_device, collective/DTensor entry points checked.
stats = {"tagged": 0, "moved": 0, "checked": 0}

_host: dict[int, tuple[torch.UntypedStorage, str]] = {}
_lock = threading.Lock()
_state = threading.local()
_installed = False


class StrictCollectiveError(RuntimeError):
    """A tensor in host memory (on a GPU run) was passed to a collective."""


def enabled() -> bool:
    """Whether this process was asked for strict collectives (``HF_ZERO_STRICT_COLLECTIVES=1``)."""
    return os.environ.get(ENV) == "1"


def _local(t: Any) -> torch.Tensor | None:
    if not isinstance(t, torch.Tensor):
        return None
    local = getattr(t, "_local_tensor", t)  # a DTensor's shard, without to_local()'s autograd node
    if local.device.type != "cpu" or local.numel() == 0:
        return None
    return local


def _address(local: torch.Tensor) -> int | None:
    try:
        return local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None  # wrapper subclasses without storage (functional collectives' async results)


def tag_host(t: Any, where: str) -> None:
    """Record ``t`` (a tensor, or a DTensor's local shard) as host memory that came from ``where``."""
    local = _local(t)
    address = None if local is None else _address(local)
    if address is None:
        return
    with _lock:
        if address not in _host:
            _host[address] = (local.untyped_storage(), where)
            stats["tagged"] += 1


def host_origin(t: Any) -> str | None:
    """Where host tensor ``t`` came from; None when it is not tagged as host memory."""
    local = _local(t)
    address = None if local is None else _address(local)
    if address is None:
        return None
    entry = _host.get(address)
    if entry is None:
        return None
    if entry[0].data_ptr() != address:  # the tagged storage moved (an NVMe shard swapped out): stale
        with _lock:
            _host.pop(address, None)
        return None
    return entry[1]


def check(op: str, *values: Any) -> None:
    """Raise :class:`StrictCollectiveError` when a tensor among ``values`` (nested) is host memory."""
    stats["checked"] += 1
    for t in tree_flatten(values)[0]:
        where = host_origin(t)
        if where is not None:
            kind = "DTensor whose local shard is" if hasattr(t, "_local_tensor") else "tensor"
            raise StrictCollectiveError(
                f"{op}: a {kind} in host memory (shape {tuple(t.shape)}, {t.dtype}; {where}) "
                "enters a collective; NCCL refuses it ('No backend type associated with device type "
                "cpu'). Move it to the mesh's device first (hf_zero.distributed.collectives.on_mesh_device)."
            )


def _emulating() -> bool:
    return getattr(_state, "emulate", 0) > 0


def _is_device_getter(func: Any) -> bool:
    return getattr(func, "__self__", None) is torch.Tensor.device


def _explicit_device(args: tuple, kwargs: dict) -> bool:
    return "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args[1:])


# torch.device objects standing for the accelerator: collective_device()'s answers, which are the
# current GPU on an NCCL-only group (held, so their ids stay unique).
_accelerator_devices: list[torch.device] = []


def _to_accelerator(args: tuple, kwargs: dict) -> bool:
    targets = [kwargs.get("device"), *args[1:]]
    return any(t is d for t in targets for d in _accelerator_devices)


class _HostTier(TorchFunctionMode):
    """Propagates host tags through computations; emulates the GPU inside ``on_mesh_device``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_device_getter(func):
            if _emulating() and host_origin(args[0]) is not None:
                return torch.device("meta")  # "not the mesh's device": what a host shard is on a GPU mesh
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if getattr(func, "__name__", "") == "__get__":
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        host = [t for t in inputs if host_origin(t) is not None]
        if not host:
            return out
        if func is torch.Tensor.to and (_emulating() and _explicit_device(args, kwargs)
                                        or _to_accelerator(args, kwargs)):
            # A host-to-device copy (on_mesh_device, FSDP2's copy-in, .to(collective_device())):
            # a new tensor in device memory.
            if isinstance(out, torch.Tensor) and _local(out) is not None and host_origin(out) is not None:
                out = out.clone()
            stats["moved"] += 1
            return out
        if len(host) < len(inputs) and all(t.dim() == 0 for t in host):
            return out  # host 0-dim tensors next to device tensors act as scalars
        where = host_origin(host[0])
        where = where if where.startswith("computed from") else f"computed from {where}"
        ids = {id(t) for t in inputs}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and id(t) not in ids:  # in-place results keep their tier
                tag_host(t, where)
        return out


def _checked(op: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        check(op, args, kwargs)
        return fn(*args, **kwargs)

    return wrapper


def _as_on_gpu(fn):
    """Run ``on_mesh_device`` as on a GPU run (see the module docstring)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _state.emulate = getattr(_state, "emulate", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _state.emulate -= 1

    return wrapper


def _on_nccl(collective_device):
    """``collective_device`` answering as on an NCCL-only group: the (emulated) accelerator."""

    @functools.wraps(collective_device)
    def wrapper(*args, **kwargs):
        out = torch.device(collective_device(*args, **kwargs))
        _accelerator_devices.append(out)
        return out

    return wrapper


def _exchange_on_gpu(exchange_device):
    """Muon's choice of where its all-to-all runs (``optim/muon.py`` ``_exchange_device``), made as
    on a GPU run: a host shard is not on the mesh's device there, and the device it then picks
    stands for the accelerator (``.to`` it is the host-to-device copy)."""

    @functools.wraps(exchange_device)
    def wrapper(t, mesh_type):
        out = torch.device(_as_on_gpu(exchange_device)(t, mesh_type))
        if host_origin(t) is not None:
            _accelerator_devices.append(out)
        return out

    return wrapper


def _tag_offloaded_params(init):
    @functools.wraps(init)
    def wrapper(self, model, *args, **kwargs):
        init(self, model, *args, **kwargs)
        for name, p in model.named_parameters():
            where = f"offloaded parameter shard {name} (FSDP2 CPUOffloadPolicy)"
            tag_host(p, where)
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(
                    lambda p, name=name: tag_host(p.grad, f"offloaded gradient shard of {name}"))

    return wrapper


def _tag_allocation(allocate):
    @functools.wraps(allocate)
    def wrapper(nbytes, pin):
        out = allocate(nbytes, pin)
        kind = "pinned" if pin else "pageable"
        tag_host(out, f"{kind} host buffer of {nbytes} bytes (offload.base._allocate: an offload buffer or arena)")
        return out

    return wrapper


def _tag_nvme_shards(swapper_cls):
    """NVMe-swapped parameter shards: tagged when the swapper is built and at every swap-in (the
    storage is resized to 0 on eviction and back on load, at a new address)."""
    init, start_load = swapper_cls.__init__, swapper_cls._start_load

    def tag_unit(unit) -> None:
        for fp in unit.fsdp_params:
            names = getattr(fp, "_param_fqn", None) or "?"
            tag_host(fp._sharded_param_data, f"NVMe-swapped parameter shard {names} (offload_param nvme)")

    @functools.wraps(init)
    def wrapped_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for unit in self.units:
            if unit.resident:
                tag_unit(unit)

    @functools.wraps(start_load)
    def wrapped_start_load(self, unit, *args, **kwargs):
        start_load(self, unit, *args, **kwargs)
        if unit.resident:
            tag_unit(unit)

    swapper_cls.__init__ = wrapped_init
    swapper_cls._start_load = wrapped_start_load


def _require_tagged_buffers(optimizer_cls):
    """An offloaded optimizer's host gradients and masters must be tagged: otherwise a collective
    on them (an F1-type regression) would pass here and fail on a GPU."""
    init = optimizer_cls.__init__

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for slot in self.slots:
            for kind, buf in (("gradient", slot.grad), ("fp32 master", slot.master)):
                if buf is not None and buf.numel() and host_origin(buf) is None:
                    raise StrictCollectiveError(
                        f"strict collectives cannot see the offloaded optimizer's host {kind} buffer of "
                        f"{slot.name} (not tagged as host memory): tag it where it is allocated "
                        "(tests/strict_collectives.py wraps offload.base._allocate)"
                    )

    optimizer_cls.__init__ = wrapper


def install() -> None:
    """Turn strict collectives on for this process (idempotent; stays on until it exits)."""
    global _installed
    if _installed:
        return
    from torch.distributed import distributed_c10d
    from torch.distributed.tensor import DTensor

    import hf_zero.checkpoint.export16 as export16
    import hf_zero.distributed.collectives as collectives
    import hf_zero.engine.engine as engine_module
    import hf_zero.offload.manager as manager
    from hf_zero.offload import base, param_offload

    for name in COLLECTIVES:
        for module in (dist, distributed_c10d):
            fn = getattr(module, name, None)
            if fn is not None:
                setattr(module, name, _checked(f"torch.distributed.{name}", fn))
    DTensor.full_tensor = _checked("DTensor.full_tensor", DTensor.full_tensor)
    real_redistribute = DTensor.redistribute

    @functools.wraps(real_redistribute)
    def redistribute(self, device_mesh=None, placements=None, **kwargs):
        if placements is not None and tuple(placements) != tuple(self.placements):
            check("DTensor.redistribute", self)  # a change of placements communicates
        return real_redistribute(self, device_mesh, placements, **kwargs)

    DTensor.redistribute = redistribute
    original = collectives.on_mesh_device
    for module in (collectives, engine_module, export16):
        if getattr(module, "on_mesh_device", None) is original:
            module.on_mesh_device = _as_on_gpu(original)
    # Stages 0/1's fp32 export: the owner moves its host master to the parameter's device
    # (.to(like.device): the accelerator on a GPU run) before broadcasting it.
    export16._Masters.gather = _as_on_gpu(export16._Masters.gather)
    wrapped = _on_nccl(collectives.collective_device)
    for module in (collectives, manager):
        module.collective_device = wrapped
    # torch's full state dict (get_model_state_dict(full_state_dict=True)) moves each DTensor to
    # its mesh's device type before gathering it (_state_dict_utils.dtensor_func): as on a GPU run.
    import torch.distributed._state_dict_utils as state_dict_utils
    import torch.distributed.checkpoint.state_dict as dcp_state_dict

    gather = _as_on_gpu(state_dict_utils._gather_state_dict)
    for module in (state_dict_utils, dcp_state_dict):
        module._gather_state_dict = gather
    import hf_zero.optim.muon as muon

    muon._exchange_device = _exchange_on_gpu(muon._exchange_device)
    # FSDP2's own host-to-device copy of offloaded shards before its all-gather: a sanctioned move too.
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    FSDPParam.all_gather_inputs = property(_as_on_gpu(FSDPParam.all_gather_inputs.fget))
    param_offload.CpuParamOffload.__init__ = _tag_offloaded_params(param_offload.CpuParamOffload.__init__)
    _tag_nvme_shards(param_offload.NvmeParamSwapper)
    base._allocate = _tag_allocation(base._allocate)
    from hf_zero.offload.host_optimizer import OffloadedOptimizer

    _require_tagged_buffers(OffloadedOptimizer)
    _HostTier().__enter__()  # process-wide for the main thread; never exited (the worker ends)
    _installed = True


def install_from_env() -> bool:
    """For test workers: :func:`install` when ``HF_ZERO_STRICT_COLLECTIVES=1``, and the control
    (:func:`bypass_on_mesh_device`) when also ``HF_ZERO_STRICT_CONTROL=bypass``. Whether installed."""
    if not enabled():
        return False
    install()
    if os.environ.get("HF_ZERO_STRICT_CONTROL") == "bypass":
        bypass_on_mesh_device()
    return True


def bypass_on_mesh_device() -> None:
    """The control: ``on_mesh_device`` replaced by the identity where hf_zero calls it (F1 unfixed)."""
    import hf_zero.checkpoint.export16 as export16
    import hf_zero.distributed.collectives as collectives
    import hf_zero.engine.engine as engine_module

    for module in (collectives, engine_module, export16):
        module.on_mesh_device = lambda value: value
