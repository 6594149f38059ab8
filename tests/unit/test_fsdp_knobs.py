"""DeepSpeed's stage-3 knobs become FSDP2 settings: the parsed config, read back from the sharded
modules' own FSDP2 state (prefetch lists, reshard after forward per unit, reduce-scatter division).

The expectations are written by hand from DeepSpeed's rules (docs/config_reference.md, "Stage-3
knobs on FSDP2") for a model of four equal blocks of 110 elements each; the 2-rank numerics are in
tests/distributed/test_fsdp_knobs_parity.py (a different basename: pytest collects both dirs in one run).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_zero.config import parse_config
from hf_zero.engine.fsdp_knobs import GradientDivision, StageKnobs

BLOCK = 110  # Linear(10, 10): 100 weights + 10 biases


class FourBlocks(nn.Module):
    """Four equal blocks in a ModuleList (hf_zero's wrap falls back to its children) and a head."""

    def __init__(self, sizes=(10, 10, 10, 10)):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for d in sizes)
        self.head = nn.Linear(sizes[-1], 3)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _sharded(zero: dict, top: dict | None = None, model: nn.Module | None = None):
    from hf_zero.distributed.env import DistEnv
    from hf_zero.engine.stages import make_stage
    from hf_zero.precision.policy import PrecisionPolicy

    cfg = parse_config({"zero_optimization": zero, **(top or {})})
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    stage = make_stage(cfg.zero_optimization, env, PrecisionPolicy.from_config(cfg),
                       knobs=StageKnobs.from_config(cfg, env.world_size))
    model = model or FourBlocks()
    stage.wrap(model)
    return model, stage


def _prefetch(model) -> tuple[list[list[int]], list[list[int]]]:
    """Each block's explicit forward/backward prefetch targets, as block indices."""
    states = {id(b._get_fsdp_state()): i for i, b in enumerate(model.blocks)}
    fwd = [[states[id(s)] for s in b._get_fsdp_state()._states_to_forward_prefetch] for b in model.blocks]
    bwd = [[states[id(s)] for s in b._get_fsdp_state()._states_to_backward_prefetch] for b in model.blocks]
    return fwd, bwd


