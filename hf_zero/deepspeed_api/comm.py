"""``deepspeed.comm`` for hf_zero: DeepSpeed's collective helpers are thin wrappers over
``torch.distributed``; here they are ``torch.distributed`` itself.

``get_rank``/``get_world_size``/``get_local_rank``/``barrier`` also answer before a process group
exists (0, 1, the launcher's ``LOCAL_RANK``, nothing to wait for), because scripts call them at
import time to decide who prints. ``init_distributed`` creates the group the way hf_zero does
(NCCL with CUDA, gloo without; one in-memory group when no launcher set the environment).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = [
    "ReduceOp",
    "init_distributed",
    "is_initialized",
    "get_rank",
    "get_world_size",
    "get_local_rank",
    "barrier",
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce",
    "reduce_scatter_tensor",
    "new_group",
]

ReduceOp = dist.ReduceOp
all_reduce = dist.all_reduce
broadcast = dist.broadcast
all_gather = dist.all_gather
all_gather_into_tensor = dist.all_gather_into_tensor
reduce = dist.reduce
reduce_scatter_tensor = dist.reduce_scatter_tensor
new_group = dist.new_group


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config: Any = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Create the default process group if there is none (hf_zero's ``init_distributed``).

    The backend follows the hardware (``dist_backend`` is accepted and not used); the rendezvous
    comes from the launcher's environment (``hf-zero run``/torchrun), or one in-memory process
    without it. ``timeout`` is honoured; DeepSpeed's MPI discovery and port options are not needed.
    """
    from hf_zero.distributed.env import init_distributed as hf_zero_init

    hf_zero_init(timeout_s=timeout.total_seconds() if timeout is not None else 1800.0)


def is_initialized() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Any = None) -> int:
    """This process's rank (in ``group``); 0 before a process group exists."""
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group: Any = None) -> int:
    """The number of processes (in ``group``); 1 before a process group exists."""
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    """This process's rank on its node, from the launcher's ``LOCAL_RANK`` (0 without one)."""
    return int(os.environ.get("LOCAL_RANK", "0") or 0)


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None) -> Any:
    """Wait for every rank (of ``group``); nothing to wait for before a process group exists."""
    if not is_initialized():
        return None
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)
