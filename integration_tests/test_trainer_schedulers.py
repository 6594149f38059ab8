"""Schedulers whose ``step()`` takes a metric (``--lr_scheduler_type reduce_lr_on_plateau``) at every
stage, in one process, against the plain Trainer: the same learning rates and losses, step by step.
"""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from hf_zero import ZeroTrainer, ZeroTrainingArguments

from _tiny import TINY, token_dataset




def _common(tmp_path, name):
    # threshold 0.5: no eval counts as an improvement, so with patience 0 the rate halves at every
    # evaluation after the first; a run that ignored the metric would keep 5e-3.
    return dict(output_dir=str(tmp_path / name), per_device_train_batch_size=4, max_steps=5, logging_steps=1,
                eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4, report_to="none",
                save_strategy="no", learning_rate=5e-3, seed=3, use_cpu=True, disable_tqdm=True,
                lr_scheduler_type="reduce_lr_on_plateau", metric_for_best_model="loss",
                lr_scheduler_kwargs={"patience": 0, "factor": 0.5, "threshold": 0.5})


def _history(trainer):
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    return lrs, losses, evals


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plain")
    trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(TINY), args=TrainingArguments(**_common(tmp, "plain")),
                      train_dataset=token_dataset(), eval_dataset=token_dataset(8, seed=12))
    trainer.train()
    return _history(trainer)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_reduce_lr_on_plateau_steps_on_the_eval_metric(tmp_path, plain, stage):
    args = ZeroTrainingArguments(zero_config={"zero_optimization": {"stage": stage},
                                              "train_micro_batch_size_per_gpu": "auto"}, **_common(tmp_path, "zero"))
    trainer = ZeroTrainer(model=AutoModelForCausalLM.from_pretrained(TINY), args=args, train_dataset=token_dataset(),
                          eval_dataset=token_dataset(8, seed=12))
    trainer.train()
    lrs, losses, evals = _history(trainer)
    plain_lrs, plain_losses, plain_evals = plain
    assert plain_lrs[0] == 5e-3 and plain_lrs[-1] < plain_lrs[0]  # the reference really reduced it
    assert lrs == pytest.approx(plain_lrs, rel=1e-6)
    assert losses == pytest.approx(plain_losses, rel=2e-3)
    assert evals == pytest.approx(plain_evals, rel=2e-3)
