"""Resume through the Trainer gives the losses of an uninterrupted run: same ranks, 2 -> 1, 1 -> 2,
and stage 2 -> stage 3; ``hf-zero consolidate`` turns a checkpoint into a from_pretrained folder."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from _run import FINETUNE, hf_zero_run, logged_losses, run, write_config, zero_config

pytestmark = pytest.mark.slow
GLOBAL_BATCH = 4
COMMON = ["--max_steps", "4", "--logging_steps", "1", "--report_to", "none", "--learning_rate", "2e-3",
          "--seed", "7", "--save_strategy", "steps", "--save_steps", "2", "--max_grad_norm", "1.0"]


RUN_SEVERAL = "integration_tests/scripts/run_several.py"


def _args(nproc: int, cfg: Path, out: Path, *extra: str) -> list[str]:
    return [FINETUNE, "--zero_config", str(cfg), "--output_dir", str(out),
            "--per_device_train_batch_size", str(GLOBAL_BATCH // nproc), *COMMON, *extra]


def _launch(nproc: int, root: Path, runs: dict[str, list[str]]) -> None:
    """The runs one after the other in one ``hf-zero run`` launch (scripts/run_several.py): one
    interpreter start and one import of torch and transformers per rank for all of them."""
    several = [arg for name, args in runs.items() for arg in ("+++", name, *args)]
    hf_zero_run(nproc, RUN_SEVERAL, str(root / "logs"), *several)


def _resumable(root: Path, name: str, checkpoint: Path) -> Path:
    """An output folder holding only ``checkpoint``, as a run interrupted after it leaves it."""
    out = root / name
    out.mkdir()
    shutil.copytree(checkpoint, out / checkpoint.name)
    return out


RESUMES = [(3, 3, 2), (3, 3, 1), (2, 3, 2), (2, 2, 1)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of this file in three launches (it was eight, one per run): uninterrupted 4-step
    runs at stages 2 and 3 on 2 ranks and at stage 3 on 1 rank (checkpoints at steps 2 and 4), then
    each resume of :data:`RESUMES` and the 1 -> 2 resume from ``checkpoint-2``.

    A launch decides low-memory loading from its first ZeRO config (hf-zero run reads the command
    line): the 2-rank launch that holds both stages starts with stage 2, so both of its runs load
    the weights on every rank; the resume launch on 2 ranks is all stage 3 and loads on rank 0 only.
    Either way every rank starts from rank 0's weights, which is all a resume depends on."""
    root = tmp_path_factory.mktemp("resume")
    cfg = {stage: write_config(root / f"ds{stage}.json", zero_config(stage)) for stage in (2, 3)}
    full = {(2, 2): root / "full2", (3, 2): root / "full3", (3, 1): root / "full3-1rank"}
    _launch(2, root / "two_ranks", {"full2": _args(2, cfg[2], full[2, 2]), "full3": _args(2, cfg[3], full[3, 2])})

    resumed: dict = {}
    one_rank = {"full3-1rank": _args(1, cfg[3], full[3, 1])}
    two_ranks = {}
    for save_stage, resume_stage, nproc in RESUMES:
        name = f"resume-s{save_stage}-to-s{resume_stage}-on{nproc}"
        out = _resumable(root, name, full[save_stage, 2] / "checkpoint-2")
        resumed[save_stage, resume_stage, nproc] = out
        (one_rank if nproc == 1 else two_ranks)[name] = _args(nproc, cfg[resume_stage], out, "--resume_from_checkpoint",
                                                               str(out / "checkpoint-2"))
    _launch(1, root / "one_rank", one_rank)
    out = _resumable(root, "resume-1rank-to-2", full[3, 1] / "checkpoint-2")
    resumed["1to2"] = out
    two_ranks["resume-1rank-to-2"] = _args(2, cfg[3], out, "--resume_from_checkpoint", str(out / "checkpoint-2"))
    _launch(2, root / "two_ranks_resume", two_ranks)
    return {"full": full, "resumed": resumed}


@pytest.mark.parametrize(
    "save_stage,resume_stage,resume_nproc",
    RESUMES,
    ids=["stage3-2to2", "stage3-2to1", "stage2to3-2to2", "stage2-2to1"],
)
def test_resume_continues_the_same_losses(runs, save_stage, resume_stage, resume_nproc):
    reference = logged_losses(runs["full"][save_stage, 2])
    resumed = logged_losses(runs["resumed"][save_stage, resume_stage, resume_nproc])
    # trainer_state.json keeps the two logged steps from before the checkpoint.
    torch.testing.assert_close(resumed[-2:], reference[-2:], rtol=2e-4, atol=0)


def test_resume_one_rank_to_two(runs):
    full, out = runs["full"][3, 1], runs["resumed"]["1to2"]
    torch.testing.assert_close(logged_losses(out)[-2:], logged_losses(full)[-2:], rtol=2e-4, atol=0)


def test_consolidate_checkpoint_to_from_pretrained(runs, tmp_path):
    full_out = runs["full"][3, 2]
    out = tmp_path / "consolidated"
    proc = run([sys.executable, "-m", "hf_zero.cli.main", "consolidate", str(full_out / "checkpoint-4"), str(out), "--dtype", "fp32"])
    assert proc.returncode == 0
    consolidated = AutoModelForCausalLM.from_pretrained(out)
    saved = AutoModelForCausalLM.from_pretrained(full_out)  # save_model at the end of the same run (fp32)
    for name, tensor in saved.state_dict().items():
        torch.testing.assert_close(consolidated.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
