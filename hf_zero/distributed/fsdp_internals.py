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

The versions the matrix runs (docs/versions.md: 2.9.1, 2.11, 2.13, 2.15) pass the tests that go
through here (``tests/distributed/test_offload_parity.py``, ``tests/unit/test_offloaded_params.py``).
"""

from __future__ import annotations

from typing import Any

from torch import nn


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
