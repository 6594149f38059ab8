"""The user's optimizer rebuilt on the engine's parameters (engine/optimizer_recipe.py): the same
hyper-parameters, even those kept outside ``defaults``; construction-time state is not "stepped";
and an optimizer that cannot step DTensor shards gets an error naming the stage and what to use.

The references are the optimizers themselves: each is stepped as the user built it, on a copy of
the same parameters, and the engine's step must give the same weights.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import hf_zero
from hf_zero.engine.optimizer_recipe import constructor_defaults
from hf_zero.engine.sharded_optimizer import ShardedOptimizerError


class BlockSGD(torch.optim.Optimizer):
    """An optimizer shaped like torchao's low-bit AdamW: a constructor argument kept as an attribute
    (not in ``defaults``) that changes the update. The step rounds the gradient blockwise to
    ``block_size``-element means, so a rebuild with the class default gives other weights."""

    def __init__(self, params, lr=0.1, *, block_size=4):
        super().__init__(params, dict(lr=lr))
        self.block_size = block_size

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad.reshape(-1)
                n = g.numel() // self.block_size * self.block_size
                blocks = g[:n].view(-1, self.block_size).mean(1, keepdim=True).expand(-1, self.block_size)
                update = torch.cat([blocks.reshape(-1), g[n:]]).view_as(p)
                p.add_(update, alpha=-group["lr"])


class NamespaceSGD(torch.optim.Optimizer):
    """Shaped like bitsandbytes' optimizers: settings in an ``args`` namespace."""

    def __init__(self, params, lr=0.1, scale=1.0, args=None):
        super().__init__(params, dict(lr=lr))
        self.args = args if args is not None else types.SimpleNamespace(scale=scale)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] * self.args.scale)


class PlainStateSGD(torch.optim.Optimizer):
    """Keeps a state tensor built with ``torch.zeros(p.shape)``, as transformers' Adafactor builds
    its factored statistics: a plain tensor, which a DTensor parameter cannot be combined with."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["avg"] = torch.zeros(p.shape)
                state["avg"].mul_(0.9).add_(p.grad)
                p.add_(state["avg"], alpha=-group["lr"])


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 3))


def _data():
    torch.manual_seed(1)
    return torch.randn(6, 8), torch.randn(6, 3)


def _reference(make_optimizer, steps=2):
    model = _model()
    optimizer = make_optimizer(model.parameters())
    x, y = _data()
    for _ in range(steps):
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _engine(make_optimizer, stage, steps=2):
    model = _model()
    engine = hf_zero.initialize(model, {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": 6},
                                optimizer=make_optimizer(model.parameters()))
    x, y = _data()
    for _ in range(steps):
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
    with hf_zero.gathered_parameters(engine) as module:
        return [p.detach().clone() for p in module.parameters()]


def test_constructor_arguments_outside_defaults_are_kept():
    params = [nn.Parameter(torch.zeros(3))]
    assert constructor_defaults(BlockSGD(params, lr=0.2, block_size=3)) == {"lr": 0.2, "block_size": 3}
    namespaced = NamespaceSGD(params, lr=0.2, scale=0.5)
    assert constructor_defaults(namespaced) == {"lr": 0.2, "scale": 0.5, "args": namespaced.args}


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize(
    "make_optimizer",
    [
        pytest.param(lambda ps: BlockSGD(ps, lr=0.05, block_size=3), id="attribute"),
        pytest.param(lambda ps: NamespaceSGD(ps, lr=0.05, scale=0.25), id="namespace"),
        # Adagrad fills its state at construction (step 0, the initial accumulator): not "stepped".
        pytest.param(lambda ps: torch.optim.Adagrad(ps, lr=0.05, initial_accumulator_value=0.3), id="adagrad"),
    ],
)
def test_rebuilt_optimizer_steps_like_the_users(make_optimizer, stage):
    expected = _reference(make_optimizer)
    got = _engine(make_optimizer, stage)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_block_size_changes_the_update():
    """The control for the "attribute" case: a rebuild with the class's default would differ."""
    chosen, default = _reference(lambda ps: BlockSGD(ps, lr=0.05, block_size=3)), _reference(lambda ps: BlockSGD(ps, lr=0.05))
    assert any(not torch.allclose(a, b) for a, b in zip(chosen, default))


def test_a_stepped_optimizer_is_still_refused():
    model = _model()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
    x, y = _data()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    with pytest.raises(ValueError, match="already been stepped"):
        hf_zero.initialize(model, {"zero_optimization": {"stage": 0}, "train_micro_batch_size_per_gpu": 6},
                           optimizer=optimizer)


@pytest.mark.parametrize("stage", [2, 3])
def test_optimizer_that_cannot_step_shards_names_the_stage_and_the_way_out(stage):
    with pytest.raises(ShardedOptimizerError) as err:
        _engine(lambda ps: PlainStateSGD(ps), stage, steps=1)
    message = str(err.value)
    assert "PlainStateSGD" in message and f"stage {stage}" in message and "stage 1" in message
    assert "mixed torch.Tensor and DTensor" in message  # the original cause, also chained
    assert isinstance(err.value.__cause__, RuntimeError)


def test_a_shard_aware_optimizers_own_failure_is_not_relabelled(monkeypatch):
    """LAMB's host-shard collective failure (review N2) was reported as "failed at its first step on
    ZeRO stage 3's sharded parameters ... use stage 1": wrong cause, wrong advice. hf_zero's and
    torch's own optimizers step shards; their errors pass through unchanged."""
    from hf_zero.optim.lamb import Lamb

    def broken_step(self, closure=None):
        raise RuntimeError("No backend type associated with device type cpu")

    monkeypatch.setattr(Lamb, "step", broken_step)
    with pytest.raises(RuntimeError, match="No backend type") as err:
        _engine(lambda ps: Lamb(ps, lr=0.05), 3, steps=1)
    assert not isinstance(err.value, ShardedOptimizerError)


def test_the_same_optimizer_steps_whole_parameters_at_stage_1():
    expected = _reference(lambda ps: PlainStateSGD(ps))
    for a, b in zip(_engine(lambda ps: PlainStateSGD(ps), 1), expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
