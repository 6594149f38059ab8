"""``hf-zero run``: torchrun (torch's elastic launcher) running the script through hf_zero's bootstrap."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["LaunchPlan", "plan_launch", "nccl_env_for_gpus"]

# GeForce/consumer cards whose NCCL P2P/IB paths fail without these variables (source 001:
# "RTX 3090 or 4000 series doesn't support faster communication ... set NCCL_P2P_DISABLE=1 and
# NCCL_IB_DISABLE=1").
_CONSUMER_GPU = re.compile(r"(GeForce|RTX\s*[2345]0\d0|RTX\s*A?[2345]000\b|TITAN)", re.IGNORECASE)
_NCCL_CONSUMER_VARS = {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"}


def nccl_env_for_gpus(gpu_names: Sequence[str], p2p_ok: bool, env: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """NCCL variables to add for these GPUs, and the notes to print about them.

    Only when several consumer cards without peer access are present, and never over a value
    the user set.

    Example::

        >>> nccl_env_for_gpus(["NVIDIA GeForce RTX 3090"] * 2, p2p_ok=False, env={})[0]
        {'NCCL_P2P_DISABLE': '1', 'NCCL_IB_DISABLE': '1'}
    """
    if len(gpu_names) < 2 or p2p_ok or not any(_CONSUMER_GPU.search(n) for n in gpu_names):
        return {}, []
    added = {k: v for k, v in _NCCL_CONSUMER_VARS.items() if k not in env}
    notes = []
    if added:
        notes.append(
            f"hf-zero run: {gpu_names[0]} cards without P2P access: setting "
            + " ".join(f"{k}={v}" for k, v in added.items())
            + " (NCCL hangs or fails on these cards otherwise; set them yourself to override)"
        )
    return added, notes


@dataclass(frozen=True)
class LaunchPlan:
    """The torchrun arguments and extra environment of one ``hf-zero run``."""

    torchrun_args: list[str]
    env: dict[str, str]
    notes: list[str]


def plan_launch(
    script: str,
    script_args: Sequence[str],
    *,
    nproc_per_node: int | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
    gpu_names: Sequence[str] = (),
    p2p_ok: bool = True,
    env: Mapping[str, str] | None = None,
) -> LaunchPlan:
    """Build the ``torchrun`` command line for ``script`` (pure: no process is started).

    One node without ``--master_addr`` uses ``--standalone`` (a free local port is picked).
    """
    env = dict(os.environ if env is None else env)
    nproc = nproc_per_node or max(1, len(gpu_names))
    args = [f"--nproc_per_node={nproc}"]
    if nnodes == 1 and master_addr is None:
        args.append("--standalone")
    else:
        args += [f"--nnodes={nnodes}", f"--node_rank={node_rank}", f"--master_addr={master_addr or '127.0.0.1'}"]
        args.append(f"--master_port={master_port or 29500}")
    args += ["-m", "hf_zero.integration.bootstrap", script, *script_args]
    extra, notes = nccl_env_for_gpus(gpu_names, p2p_ok, env)
    if "OMP_NUM_THREADS" not in env and nproc > 1:
        # Ranks share the node's cores. torchrun would give each GPU rank a single thread, and the
        # offloaded optimizer step (a CPU AdamW over the rank's whole shard) would run on one core.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or nproc)
        extra["OMP_NUM_THREADS"] = str(max(1, cores // nproc))
    return LaunchPlan(torchrun_args=args, env=extra, notes=notes)
