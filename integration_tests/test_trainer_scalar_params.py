"""Models with 0-dim parameters (CLIP's ``logit_scale``, the Trainer's own regression test models)
train at every stage as with the plain Trainer, and save with their original names and shapes.

At stages 2/3 hf_zero stores each 0-dim parameter as a 1-element shard behind a parametrization.
Each parameter must still be stepped exactly once per update, whatever builds the optimizer (the
config's ``optimizer`` section, offloaded or not; the Trainer's own; one the user passes, built
over ``model.parameters()`` before hf_zero lifted the scalars), and ``trainer.model.a`` must read
the trained value after ``train()``. The 2-rank case runs in ``scripts/two_rank_options.py``
(``test_trainer_two_ranks.py``).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import Trainer, TrainingArguments

from hf_zero import ZeroTrainer, ZeroTrainingArguments

from _scalar_model import SCALARS, ScalarModel, scalar_dataset, scalar_model, update_counts


def _data():
    return scalar_dataset()


def _model():
    return scalar_model()


def _args(tmp_path, name, **kw):
    return dict(output_dir=str(tmp_path / name), per_device_train_batch_size=8, max_steps=4, logging_steps=1,
                report_to="none", save_strategy="no", learning_rate=5e-2, seed=3, use_cpu=True, **kw)


def _losses(trainer):
    return torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h])


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


# ------------------------------------------------------------------ each parameter stepped once
# The config's optimizer sections, and the same update built by hand over model.parameters() for the
# plain Trainer (torch's classes; Lion, Lamb and Muon have no torch counterpart with DeepSpeed's math,
# so their classes step the reference, where each parameter is listed once by construction).
_BETAS, _WD = (0.9, 0.99), 0.01
_SECTIONS = {
    "Adam": ({"adam_w_mode": False, "betas": _BETAS, "eps": 1e-8},
             lambda groups, lr: torch.optim.Adam(groups, lr=lr, betas=_BETAS, eps=1e-8, weight_decay=_WD)),
    "AdamW": ({"betas": _BETAS, "eps": 1e-8}, lambda groups, lr: torch.optim.AdamW(groups, lr=lr, betas=_BETAS, eps=1e-8, weight_decay=_WD)),
    "SGD": ({"momentum": 0.9}, lambda groups, lr: torch.optim.SGD(groups, lr=lr, momentum=0.9, weight_decay=_WD)),
    "Lion": ({"betas": _BETAS}, lambda groups, lr: _hf_zero_optim("Lion")(groups, lr=lr, betas=_BETAS, weight_decay=_WD)),
    "Lamb": ({"betas": _BETAS, "eps": 1e-8}, lambda groups, lr: _hf_zero_optim("Lamb")(groups, lr=lr, betas=_BETAS, eps=1e-8,
                                                                      weight_decay=_WD)),
    "Muon": ({"betas": _BETAS, "eps": 1e-8, "momentum": 0.95},
             lambda groups, lr: _hf_zero_optim("MuonWithAuxAdam")(groups, lr=lr, momentum=0.95, weight_decay=_WD,
                                                                  adam_lr=lr, betas=_BETAS, eps=1e-8)),
}


def _hf_zero_optim(name):
    import hf_zero.optim

    return getattr(hf_zero.optim, name)


def _reference_groups(model, kind):
    if kind != "Muon":
        return list(model.parameters())
    # DeepSpeed's split: matrices to Muon, the rest (the head's bias, the scalars) to Adam
    return [{"params": [model.head.weight], "use_muon": True},
            {"params": [model.head.bias, model.a, model.b, model.logit_scale], "use_muon": False}]


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory):
    """The plain Trainer's losses and trained scalars, per optimizer (None: its own AdamW; else the
    section's update over ``model.parameters()``), each trained once for the module."""
    done = {}

    def get(kind=None):
        if kind not in done:
            model = _model()
            args = TrainingArguments(**_args(tmp_path_factory.mktemp("plain"), "out", weight_decay=_WD,
                                             adam_beta2=_BETAS[1]))
            optimizers = (None, None) if kind is None else (_SECTIONS[kind][1](_reference_groups(model, kind), 5e-2), None)
            trainer = Trainer(model=model, args=args, train_dataset=_data(), optimizers=optimizers)
            trainer.train()
            done[kind] = _losses(trainer), {n: getattr(model, n).item() for n in SCALARS}
        return done[kind]

    return get


