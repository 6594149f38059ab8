"""The private FSDP2 objects hf_zero reads, in one place (review F12).

FSDP2's public API has no way to reach a unit's parameter group (its shards, its unshard step, its
offload policy), which NVMe parameter offload and low-memory loading need. What hf_zero reads, and
from which torch release:

* ``FSDPModule._get_fsdp_state()`` (2.9+).
* ``FSDPState._fsdp_param_groups``, a list (2.12+; a module sharded once has one group). Before,
  only ``FSDPState._fsdp_param_group``; since 2.12 that is a compatibility property that raises when
  a state has more than one group, so the list is read first.
* ``FSDPParamGroup.fsdp_params``, ``.unshard``, ``.lazy_init()`` (no arguments through 2.15),
  ``.offload_policy``; ``FSDPParam.sharded_param`` and ``._sharded_param_data``.
* ``FSDPParam.grad_offload_event``: the event after FSDP2's asynchronous copy of a gradient to
  pinned host memory (``CPUOffloadPolicy``), None when the copy was synchronous (2.9+).

The versions the matrix runs (docs/versions.md: 2.9.1, 2.11, 2.13, 2.15) pass the tests that go
through here (``tests/distributed/test_offload_parity.py``, ``tests/unit/test_offloaded_params.py``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hf_zero.distributed import device as accel


def param_groups(module: nn.Module) -> list[Any]:
    """The ``FSDPParamGroup`` objects of one ``fully_shard``-ed module (empty for another module,
    or for a unit without parameters).

    >>> param_groups(nn.Linear(2, 2))
    []
    """
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return []
    state = get_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.12+
    if groups is None:  # torch 2.9-2.11: at most one group per state
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return [g for g in groups if g is not None]


def fsdp_params_by_param(modules: list[nn.Module]) -> dict[int, Any]:
    """``id(sharded parameter) -> FSDPParam`` over the parameter groups of ``modules``.

    >>> fsdp_params_by_param([nn.Linear(2, 2)])
    {}
    """
    return {id(fp.sharded_param): fp for m in modules for g in param_groups(m) for fp in g.fsdp_params}


_UNSEEN = object()


class HostGradCopies:
    """FSDP2's copies of the sharded gradients to host memory (``CPUOffloadPolicy``), and the wait
    that makes one of them safe to read inside a post-accumulate-grad hook.

    torch before pytorch#180666 issues the copy with ``non_blocking=True`` into pinned memory and
    calls the hooks before it lands (FSDP2 itself waits only in ``finalize_backward``), so a hook
    reading ``param.grad`` would read a stale gradient (review N3). With that change (torch 2.11.0
    and 2.13 have it) the copy is synchronous when a hook exists and no event is recorded. :meth:`wait` waits for the
    event FSDP2 recorded after the copy, whatever the version; should FSDP2's internals move, it
    synchronizes the device instead (slow, never stale).
    """

    def __init__(self, modules: list[nn.Module]):
        self._modules = modules
        self._by_param: dict[int, Any] = {}

    def wait(self, param: nn.Parameter, grad: Any) -> None:
        """Block until FSDP2's copy of ``param``'s gradient ``grad`` (its local tensor) to the host
        has landed; nothing to do for a gradient on the accelerator."""
        if accel.is_accelerator(grad):
            return
        fsdp_param = self._by_param.get(id(param), _UNSEEN)
        if fsdp_param is _UNSEEN:  # first call, or FSDP2 replaced its parameters since
            self._by_param = fsdp_params_by_param(self._modules)
            fsdp_param = self._by_param.setdefault(id(param), None)
        if fsdp_param is None or not hasattr(fsdp_param, "grad_offload_event"):
            accel.synchronize(accel.current_device())
            return
        accel.wait_event(fsdp_param.grad_offload_event)
