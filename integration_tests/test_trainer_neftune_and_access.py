"""NEFTune (``neftune_noise_alpha``) at every stage against the plain Trainer, and the trained model
used outside its forward at stages 2/3: a clear error, and ``hf_zero.gathered_parameters`` to do it.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import hf_zero
from hf_zero import ZeroTrainer, ZeroTrainingArguments
from hf_zero.checkpoint.export16 import gather_full_state_dict
from hf_zero.engine.sharded_access import ShardedParameterError

from _tiny import TINY, token_dataset




def _common(tmp_path, name, **kw):
    args = dict(output_dir=str(tmp_path / name), per_device_train_batch_size=4, max_steps=4, logging_steps=1,
                report_to="none", save_strategy="no", learning_rate=5e-3, seed=3, use_cpu=True, disable_tqdm=True)
    args.update(kw)
    return args


def _zero(tmp_path, stage, **kw):
    args = ZeroTrainingArguments(zero_config={"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto"},
                                 **_common(tmp_path, f"zero{stage}", **kw))
    return ZeroTrainer(model=AutoModelForCausalLM.from_pretrained(TINY), args=args, train_dataset=token_dataset())


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.fixture(scope="module")
def plain_neftune(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plain")
    trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(TINY),
                      args=TrainingArguments(**_common(tmp, "plain", neftune_noise_alpha=50.0)), train_dataset=token_dataset())
    trainer.train()
    quiet = Trainer(model=AutoModelForCausalLM.from_pretrained(TINY), args=TrainingArguments(**_common(tmp, "quiet")),
                    train_dataset=token_dataset())
    quiet.train()
    # The noise changes the run, so matching the noisy reference proves the noise is applied.
    assert max(abs(a - b) / b for a, b in zip(_losses(trainer), _losses(quiet))) > 1e-2
    return _losses(trainer)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_neftune_trains_as_with_the_plain_trainer(tmp_path, plain_neftune, stage):
    trainer = _zero(tmp_path, stage, neftune_noise_alpha=50.0)
    trainer.train()
    assert _losses(trainer) == pytest.approx(plain_neftune, rel=2e-3)
    embed = trainer.accelerator.unwrap_model(trainer.model).get_input_embeddings()
    assert not embed._forward_hooks  # the noise hook is gone after train(), as with the plain Trainer


@pytest.mark.parametrize("stage", [2, 3])
def test_model_used_after_training(tmp_path, stage):
    trainer = _zero(tmp_path, stage)
    trainer.train()
    model, ids = trainer.model, torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ShardedParameterError, match=r"model\.embed_tokens.*hf_zero\.gathered_parameters\(model\)"):
        model.get_input_embeddings()(ids)
    weight = gather_full_state_dict(model)["model.embed_tokens.weight"]
    with hf_zero.gathered_parameters(model) as full:
        vectors = full.get_input_embeddings()(ids)
        logits = full(ids).logits
    torch.testing.assert_close(vectors, weight[ids].to(vectors.dtype), rtol=0, atol=0)
    assert logits.shape == (1, 4, full.config.vocab_size)
    assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())  # sharded again
    assert torch.equal(model(ids).logits, logits)  # the model itself works either way
