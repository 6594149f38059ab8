"""Run example scripts as subprocesses: plain python, or through ``hf-zero run`` on N CPU ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FINETUNE = "examples/finetune_qwen/finetune.py"


def run(cmd: list[str], *, expect_ok: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def python_script(script: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return run([sys.executable, script, *args], **kw)


def hf_zero_run(nproc: int, script: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "hf_zero.cli.main", "run", "--nproc_per_node", str(nproc), script, *args], **kw)


def logged_losses(output_dir: Path) -> list[float]:
    """Per-step training losses from the Trainer's trainer_state.json (written by save_state)."""
    state = json.loads((Path(output_dir) / "trainer_state.json").read_text())
    return [h["loss"] for h in state["log_history"] if "loss" in h]


def logged_grad_norms(output_dir: Path) -> list[float]:
    """Per-step gradient norms (before clipping) the Trainer logged."""
    state = json.loads((Path(output_dir) / "trainer_state.json").read_text())
    return [h["grad_norm"] for h in state["log_history"] if "grad_norm" in h]


def write_config(path: Path, config: dict) -> Path:
    path.write_text(json.dumps(config, indent=1))
    return path


def zero_config(stage: int, **extra) -> dict:
    """A DeepSpeed-style config with "auto" everywhere the HF integration allows it."""
    from hf_zero.config.auto import trainer_auto_config

    return {**trainer_auto_config({"stage": stage, "reduce_bucket_size": "auto"}, optimizer=False), **extra}


def assert_same_run(got: Path, want: Path, steps: int) -> None:
    """Two Trainer runs trained alike: ``steps`` logged losses (rtol 2e-4) and gradient norms (2e-3)
    each, and the same saved weights (``model.safetensors``: dtypes, rtol 1e-4 / atol 2e-5)."""
    import torch
    from safetensors.torch import load_file

    assert len(logged_losses(got)) == len(logged_losses(want)) == steps
    torch.testing.assert_close(logged_losses(got), logged_losses(want), rtol=2e-4, atol=0)
    torch.testing.assert_close(logged_grad_norms(got), logged_grad_norms(want), rtol=2e-3, atol=0)
    got_w, want_w = load_file(Path(got) / "model.safetensors"), load_file(Path(want) / "model.safetensors")
    assert got_w.keys() == want_w.keys()
    for name, value in want_w.items():
        assert got_w[name].dtype == value.dtype, name
        torch.testing.assert_close(got_w[name], value, rtol=1e-4, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")