def _assert_stepped_once_and_same_as(zero, plain):
    """Every trainable parameter sits once in the optimizer's groups, every step counter counts the
    updates, and the losses and the trained scalars (read as a user reads them) are the plain Trainer's."""
    counts = update_counts(zero)
    assert counts["listed"] == [1] * len(counts["listed"]) and counts["foreign"] == 0, counts
    assert set(counts["steps"].values()) <= {float(zero.state.global_step)}, counts
    # One process, the same fp32 kernels on the same values: FSDP2 at world size 1 reduce-scatters
    # by a copy, so the runs agree to fp32 rounding, a few ulp per op over the ~10^2 ops of 4 steps
    # (rtol 1e-5). A second update of a scalar per step moves the losses by percents (5.80 vs 6.07).
    plain_losses, plain_scalars = plain
    torch.testing.assert_close(_losses(zero), plain_losses, rtol=1e-5, atol=0)
    for name in SCALARS:
        value = getattr(zero.model, name)  # after train(): the trained value, read on every rank
        assert value.shape == torch.Size([]), name
        want = plain_scalars[name]
        assert value.item() == pytest.approx(want, rel=1e-5, abs=1e-7), name
        assert value.tolist() == pytest.approx(want, rel=1e-5, abs=1e-7), name
    assert zero.model.a.item() != 0.5, "a did not train"


# Stages 2 and 3 lift and group the same way (engine/stages.py FullyShardedStage): each optimizer runs at
# one of them without offload and at the other with optimizer offload, to keep the module short.
_CASES = [("Adam", 2, "none"), ("AdamW", 3, "none"), ("SGD", 2, "none"), ("Lion", 3, "none"), ("Lamb", 2, "none"),
          ("Muon", 3, "none"),  # Muon refuses optimizer offload (config/refused.py)
          ("Adam", 3, "cpu"), ("AdamW", 2, "cpu"), ("SGD", 3, "cpu"), ("Lion", 2, "cpu"), ("Lamb", 3, "cpu"),
          ("AdamW", 3, "nvme")]


@pytest.mark.parametrize("kind,stage,offload", _CASES)
def test_config_optimizer_steps_each_scalar_once(tmp_path, plain_runs, kind, stage, offload):
    section, _ = _SECTIONS[kind]
    zero_opt = {"stage": stage}
    if offload != "none":
        (tmp_path / "nvme").mkdir()
        zero_opt["offload_optimizer"] = {"device": offload, "nvme_path": str(tmp_path / "nvme")}
    cfg = {"zero_optimization": zero_opt, "train_micro_batch_size_per_gpu": "auto",
           "optimizer": {"type": kind, "params": {"lr": "auto", "weight_decay": "auto",
                                                   **section}}}
    args = ZeroTrainingArguments(zero_config=cfg, **_args(tmp_path, "zero", weight_decay=_WD, adam_beta2=_BETAS[1]))
    zero = ZeroTrainer(model=_model(), args=args, train_dataset=_data())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*duplicate parameters")
        zero.train()
    _assert_stepped_once_and_same_as(zero, plain_runs(kind))


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_optimizer_steps_each_scalar_once(tmp_path, plain_runs, stage):
    """No optimizer section: the Trainer's own AdamW, rebuilt on the shards."""
    cfg = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto"}
    args = ZeroTrainingArguments(zero_config=cfg, **_args(tmp_path, "zero", weight_decay=_WD, adam_beta2=_BETAS[1]))
    zero = ZeroTrainer(model=_model(), args=args, train_dataset=_data())
    zero.train()
    _assert_stepped_once_and_same_as(zero, plain_runs())


@pytest.mark.parametrize("stage,offload", [(2, "none"), (3, "cpu")])
def test_user_optimizer_steps_each_scalar_once(tmp_path, plain_runs, stage, offload):
    """``Trainer(optimizers=(opt, None))`` with ``opt`` built over ``model.parameters()`` before
    hf_zero lifted the scalars (it holds them as 0-dim parameters)."""
    zero_opt = {"stage": stage}
    if offload != "none":
        zero_opt["offload_optimizer"] = {"device": offload}
    cfg = {"zero_optimization": zero_opt, "train_micro_batch_size_per_gpu": "auto"}
    model = _model()
    user_opt = _SECTIONS["SGD"][1](list(model.parameters()), 5e-2)
    args = ZeroTrainingArguments(zero_config=cfg, **_args(tmp_path, "zero"))
    zero = ZeroTrainer(model=model, args=args, train_dataset=_data(), optimizers=(user_opt, None))
    zero.train()
    _assert_stepped_once_and_same_as(zero, plain_runs("SGD"))
