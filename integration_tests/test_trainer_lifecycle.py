"""The Trainer's lifecycle around the engine, in one process, against the plain Trainer.

``model_init`` with two ``train()`` calls (what ``hyperparameter_search`` does): the second call
builds a fresh model, which must be the one that trains, as with the plain Trainer.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from hf_zero import ZeroTrainer, ZeroTrainingArguments
from hf_zero.checkpoint.export16 import gather_full_state_dict

from _tiny import TINY, token_dataset




def _model_init():
    return AutoModelForCausalLM.from_pretrained(TINY)


def _common(tmp_path, name):
    return dict(output_dir=str(tmp_path / name), per_device_train_batch_size=4, max_steps=3, logging_steps=1,
                report_to="none", save_strategy="no", learning_rate=5e-3, seed=3, use_cpu=True)


def _losses(trainer, since=0):
    return [h["loss"] for h in trainer.state.log_history[since:] if "loss" in h]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_init_second_train_trains_the_new_model(tmp_path, stage):
    plain = Trainer(model_init=_model_init, args=TrainingArguments(**_common(tmp_path, "plain")), train_dataset=token_dataset())
    plain.train()
    plain.train()
    want = _losses(plain)
    want_weights = {k: v.detach().clone() for k, v in plain.model.state_dict().items()}

    cfg = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto"}
    zero = ZeroTrainer(model_init=_model_init, args=ZeroTrainingArguments(zero_config=cfg, **_common(tmp_path, "zero")),
                       train_dataset=token_dataset())
    zero.train()
    first_model = zero.model
    zero.train()
    assert zero.model is not first_model, "the Trainer's model_init should have built a new model"
    got = _losses(zero)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-3, atol=0)
    # The model the user gets back is the trained one: equal to the plain Trainer's, not the initial weights.
    trained = gather_full_state_dict(zero.model)
    initial = _model_init().state_dict()
    changed = [k for k in want_weights if not torch.equal(trained[k].float(), initial[k].float())]
    assert changed, "the second model was never trained"
    for k, v in want_weights.items():
        torch.testing.assert_close(trained[k].float(), v.float(), rtol=2e-3, atol=2e-5, msg=k)
