"""A model handed to a second Trainer after training (evaluate it, train it again, a notebook's next
cell), and a Trainer that evaluates before it trains, at every stage against the plain Trainer."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from hf_zero import ZeroTrainer, ZeroTrainingArguments

from _tiny import TINY, token_dataset




def _common(tmp_path, name):
    return dict(output_dir=str(tmp_path / name), per_device_train_batch_size=4, max_steps=3, logging_steps=1,
                report_to="none", save_strategy="no", learning_rate=5e-3, seed=3, use_cpu=True, disable_tqdm=True)


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _sequence(make, model):
    """Train with one trainer, then evaluate and train again with a second one on the same model."""
    first = make(model, "first")
    first.train()
    second = make(model, "second")
    evaluated = second.evaluate()["eval_loss"]
    second.train()
    return _losses(first), evaluated, _losses(second)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plain")

    def make(model, name):
        return Trainer(model=model, args=TrainingArguments(**_common(tmp, name)), train_dataset=token_dataset(),
                       eval_dataset=token_dataset(8, seed=12))

    return _sequence(make, AutoModelForCausalLM.from_pretrained(TINY))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_second_trainer_on_the_trained_model(tmp_path, plain, stage):
    def make(model, name):
        args = ZeroTrainingArguments(zero_config={"zero_optimization": {"stage": stage},
                                                  "train_micro_batch_size_per_gpu": "auto"}, **_common(tmp_path, name))
        return ZeroTrainer(model=model, args=args, train_dataset=token_dataset(), eval_dataset=token_dataset(8, seed=12))

    first, evaluated, second = _sequence(make, AutoModelForCausalLM.from_pretrained(TINY))
    plain_first, plain_evaluated, plain_second = plain
    assert first == pytest.approx(plain_first, rel=2e-3)
    assert evaluated == pytest.approx(plain_evaluated, rel=2e-3)  # the second trainer sees the trained weights
    assert second == pytest.approx(plain_second, rel=2e-3)


def test_second_trainer_with_another_layout_says_what_to_do(tmp_path):
    def make(model, stage):
        args = ZeroTrainingArguments(zero_config={"zero_optimization": {"stage": stage},
                                                  "train_micro_batch_size_per_gpu": "auto"}, **_common(tmp_path, f"s{stage}"))
        return ZeroTrainer(model=model, args=args, train_dataset=token_dataset())

    model = AutoModelForCausalLM.from_pretrained(TINY)
    make(model, 3).train()
    with pytest.raises(ValueError, match=r"stage 3 then, 2 now.*save_model"):
        make(model, 2).train()
