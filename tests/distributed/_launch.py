"""Launch a worker script on N CPU ranks with torchrun (gloo), as a user would."""

from __future__ import annotations

import os
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
