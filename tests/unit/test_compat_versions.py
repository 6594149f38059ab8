"""integration/compat_versions.py against the installed transformers: the hooks it assumes are the
ones the installed Trainer has and calls, in the order it calls them; checkpoint rotation as the
Trainer's own; the table documents every row.

Run under each corner of scripts/test_versions.sh (transformers 4.56 to 5.x), these tests fail
when a release moves one of the steps the inline-loop adapter relies on.
"""

from __future__ import annotations

import inspect
import os
import time

import pytest
import transformers
from transformers import Trainer

from hf_zero.integration import compat_versions as cv


def _loop_source() -> str:
    return inspect.getsource(Trainer._inner_training_loop)


def test_loop_hooks_detected_from_what_the_loop_calls():
    """The reference is the loop's own source: it either calls _prepare_for_training and
    _clip_grad_norm, or does their work inline."""
    calls_hooks = "self._prepare_for_training(" in inspect.getsource(Trainer) and "self._clip_grad_norm(" in inspect.getsource(Trainer)
    assert cv.HAS_LOOP_HOOKS == calls_hooks
    assert (cv.LoopHooks is cv.InlineLoopHooks) == (not calls_hooks)


@pytest.mark.skipif(cv.HAS_LOOP_HOOKS, reason="transformers 5.3+: the loop calls the hooks itself")
def test_inline_loop_runs_the_steps_the_adapter_expects_in_order():
    source = _loop_source()
    steps = [
        "self._train_batch_size = batch_size",  # the batch size _inner_training_loop is given is the one used
        "self.create_optimizer_and_scheduler(num_training_steps=max_steps)",
        "model = self._wrap_model(self.model_wrapped)",
        "self.accelerator.prepare(self.model, self.optimizer)",
        "self._load_optimizer_and_scheduler(resume_from_checkpoint)",
        "self._load_scaler(resume_from_checkpoint)",
        "self.accelerator.clip_grad_norm_(",
        "self.optimizer.step()",
        "self.accelerator.optimizer_step_was_skipped",
    ]
    positions = [source.find(step) for step in steps]
    assert all(p >= 0 for p in positions), dict(zip(steps, positions))
    assert positions == sorted(positions), dict(zip(steps, positions))
    # The adapter's overrides exist on this Trainer with the signatures it forwards to.
    for name in ("create_optimizer_and_scheduler", "_wrap_model", "_load_optimizer_and_scheduler", "_load_scaler"):
        assert callable(getattr(Trainer, name)), name
    assert list(inspect.signature(Trainer._wrap_model).parameters) == ["self", "model", "training", "dataloader"]


@pytest.mark.skipif(not cv.HAS_LOOP_HOOKS, reason="transformers < 5.3: no hooks")
def test_hook_signatures_are_the_ones_zero_trainer_overrides():
    params = lambda f: list(inspect.signature(f).parameters)  # noqa: E731
    assert params(Trainer._prepare_for_training) == ["self", "max_steps", "train_dataloader", "resume_from_checkpoint"]
    assert params(Trainer._clip_grad_norm) == ["self", "model"]
    assert params(Trainer._get_grad_norm) == ["self", "model", "grad_norm"]


def _trainer(tmp_path, limit):
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(2, 1)

        def forward(self, x, labels=None):
            return {"loss": self.w(x).sum()}

    args = transformers.TrainingArguments(output_dir=str(tmp_path), save_total_limit=limit, report_to="none", use_cpu=True)
    return Trainer(model=Tiny(), args=args)


@pytest.mark.parametrize("limit", [1, 2, None])
def test_rotate_checkpoints_keeps_the_newest(tmp_path, limit):
    trainer = _trainer(tmp_path, limit)
    names = [f"checkpoint-{n}" for n in (10, 2, 30, 4)]  # modification order, not step order
    now = time.time()
    for i, name in enumerate(names):
        os.makedirs(tmp_path / name)
        os.utime(tmp_path / name, (now - 100 + i, now - 100 + i))
    cv.rotate_checkpoints(trainer, str(tmp_path))
    kept = sorted(n for n in os.listdir(tmp_path) if n.startswith("checkpoint-"))
    expected = sorted(names if limit is None else names[-limit:])  # by modification time, as with use_mtime
    assert kept == expected


def test_every_change_is_in_the_table():
    table = cv.render_table()
    assert table.count("\n") == len(cv.CHANGES) + 2
    for change in cv.CHANGES:
        assert change.since in table and change.what.split("(")[0] in table
        major, minor, *_ = (int(x) for x in change.since.split("."))
        assert (major, minor) >= (4, 56)


def test_installed_versions_name_what_is_installed():
    import torch

    versions = cv.installed_versions()
    assert versions["transformers"] == transformers.__version__
    # PyPI's CUDA wheels are "2.9.1" to pip and "2.9.1+cu128" to torch; the CPU wheel is "+cpu" to both.
    assert versions["torch"].split("+")[0] == torch.__version__.split("+")[0]


@pytest.mark.skipif(cv.HAS_LOOP_HOOKS, reason="transformers 5.3+: the loop calls ZeroTrainer's hooks itself")
def test_zero_trainers_put_the_inline_loop_adapter_first():
    """Without it, transformers < 5.3 never calls _prepare_for_training: ZeroTrainer would train as
    a plain Trainer, with no engine and no ZeRO (and stage 3 would fail on low-memory loading)."""
    from hf_zero.integration.trainer import ZeroSeq2SeqTrainer, ZeroTrainer, ZeroTrainerMixin

    for cls in (ZeroTrainer, ZeroSeq2SeqTrainer):
        mro = cls.__mro__
        assert cv.InlineLoopHooks in mro, (
            f"{cls.__name__} needs compat_versions.LoopHooks as its first base: "
            f"class {cls.__name__}(LoopHooks, ZeroTrainerMixin, ...)")
        assert mro.index(cv.InlineLoopHooks) < mro.index(ZeroTrainerMixin)


def test_docs_versions_shows_the_table():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "versions.md").read_text()
    start, end = "<!-- compat_versions table: begin -->\n", "<!-- compat_versions table: end -->"
    assert text.split(start)[1].split(end)[0] == cv.render_table(), (
        "docs/versions.md is out of date: paste compat_versions.render_table() between its markers")
