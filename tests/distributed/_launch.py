"""Launch a worker script on N CPU ranks with torchrun (gloo), as a user would."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def torchrun(script: str | Path, *args: str, nproc: int = 2, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``torchrun --standalone --nproc_per_node nproc script args``; raise with its output on failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script), *args]
    # Strict collectives (tests/strict_collectives.py) are on in every worker that installs them:
    # a host-memory tensor entering a collective fails the test, as NCCL would fail on a GPU.
    strict = {"HF_ZERO_STRICT_COLLECTIVES": os.environ.get("HF_ZERO_STRICT_COLLECTIVES", "1")}
    full_env = {**os.environ, **strict, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def run_nodes(lines: list[list[str]], envs: list[dict], cwd: str | Path, timeout: float = 600) -> list[tuple[int, str, str]]:
    """Start one launcher process per "node" at once (each its command line and environment), wait
    for all, kill what is left on a timeout; ``(returncode, stdout, stderr)`` per node."""
    nodes = [subprocess.Popen(line, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for line, env in zip(lines, envs)]
    outs: list[tuple[str, str]] = []
    try:
        outs = [n.communicate(timeout=timeout) for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
                n.communicate()
    return [(n.returncode, out, err) for n, (out, err) in zip(nodes, outs)]


def hf_zero_nodes(script: str, *args: str, nodes: int = 2, nproc_per_node: int = 2, strict: bool = True,
                  timeout: float = 600) -> None:
    """``hf-zero run --nnodes N --node_rank R --master_addr 127.0.0.1 ... script args`` for every
    "node" on localhost at once (ranks numbered node by node, as on a cluster); raise with the
    output of a node that failed. ``strict``: HF_ZERO_STRICT_COLLECTIVES=1 in the workers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if strict:
        env["HF_ZERO_STRICT_COLLECTIVES"] = "1"
    lines = [[sys.executable, "-m", "hf_zero.cli.main", "run", "--nnodes", str(nodes), "--node_rank", str(node),
              "--master_addr", "127.0.0.1", "--master_port", port, "--nproc_per_node", str(nproc_per_node),
              str(script), *args] for node in range(nodes)]
    for node, (code, out, err) in enumerate(run_nodes(lines, [env] * nodes, REPO, timeout=timeout)):
        if code != 0:
            raise AssertionError(f"node {node} failed ({code}):\n{out[-3000:]}\n{err[-6000:]}")
