"""The one place that creates process groups and reads the launcher's environment.

Under torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set) the group is created from the
environment; with none of those set (a notebook, a plain ``python train.py``) a one-process group is
created on an in-memory store, so the user never sets ``MASTER_ADDR``/``MASTER_PORT``. An existing
group (the Trainer's, or the user's) is always reused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hf_zero.distributed import device as accel
from hf_zero.distributed.teardown import register_exit_quiesce, register_exit_teardown, teardown

__all__ = ["DistEnv", "init_distributed", "launched_by_torchrun", "exit_cleanly"]


@dataclass(frozen=True, slots=True)
class DistEnv:
    """Where this process sits: rank, world size, and the device and backend it uses."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """True when a launcher (torchrun, ``hf-zero run``, accelerate) set the rendezvous variables."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _pick_device(local_rank: int) -> torch.device:
    return accel.select_device(local_rank)


def init_distributed(timeout_s: float = 1800.0) -> DistEnv:
    """Return this process's :class:`DistEnv`, creating the default process group if needed.

    Uses NCCL when CUDA is available and gloo otherwise. Safe to call many times.

    Example::

        >>> env = init_distributed()          # in a notebook: world_size 1, no env vars needed
        >>> env.world_size, env.backend
        (1, 'gloo')
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        backend = accel.default_backend()
        rank_device = _pick_device(local_rank)
        timeout = timedelta(seconds=timeout_s)
        if launched_by_torchrun():
            kwargs = {"device_id": rank_device} if accel.is_accelerator(rank_device) else {}
            dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
        else:
            # One process: an in-memory store needs no address, no port and no firewall.
            dist.init_process_group(
                backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        # We made the group, so we end it at exit; destroy_process_group() alone leaves gloo's
        # worker threads running into interpreter finalization, where they can abort the
        # process (distributed/teardown.py says why and what is done instead).
        register_exit_teardown()
    else:
        # Someone else (accelerate, the user) made the group; it may be a multi-backend group
        # ("cpu:gloo,cuda:nccl", reported as "undefined"), so the device follows CUDA availability.
        backend = str(dist.get_backend())
        rank_device = torch.device("cpu") if backend == "gloo" else _pick_device(local_rank)
        # Not ours to destroy, but at exit hf_zero's engines are closed and gloo's workers left
        # parked, so that they do not abort the process during finalization (teardown.py).
        register_exit_quiesce()
    return DistEnv(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=rank_device,
        backend=backend,
    )


def exit_cleanly(code: int = 0) -> None:
    """End this process now with ``code``, skipping the interpreter's final clean-up.

    For callers that know their exit status (``hf-zero run``'s bootstrap after the script
    returned, the test workers): it tears the process group down as the exit hook does
    (:func:`hf_zero.distributed.teardown.teardown`), runs the ``atexit`` handlers (the user's
    clean-up and logging's flush still happen), flushes stdio and leaves with ``os._exit``. Scripts
    need not call it: the exit hook registered by :func:`init_distributed` already makes a plain
    exit safe and keeps its status.
    """
    import atexit
    import sys

    teardown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
