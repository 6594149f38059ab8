"""A model with 0-dim parameters (transformers' RegressionModel ``y = a * x + b``, plus CLIP's
``logit_scale``), its data, and what a trained optimizer says about how often it updated each
parameter; shared by test_trainer_scalar_params.py and scripts/two_rank_options.py."""

from __future__ import annotations

import torch
from datasets import Dataset
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

SCALARS = ("a", "b", "logit_scale")


class ScalarConfig(PretrainedConfig):
    model_type = "hf_zero_scalar_test"

    def __init__(self, hidden=8, **kw):
        self.hidden = hidden
        super().__init__(**kw)


class SeededHeadModel(PreTrainedModel):
    """A tiny model whose ``nn.Linear`` layers start from the same seeded weights in every run."""

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.manual_seed(0)
            module.weight.data.normal_(0, 0.5)
            module.bias.data.zero_()


class ScalarModel(SeededHeadModel):
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

    def forward(self, input_x, labels=None):
        assert self.a.dim() == 0 and self.logit_scale.dim() == 0  # the model's code sees scalars
        y = self.a * self.head(input_x).squeeze(-1) * self.logit_scale.exp() + self.b
        loss = nn.functional.mse_loss(y, labels) if labels is not None else None
        return {"loss": loss, "logits": y}


def scalar_dataset(n: int = 32) -> Dataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.linspace(-1, 1, 8) + 0.3
    return Dataset.from_dict({"input_x": x.tolist(), "labels": y.tolist()})


def scalar_model() -> ScalarModel:
    torch.manual_seed(0)
    return ScalarModel(ScalarConfig())


def update_counts(trainer) -> dict:
    """How the trainer's optimizer holds the model's parameters after training, as the Trainer's
    loop sees it (``trainer.optimizer``): ``listed`` how many times each trainable parameter sits in
    the param groups, ``foreign`` how many listed tensors are not the model's parameters, ``steps``
    each state entry's step counter (a parameter listed twice is updated twice per step)."""
    listed = [id(p) for group in trainer.optimizer.param_groups for p in group["params"]]
    trainable = [id(p) for p in trainer.model.parameters() if p.requires_grad]
    steps = {}
    for key, entry in trainer.optimizer.state_dict()["state"].items():
        if "step" in entry:
            step = entry["step"]
            steps[str(key)] = float(step.full_tensor() if hasattr(step, "full_tensor") else step)
    return {"listed": [listed.count(i) for i in trainable], "foreign": len(set(listed) - set(trainable)),
            "steps": steps}
