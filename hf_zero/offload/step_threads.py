"""How many OpenMP threads the offloaded optimizer step runs on (review F7).

torchrun sets ``OMP_NUM_THREADS=1`` for every rank when the variable is unset and a node runs
several ranks (``torch/distributed/run.py``, ``config_from_args``); ``accelerate launch`` does the
same through ``--num_cpu_threads_per_process`` (default 1). Then the offloaded optimizer step, a
CPU optimizer over the rank's whole shard, runs on one core while the node's other cores idle.
``hf-zero run`` gives each rank ``cores / ranks`` threads instead (``cli/launch/plan.py``).

For plain ``torchrun``/``accelerate launch`` the step raises torch's thread count to
``cores / local ranks`` while it runs, and puts it back after, when the 1 is the launcher's
default and not the user's: the launcher's own environment (``/proc/<parent>/environ``, as it was
when the user started it) has no ``OMP_NUM_THREADS``, and no ``hf-zero run`` plan chose it. When
that cannot be read the step keeps its one thread and rank 0 says how to fix it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

__all__ = ["CHOSEN_ENV", "StepThreads", "launcher_environ", "plan_step_threads", "step_threads_for_this_rank"]

CHOSEN_ENV = "HF_ZERO_OMP_NUM_THREADS_CHOSEN"
"""Set by ``hf-zero run`` for its ranks when their ``OMP_NUM_THREADS`` was chosen (by the user or by
its plan), so that a 1 there is never taken for torchrun's default."""

_OMP = "OMP_NUM_THREADS"
_said: set[str] = set()
logger = logging.getLogger("hf_zero")


@dataclass(frozen=True)
class StepThreads:
    """What the offloaded step does with torch's thread count.

    Attributes:
        threads: threads for the step (torch's count is put back after it); None leaves it alone.
        message: what rank 0 says at start-up; None when there is nothing to say.
    """

    threads: int | None = None
    message: str | None = None

    def announce(self) -> None:
        """Log :attr:`message` (once per process: every engine of a run would repeat it)."""
        if self.message and self.message not in _said:
            _said.add(self.message)
            logger.warning(self.message)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Run the block on :attr:`threads` threads, then restore the count it found."""
        if self.threads is None:
            yield
            return
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)


def plan_step_threads(*, current: int, cores: int, local_world: int, env: Mapping[str, str],
                      launcher_env: Mapping[str, str] | None, openmp: bool = True) -> StepThreads:
    """Decide the step's threads (pure; :func:`step_threads_for_this_rank` passes the real values).

    Args:
        current: ``torch.get_num_threads()`` in this rank.
        cores: the cores this rank may run on.
        local_world: ranks on this node (``LOCAL_WORLD_SIZE``).
        env: this rank's environment.
        launcher_env: the launcher's environment as the user started it (None: unknown).
        openmp: torch's intra-op backend is OpenMP (the native one cannot change its count once
            parallel work has started).
    """
    share = max(1, cores // max(1, local_world))
    if local_world < 2 or env.get(_OMP, "").strip() != "1" or current != 1 or share < 2 or CHOSEN_ENV in env:
        return StepThreads()  # one rank per node, a count the user or hf-zero run chose, or no cores to spare
    if launcher_env is not None and _OMP in launcher_env:
        return StepThreads()  # `OMP_NUM_THREADS=1 torchrun ...`: the user's own choice
    fix = (f"set it yourself to choose (OMP_NUM_THREADS={share} torchrun ..., or accelerate launch "
           f"--num_cpu_threads_per_process {share}), or launch with hf-zero run, which gives each rank its share")
    if launcher_env is not None and openmp:
        return StepThreads(share, (
            f"hf_zero: the launcher set OMP_NUM_THREADS=1 for the {local_world} ranks of this node (torchrun's "
            f"default when it is unset); the offloaded optimizer step runs on {share} threads per rank "
            f"({cores} cores / {local_world} ranks) while it steps, and on 1 elsewhere. To keep 1 thread, or to "
            f"choose another count, {fix}."))
    why = "its environment cannot be read" if launcher_env is None else "torch's thread pool is not OpenMP"
    return StepThreads(None, (
        f"hf_zero: each rank runs torch on 1 thread (OMP_NUM_THREADS=1, which torchrun and accelerate launch "
        f"set when it is unset), so the offloaded optimizer step uses 1 of the {share} cores per rank this node "
        f"has ({cores} cores / {local_world} ranks); hf_zero leaves it ({why}). To use them, {fix}."))


def launcher_environ(pid: int | None = None) -> dict[str, str] | None:
    """The environment the launcher (this rank's parent process) was started with, read from
    ``/proc/<pid>/environ`` (what the user gave it, before the launcher set anything); None when it
    cannot be read (not Linux, or the parent is gone)."""
    pid = os.getppid() if pid is None else pid
    if pid <= 1:
        return None  # orphaned: the launcher is gone
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def step_threads_for_this_rank() -> StepThreads:
    """:func:`plan_step_threads` for this process (its environment, its parent, torch's count)."""
    import torch

    try:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local_world = 1
    current = torch.get_num_threads()
    if local_world < 2 or current != 1:
        return StepThreads()  # the common cases, without reading /proc
    return plan_step_threads(current=current, cores=_cores(), local_world=local_world, env=os.environ,
                             launcher_env=launcher_environ(),
                             openmp="OpenMP" in torch.__config__.parallel_info())
