"""What ``ZeroTrainer`` saves can be trusted: the model folder is the one the plain Trainer writes, a
completed checkpoint folder was whole before it got its name, and a save killed at any step leaves
the previous model or checkpoint complete (a real SIGKILL, in integration_tests/scripts/save_kill_worker.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

from hf_zero import ZeroTrainer, ZeroTrainingArguments
from hf_zero.checkpoint.export16 import gather_full_state_dict

from _run import REPO
from _tiny import TINY, token_dataset

WORKER = REPO / "integration_tests" / "scripts" / "save_kill_worker.py"



def _zero_trainer(tmp_path, stage=3, **kw):
    args = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=2, report_to="none",
                save_strategy="no", learning_rate=5e-3, seed=3, disable_tqdm=True)
    args.update(kw)
    cfg = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto"}
    return ZeroTrainer(model=AutoModelForCausalLM.from_pretrained(TINY), args=ZeroTrainingArguments(zero_config=cfg, **args),
                       train_dataset=token_dataset(), processing_class=AutoTokenizer.from_pretrained(TINY))


def _weights(directory) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(os.listdir(directory)) if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(directory, f)).items()}


@pytest.mark.parametrize("stage", [0, 3])
def test_save_model_writes_what_the_plain_trainer_writes(tmp_path, stage):
    trainer = _zero_trainer(tmp_path, stage)
    trainer.train()
    trainer.save_model(str(tmp_path / "ours"))
    # The reference: the plain Trainer saving a model holding the same weights.
    model = AutoModelForCausalLM.from_pretrained(TINY)
    model.load_state_dict(gather_full_state_dict(trainer.model))
    plain = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path / "plain"), report_to="none", use_cpu=True),
                    processing_class=AutoTokenizer.from_pretrained(TINY))
    plain.save_model(str(tmp_path / "theirs"))
    assert sorted(os.listdir(tmp_path / "ours")) == sorted(os.listdir(tmp_path / "theirs"))
    ours, theirs = _weights(tmp_path / "ours"), _weights(tmp_path / "theirs")
    assert ours.keys() == theirs.keys()
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "theirs" / name).read_bytes(), name
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]  # no temporary folder left


def test_checkpoint_folder_is_whole_before_it_gets_its_name(tmp_path, monkeypatch):
    """Everything in checkpoint-N was written before the rename that makes it visible."""
    from hf_zero.checkpoint import atomic_dir

    at_rename: dict[str, dict[str, int]] = {}
    real = atomic_dir.replace_directory

    def listing(root):
        return {os.path.relpath(os.path.join(d, f), root): os.path.getsize(os.path.join(d, f))
                for d, _, files in os.walk(root) for f in files}

    def replace_directory(new, final):
        if os.path.basename(final).startswith("checkpoint-"):
            at_rename[os.path.basename(final)] = listing(new)
        real(new, final)

    monkeypatch.setattr(atomic_dir, "replace_directory", replace_directory)
    trainer = _zero_trainer(tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
    trainer.train()
    out = tmp_path / "out"
    assert sorted(at_rename) == ["checkpoint-2", "checkpoint-4"]
    for name, files in at_rename.items():
        assert listing(out / name) == files, name  # nothing added or changed after the rename
        assert {"trainer_state.json", "training_args.bin", "zero_state/hf_zero_checkpoint.json"} <= set(files)


def _worker(out, *args, expect_kill: bool):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, str(WORKER), str(out), *args], capture_output=True, text=True,
                          env=env, timeout=300, cwd=REPO)
    if expect_kill:
        assert proc.returncode == -9, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        assert "NOT KILLED" not in proc.stdout
    else:
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.mark.slow
def test_save_model_killed_mid_file_leaves_the_previous_model(tmp_path):
    out = tmp_path / "run"
    _worker(out, "--kill", "model_shard", expect_kill=True)
    model_dir, reference = out / "model", out / "reference"
    assert sorted(os.listdir(model_dir)) == sorted(os.listdir(reference))
    for name in os.listdir(reference):
        assert (model_dir / name).read_bytes() == (reference / name).read_bytes(), name
    AutoModelForCausalLM.from_pretrained(model_dir)  # complete and loadable


@pytest.mark.slow
def test_checkpoint_replacement_killed_midway_is_recovered_and_resumes(tmp_path):
    """Killed after checkpoint-2 moved aside, before its replacement moved in (no atomic swap)."""
    out = tmp_path / "run"
    _worker(out, "--kill", "checkpoint_aside", expect_kill=True)
    names = os.listdir(out)
    assert "checkpoint-2" not in names and any(n.startswith("checkpoint-2.old-") for n in names)
    proc = _worker(out, "--resume", expect_kill=False)
    assert f"LAST_CHECKPOINT {out / 'checkpoint-2'}" in proc.stdout
    assert "RESUMED_TO 3" in proc.stdout
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-2", "checkpoint-3"]
    restored = out / "checkpoint-2"
    for root, _, files in os.walk(out / "reference"):
        for f in files:
            rel = os.path.relpath(os.path.join(root, f), out / "reference")
            assert (restored / rel).read_bytes() == (out / "reference" / rel).read_bytes(), rel
