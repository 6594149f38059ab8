"""Models with 0-dim parameters (CLIP's ``logit_scale``, the Trainer's own regression test models)
train at every stage as with the plain Trainer, and save with their original names and shapes."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainingArguments

from hf_zero import ZeroTrainer, ZeroTrainingArguments


class ScalarConfig(PretrainedConfig):
    model_type = "hf_zero_scalar_test"

    def __init__(self, hidden=8, **kw):
        self.hidden = hidden
        super().__init__(**kw)


class ScalarModel(PreTrainedModel):
    """y = a * head(x) + b, with ``a`` and ``b`` 0-dim, as in transformers' RegressionModel, plus a
    ``logit_scale`` used through ``.exp()`` as CLIP does."""

    config_class = ScalarConfig

    def __init__(self, config):
        super().__init__(config)
        self.head = nn.Linear(config.hidden, 1)
        self.a = nn.Parameter(torch.tensor(0.5))
        self.b = nn.Parameter(torch.tensor(0.0))
        self.logit_scale = nn.Parameter(torch.tensor(0.1))
        self.post_init()

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.manual_seed(0)
            module.weight.data.normal_(0, 0.5)
            module.bias.data.zero_()

    def forward(self, input_x, labels=None):
        assert self.a.dim() == 0 and self.logit_scale.dim() == 0  # the model's code sees scalars
        y = self.a * self.head(input_x).squeeze(-1) * self.logit_scale.exp() + self.b
        loss = nn.functional.mse_loss(y, labels) if labels is not None else None
        return {"loss": loss, "logits": y}


def _data(n=32):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.linspace(-1, 1, 8) + 0.3
    return Dataset.from_dict({"input_x": x.tolist(), "labels": y.tolist()})


def _model():
    torch.manual_seed(0)
    return ScalarModel(ScalarConfig())


def _args(tmp_path, name):
    return dict(output_dir=str(tmp_path / name), per_device_train_batch_size=8, max_steps=4, logging_steps=1,
                report_to="none", save_strategy="no", learning_rate=5e-2, seed=3, use_cpu=True)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_scalar_parameters_train_and_save_as_scalars(tmp_path, stage):
    plain = Trainer(model=_model(), args=TrainingArguments(**_args(tmp_path, "plain")), train_dataset=_data())
    plain.train()
    want = [h["loss"] for h in plain.state.log_history if "loss" in h]

    cfg = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto"}
    zero = ZeroTrainer(model=_model(), args=ZeroTrainingArguments(zero_config=cfg, **_args(tmp_path, "zero")),
                       train_dataset=_data())
    zero.train()
    got = [h["loss"] for h in zero.state.log_history if "loss" in h]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-3, atol=0)
    assert got[-1] < got[0]

    zero.save_model()
    reloaded = ScalarModel.from_pretrained(tmp_path / "zero")
    for name in ("a", "b", "logit_scale"):
        value = getattr(reloaded, name)
        assert value.shape == torch.Size([]), name
        torch.testing.assert_close(value.float(), getattr(plain.model, name).detach().float(), rtol=2e-3, atol=1e-5)
    assert not torch.equal(reloaded.a, torch.tensor(0.5)), "a did not train"


def test_scalar_parameters_resume_and_consolidate_at_stage3(tmp_path):
    from hf_zero.checkpoint.consolidate import consolidate_checkpoint

    cfg = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False},
           "train_micro_batch_size_per_gpu": "auto"}
    kw = {**_args(tmp_path, "zero"), "save_strategy": "steps", "save_steps": 2}
    full = ZeroTrainer(model=_model(), args=ZeroTrainingArguments(zero_config=cfg, **kw), train_dataset=_data())
    full.train()
    want = [h["loss"] for h in full.state.log_history if "loss" in h]
    resumed = ZeroTrainer(model=_model(), args=ZeroTrainingArguments(zero_config=cfg, **kw), train_dataset=_data())
    resumed.train(resume_from_checkpoint=str(tmp_path / "zero" / "checkpoint-2"))
    got = [h["loss"] for h in resumed.state.log_history if "loss" in h]
    torch.testing.assert_close(torch.tensor(got[-2:]), torch.tensor(want[-2:]), rtol=1e-5, atol=0)

    consolidate_checkpoint(tmp_path / "zero" / "checkpoint-4", tmp_path / "merged")
    merged = ScalarModel.from_pretrained(tmp_path / "merged")
    assert merged.logit_scale.shape == torch.Size([])
    assert not torch.equal(merged.a, torch.tensor(0.5))
