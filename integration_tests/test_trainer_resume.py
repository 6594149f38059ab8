"""Resume through the Trainer gives the losses of an uninterrupted run: same ranks, 2 -> 1, 1 -> 2,
and stage 2 -> stage 3; ``hf-zero consolidate`` turns a checkpoint into a from_pretrained folder."""

from __future__ import annotations

import shutil
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from _run import FINETUNE, hf_zero_run, logged_losses, run, write_config, zero_config

pytestmark = pytest.mark.slow
GLOBAL_BATCH = 4
COMMON = ["--max_steps", "4", "--logging_steps", "1", "--report_to", "none", "--learning_rate", "2e-3",
          "--seed", "7", "--save_strategy", "steps", "--save_steps", "2", "--max_grad_norm", "1.0"]


def _train(nproc, cfg, out, *extra):
    hf_zero_run(nproc, FINETUNE, "--zero_config", str(cfg), "--output_dir", str(out),
                "--per_device_train_batch_size", str(GLOBAL_BATCH // nproc), *COMMON, *extra)


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory):
    """Uninterrupted 4-step runs at stage 2 and 3 (2 ranks), checkpoints at steps 2 and 4."""
    runs = {}
    for stage in (2, 3):
        tmp = tmp_path_factory.mktemp(f"full{stage}")
        cfg = write_config(tmp / "ds.json", zero_config(stage))
        _train(2, cfg, tmp / "out")
        runs[stage] = (cfg, tmp / "out")
    return runs


@pytest.mark.parametrize(
    "save_stage,resume_stage,resume_nproc",
    [(3, 3, 2), (3, 3, 1), (2, 3, 2), (2, 2, 1)],
    ids=["stage3-2to2", "stage3-2to1", "stage2to3-2to2", "stage2-2to1"],
)
def test_resume_continues_the_same_losses(full_runs, tmp_path, save_stage, resume_stage, resume_nproc):
    cfg, full_out = full_runs[save_stage]
    reference = logged_losses(full_out)
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(full_out / "checkpoint-2", out / "checkpoint-2")
    resume_cfg = write_config(tmp_path / "ds.json", zero_config(resume_stage))
    _train(resume_nproc, resume_cfg, out, "--resume_from_checkpoint", str(out / "checkpoint-2"))
    resumed = logged_losses(out)
    # trainer_state.json keeps the two logged steps from before the checkpoint.
    torch.testing.assert_close(resumed[-2:], reference[-2:], rtol=2e-4, atol=0)


def test_resume_one_rank_to_two(tmp_path):
    cfg = write_config(tmp_path / "ds.json", zero_config(3))
    full = tmp_path / "full"
    _train(1, cfg, full)
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(full / "checkpoint-2", out / "checkpoint-2")
    _train(2, cfg, out, "--resume_from_checkpoint", str(out / "checkpoint-2"))
    torch.testing.assert_close(logged_losses(out)[-2:], logged_losses(full)[-2:], rtol=2e-4, atol=0)


def test_consolidate_checkpoint_to_from_pretrained(full_runs, tmp_path):
    _, full_out = full_runs[3]
    out = tmp_path / "consolidated"
    proc = run([sys.executable, "-m", "hf_zero.cli.main", "consolidate", str(full_out / "checkpoint-4"), str(out), "--dtype", "fp32"])
    assert proc.returncode == 0
    consolidated = AutoModelForCausalLM.from_pretrained(out)
    saved = AutoModelForCausalLM.from_pretrained(full_out)  # save_model at the end of the same run (fp32)
    for name, tensor in saved.state_dict().items():
        torch.testing.assert_close(consolidated.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
