"""A PEFT LoRA model trained by ZeroTrainer at stages 0-3 trains, saves and generates as under the
plain Trainer: the logged losses, the saved adapter (read back from ``adapter_model.safetensors``
and loaded with ``PeftModel.from_pretrained``) and the greedy ``generate()`` output after
``train()``. One process, against transformers' own Trainer on a model built the same way."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from _tiny import TINY, make_trainer

PROMPT = [[5, 17, 42, 99, 7, 250]]


def _lora_model():
    torch.manual_seed(0)  # LoRA A is initialised at random: the same draw for every run
    base = AutoModelForCausalLM.from_pretrained(TINY)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


def _train(tmp_path, stage):
    name = "plain" if stage is None else f"zero{stage}"
    trainer = make_trainer(tmp_path, stage, model=_lora_model(), learning_rate=2e-2)
    trainer.train()
    out = tmp_path / f"{name}-adapter"
    trainer.save_model(str(out))
    trainer.model.eval()
    with torch.no_grad():
        generated = _generate(trainer.model)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, out, generated


def _generate(model):
    """Greedy tokens and the scores each step chose from (the scores show the adapter is applied)."""
    out = model.generate(input_ids=torch.tensor(PROMPT), attention_mask=torch.ones(1, len(PROMPT[0]), dtype=torch.long),
                         max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_scores=True)
    return out.sequences.tolist(), torch.stack(out.scores)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("lora"), None)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_lora_trains_saves_and_generates_as_with_the_plain_trainer(tmp_path, plain, stage):
    plain_losses, plain_dir, plain_generated = plain
    losses, out, generated = _train(tmp_path, stage)
    assert len(losses) == 3
    assert losses == pytest.approx(plain_losses, rel=2e-3)

    # Only the adapter is written, with the plain Trainer's keys, dtypes and values.
    assert not (out / "model.safetensors").exists()
    saved, reference = load_file(out / "adapter_model.safetensors"), load_file(plain_dir / "adapter_model.safetensors")
    assert set(saved) == set(reference) and saved
    for key, value in reference.items():
        assert saved[key].dtype == value.dtype, key
        torch.testing.assert_close(saved[key], value, rtol=1e-4, atol=1e-6, msg=key)
    assert any(float(v.abs().sum()) > 0 for k, v in saved.items() if "lora_B" in k)  # LoRA B starts at 0

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(TINY), out)
    for key, value in reference.items():
        name = key.replace(".weight", ".default.weight")
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=1e-4, atol=1e-6, msg=key)

    # generate() after train(): the plain model's greedy tokens, from the same scores, which the
    # trained adapter changed (the base model's scores differ).
    assert generated[0] == plain_generated[0]
    torch.testing.assert_close(generated[1], plain_generated[1], rtol=1e-3, atol=1e-4)
    with torch.no_grad():
        _, base_scores = _generate(AutoModelForCausalLM.from_pretrained(TINY).eval())
    assert (base_scores - plain_generated[1]).abs().max() > 1e-2
