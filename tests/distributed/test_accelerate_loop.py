"""A loop written on accelerate's ``Accelerator``, handed to hf_zero at stages 0-3 (and with CPU
offload), against the same loop under accelerate's own DDP.

Two torchrun launches of 2 gloo ranks: the plain accelerate run (the reference), and one run in
which the same script calls ``use_hf_zero_accelerator`` before each case. Then one process resumes
a case from its ``save_state`` (another process count, same global batch). Compared: the loss of
every micro-step (``gather_for_metrics``), the learning rates the scheduler set (accelerate steps
it once per process per update), and the weights ``save_pretrained(state_dict=get_state_dict(model))``
wrote, loaded back with ``from_pretrained``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _launch import REPO, torchrun

pytestmark = pytest.mark.slow

AUTO = {"gradient_accumulation_steps": "auto", "train_micro_batch_size_per_gpu": "auto"}
CASES = [
    *({"name": f"s{stage}", "config": {"zero_optimization": {"stage": stage}, **AUTO}} for stage in range(4)),
    {"name": "s2_offload", "config": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, **AUTO}},
    # accelerate's own FSDP config (FSDP2, CPU offload of parameters, blocks named by class)
    {"name": "s3_fsdp_offload", "config": {"distributed_type": "FSDP", "fsdp_config": {
        "fsdp_version": 2, "fsdp_offload_params": True, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}}},
    {"name": "s3_constant_lr", "constant_lr": True, "config": {"zero_optimization": {"stage": 3}, **AUTO}},
]
ENV = {"ACCELERATE_USE_CPU": "true"}  # accelerate's own switch for multi-process CPU runs
WORKER = "tests/distributed/accelerate_loop_worker.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("accelerate_loop")
    torchrun(WORKER, "plain", str(tmp), env=ENV)
    (tmp / "cases.json").write_text(json.dumps(CASES))
    torchrun(WORKER, "zero", str(tmp), str(tmp / "cases.json"), env=ENV)
    case = next(c for c in CASES if c["name"] == "s3_constant_lr")
    (tmp / "resume_case.json").write_text(json.dumps(case))
    cmd = [sys.executable, WORKER, "resume", str(tmp), str(tmp / "resume_case.json"),
           str(tmp / "s3_constant_lr" / "state")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return {"dir": tmp, "plain": json.loads((tmp / "plain.json").read_text())["plain"],
            "zero": json.loads((tmp / "zero.json").read_text()),
            "resumed": json.loads((tmp / "resume.json").read_text())["resumed"]}


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return {k: v.detach() for k, v in AutoModelForCausalLM.from_pretrained(path).state_dict().items()}


@pytest.mark.parametrize("name", [c["name"] for c in CASES if not c.get("constant_lr")])
def test_losses_lrs_and_saved_model_match_accelerate_ddp(runs, name):
    tmp, plain, zero = runs["dir"], runs["plain"], runs["zero"]
    torch.testing.assert_close(zero[name]["losses"], plain["losses"], rtol=2e-3, atol=0)
    assert zero[name]["lrs"] == pytest.approx(plain["lrs"], rel=1e-9)
    ref, got = _weights(tmp / "plain" / "model"), _weights(tmp / name / "model")
    assert ref.keys() == got.keys()
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=2e-3, atol=1e-5)


def test_save_state_resumes_on_one_process(runs):
    """A stage-3 run saved by 2 ranks at step 2 continues on 1 process (global batch unchanged:
    one batch of 4 instead of 2 x 2) with the losses of the uninterrupted 2-rank run."""
    full = runs["zero"]["s3_constant_lr"]["losses"]
    resumed = runs["resumed"]["losses"]
    assert len(resumed) == len(full) // 2
    torch.testing.assert_close(resumed, full[len(full) // 2:], rtol=2e-3, atol=0)