def _groups(module) -> list:
    """A unit's FSDP2 parameter groups (torch 2.9 keeps one, newer torch a list)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    return list(groups) if groups is not None else [state._fsdp_param_group]


def _reshards_after_forward(module) -> bool:
    # FSDP2 keeps a unit gathered after forward exactly when it has no post-forward mesh.
    return all(g.post_forward_mesh_info is not None for g in _groups(module))


# ------------------------------------------------------------------------------ config -> knobs
def test_knobs_are_read_only_when_written_and_only_at_stage_3():
    cfg = parse_config({"zero_optimization": {"stage": 3}})
    assert StageKnobs.from_config(cfg, 2) == StageKnobs()  # FSDP2's defaults, not DeepSpeed's 5e7/1e5
    written = {"stage3_prefetch_bucket_size": 2e8, "stage3_param_persistence_threshold": 1e4,
               "stage3_max_live_parameters": 3e8}
    knobs = StageKnobs.from_config(parse_config({"zero_optimization": {"stage": 3, **written}}), 2)
    assert (knobs.prefetch_bucket, knobs.persistence_threshold, knobs.max_live) == (200_000_000, 10_000, 300_000_000)
    cfg2 = parse_config({"zero_optimization": {"stage": 2, **written}})
    assert StageKnobs.from_config(cfg2, 2) == StageKnobs()
    # ... and the config reports them once as having no effect at stage 2.
    assert {f"zero_optimization.{k}" for k in written} <= set(cfg2.no_effect_keys)


@pytest.mark.parametrize("prescale, factor, world, expected", [
    (False, 1.0, 8, None),                              # DeepSpeed's default: average after the sum
    (False, 4.0, 8, GradientDivision(pre=4.0, post=0.5)),   # g/4, summed, x 4/8
    (False, 8.0, 8, GradientDivision(pre=8.0, post=1.0)),
    (True, 4.0, 8, GradientDivision(pre=8.0, post=1.0)),    # prescale: g/world, summed
])
def test_gradient_division_is_deepspeeds(prescale, factor, world, expected):
    assert GradientDivision.from_config(prescale, factor, world) == expected
    if expected is not None:  # whatever the split, the result is the mean of the world's gradients
        assert world / expected.pre * expected.post == pytest.approx(1.0)


def test_division_applies_at_stages_2_and_3_and_is_reported_below():
    for stage in (2, 3):
        cfg = parse_config({"zero_optimization": {"stage": stage}, "gradient_predivide_factor": 2.0})
        assert StageKnobs.from_config(cfg, 4).division == GradientDivision(pre=2.0, post=0.5)
        assert "gradient_predivide_factor" not in cfg.no_effect_keys
    cfg = parse_config({"zero_optimization": {"stage": 1}, "prescale_gradients": True})
    assert StageKnobs.from_config(cfg, 4).division is None
    assert cfg.no_effect_keys == ("prescale_gradients",)
    # DeepSpeed's default values ask for what happens anyway: nothing to report.
    assert parse_config({"prescale_gradients": False, "gradient_predivide_factor": 1.0}).no_effect_keys == ()


# ------------------------------------------------------------------------------ on FSDP2 modules
def test_default_config_keeps_fsdp2_defaults(one_rank_mesh):
    model, _ = _sharded({"stage": 3})
    assert _prefetch(model) == ([[], [], [], []], [[], [], [], []])
    assert all(_reshards_after_forward(b) for b in model.blocks)
    assert all(g.gradient_divide_factor is None for b in model.blocks for g in _groups(b))


@pytest.mark.parametrize("bucket, forward, backward", [
    # DeepSpeed adds the next block while fewer than `bucket` elements are in flight.
    (200, [[1, 2], [2, 3], [3], []], [[], [0], [1, 0], [2, 1]]),
    (10_000, [[1, 2, 3], [2, 3], [3], []], [[], [0], [1, 0], [2, 1, 0]]),
])
def test_prefetch_bucket_sets_the_prefetch_lists(one_rank_mesh, bucket, forward, backward):
    model, _ = _sharded({"stage": 3, "stage3_prefetch_bucket_size": bucket})
    assert _prefetch(model) == (forward, backward)


@pytest.mark.parametrize("bucket", [0, 50, BLOCK])
def test_prefetch_up_to_one_block_is_fsdp2s_default(one_rank_mesh, bucket):
    model, _ = _sharded({"stage": 3, "stage3_prefetch_bucket_size": bucket})
    assert _prefetch(model) == ([[], [], [], []], [[], [], [], []])


def test_max_live_parameters_caps_the_prefetch(one_rank_mesh):
    # Own block (110) + prefetched must stay within 340: two blocks ahead at most (110 + 220).
    model, _ = _sharded({"stage": 3, "stage3_prefetch_bucket_size": 10_000, "stage3_max_live_parameters": 340})
    assert _prefetch(model) == ([[1, 2], [2, 3], [3], []], [[], [0], [1, 0], [2, 1]])


def test_persistence_threshold_keeps_small_blocks_gathered(one_rank_mesh):
    # Blocks 1 and 3 have 4x4 + 4 = 20-element and 4-element parameters; blocks 0 and 2 a 100-element weight.
    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Linear(10, 10), nn.Linear(4, 4), nn.Linear(10, 10), nn.Linear(4, 4)])
    _sharded({"stage": 3, "stage3_param_persistence_threshold": 50}, model=model)
    assert [_reshards_after_forward(b) for b in model.blocks] == [True, False, True, False]
    # A threshold equal to the largest parameter does not make it persistent (DeepSpeed: numel < threshold).
    model2 = nn.Module()
    model2.blocks = nn.ModuleList([nn.Linear(10, 10), nn.Linear(4, 4)])
    _sharded({"stage": 3, "stage3_param_persistence_threshold": 16}, model=model2)
    assert [_reshards_after_forward(b) for b in model2.blocks] == [True, True]


def test_predivide_factor_sets_the_reduce_scatter(one_rank_mesh):
    model, stage = _sharded({"stage": 3}, {"gradient_predivide_factor": 4.0})
    for module in [*model.blocks, model]:
        for group in _groups(module):
            assert group.gradient_divide_factor == 1.0  # FSDP2 itself scales nothing
            assert group._reduce_scatter_comm.division == GradientDivision(pre=4.0, post=4.0)  # world 1: x 4/1


def test_one_rank_gradients_are_unchanged_by_the_knobs(one_rank_mesh):
    """On one rank the mean is the gradient itself: plain autograd on an unsharded copy."""
    torch.manual_seed(0)
    reference = FourBlocks()
    model = FourBlocks()
    model.load_state_dict(reference.state_dict())
    _sharded({"stage": 3, "stage3_prefetch_bucket_size": 10_000, "stage3_param_persistence_threshold": 1e9},
             {"gradient_predivide_factor": 4.0}, model=model)
    x = torch.randn(5, 10)
    reference(x).square().sum().backward()
    model(x).square().sum().backward()
    for (name, ref), got in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(got.grad.full_tensor(), ref.grad, rtol=1e-6, atol=1e-7, msg=name)
