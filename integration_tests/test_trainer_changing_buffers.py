"""Resume of a model whose buffers change shape during training, as the plain Trainer resumes it.

The model keeps a history of recent batch statistics in a buffer that grows as it trains and that
the forward uses, and resizes it on load (``_load_from_state_dict``), as modules with running
histories do. A resume that refused the checkpoint, or loaded the buffer wrong, shows in the losses
after the checkpoint.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from torch import nn
from _scalar_model import SeededHeadModel
from transformers import PretrainedConfig, Trainer, TrainingArguments

from hf_zero import ZeroTrainer, ZeroTrainingArguments


class HistoryConfig(PretrainedConfig):
    model_type = "hf_zero_history_test"

    def __init__(self, hidden=8, keep=6, **kw):
        self.hidden = hidden
        self.keep = keep
        super().__init__(**kw)


class HistoryModel(SeededHeadModel):
    """A regression head whose output is shifted by the mean of the last ``keep`` batch means of
    the targets seen in training (a buffer of 0, 1, ..., ``keep`` elements)."""

    config_class = HistoryConfig

    def __init__(self, config):
        super().__init__(config)
        self.head = nn.Linear(config.hidden, 1)
        self.register_buffer("history", torch.zeros(0))
        self.post_init()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        saved = state_dict.get(prefix + "history")
        if saved is not None and saved.shape != self.history.shape:
            self.history = torch.zeros_like(saved, device=self.history.device)  # resize to what was saved
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, input_x, labels=None):
        shift = self.history.mean() if self.history.numel() else torch.zeros((), device=input_x.device)
        y = self.head(input_x).squeeze(-1) + shift
        loss = nn.functional.mse_loss(y, labels) if labels is not None else None
        if self.training and labels is not None:
            self.history = torch.cat([self.history, labels.detach().mean().reshape(1)])[-self.config.keep:]
        return {"loss": loss, "logits": y}


def _data(n=48):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.linspace(-1, 1, 8) + 3.0 * torch.rand(n, generator=g)
    return Dataset.from_dict({"input_x": x.tolist(), "labels": y.tolist()})


def _model():
    torch.manual_seed(0)
    return HistoryModel(HistoryConfig())


def _args(tmp_path, name):
    return dict(output_dir=str(tmp_path / name), per_device_train_batch_size=8, max_steps=6, logging_steps=1,
                report_to="none", save_strategy="steps", save_steps=2, learning_rate=5e-2, seed=3, use_cpu=True)


def _losses(trainer):
    return torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_restores_a_buffer_that_changed_shape(tmp_path, stage):
    plain = Trainer(model=_model(), args=TrainingArguments(**_args(tmp_path, "plain")), train_dataset=_data())
    plain.train()
    plain_resumed = Trainer(model=_model(), args=TrainingArguments(**_args(tmp_path, "plain")), train_dataset=_data())
    plain_resumed.train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-2"))
    want = _losses(plain)
    # The plain Trainer restores the 2-element history (the run that forgot it would differ).
    torch.testing.assert_close(_losses(plain_resumed)[-4:], want[-4:], rtol=1e-5, atol=0)

    cfg = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto"}
    zero = ZeroTrainer(model=_model(), args=ZeroTrainingArguments(zero_config=cfg, **_args(tmp_path, "zero")),
                       train_dataset=_data())
    zero.train()
    torch.testing.assert_close(_losses(zero), want, rtol=2e-3, atol=0)
    resumed_model = _model()
    resumed = ZeroTrainer(model=resumed_model, args=ZeroTrainingArguments(zero_config=cfg, **_args(tmp_path, "zero")),
                          train_dataset=_data())
    resumed.train(resume_from_checkpoint=str(tmp_path / "zero" / "checkpoint-2"))
    torch.testing.assert_close(_losses(resumed)[-4:], _losses(zero)[-4:], rtol=1e-5, atol=0)
    torch.testing.assert_close(resumed_model.history.cpu(), zero.model.history.cpu())


def test_parameters_of_another_shape_are_still_refused(tmp_path):
    """Only buffers may differ: a checkpoint whose parameters have other shapes is another model."""
    cfg = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}
    kw = {**_args(tmp_path, "zero"), "max_steps": 2}
    ZeroTrainer(model=_model(), args=ZeroTrainingArguments(zero_config=cfg, **kw), train_dataset=_data()).train()
    torch.manual_seed(0)
    wider = HistoryModel(HistoryConfig(hidden=4))
    other = ZeroTrainer(model=wider, args=ZeroTrainingArguments(zero_config=cfg, **{**kw, "max_steps": 4}),
                        train_dataset=_data().map(lambda r: {"input_x": r["input_x"][:4]}))
    with pytest.raises(Exception, match="saved from a different model") as info:
        other.train(resume_from_checkpoint=str(tmp_path / "zero" / "checkpoint-2"))
    assert "head.weight" in str(info.value) and "history" not in str(info.value)
