"""DeepSpeed LR schedules: values after n scheduler steps, computed by hand from DeepSpeed's formulas.

Convention (DeepSpeed's): at construction ``last_batch_iteration == -1``; after the n-th
``step()`` it is ``n - 1`` and the lr is the schedule's value at iteration ``n - 1``. ``_lrs(n)``
below returns the lr at construction (index 0) and after each of ``n`` steps (index k).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.optim.lr_scheduler import LRScheduler

from hf_zero.config.schema import (
    LRRangeTestParams,
    OneCycleParams,
    SchedulerConfig,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
)
from hf_zero.optim import build_scheduler


def _adamw(lr: float = 0.1, groups: int = 1) -> torch.optim.Optimizer:
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr * (i + 1)} for i in range(groups)]
    return torch.optim.AdamW(params, lr=lr, betas=(0.95, 0.999))


def _drive(opt: torch.optim.Optimizer, sched: LRScheduler, n: int, group: int = 0) -> list[float]:
    """lr of ``group`` at construction and after each of ``n`` (optimizer step, scheduler step)."""
    lrs = [opt.param_groups[group]["lr"]]
    for _ in range(n):
        opt.step()  # no gradients: a no-op, but the order is the engine's
        sched.step()
        lrs.append(opt.param_groups[group]["lr"])
        assert sched.get_last_lr()[group] == opt.param_groups[group]["lr"]
    return lrs


def _build(kind: str, params, opt=None):
    opt = opt if opt is not None else _adamw()
    return opt, build_scheduler(SchedulerConfig(type=kind, params=params), opt)


# --------------------------------------------------------------------------- WarmupLR
def test_warmup_lr_log():
    opt, sched = _build("WarmupLR", WarmupLRParams(warmup_min_lr=0.001, warmup_max_lr=0.01, warmup_num_steps=10))
    assert isinstance(sched, LRScheduler)
    lrs = _drive(opt, sched, 50)
    assert lrs[0] == 0.001  # construction: warmup_min_lr
    assert lrs[1] == pytest.approx(0.001 + (0.01 - 0.001) * math.log(0 + 1) / math.log(10))  # it 0 -> min
    assert lrs[1] == pytest.approx(0.001)
    assert lrs[2] == pytest.approx(0.001 + (0.01 - 0.001) * math.log(1 + 1) / math.log(10))
    assert lrs[6] == pytest.approx(0.001 + (0.01 - 0.001) * math.log(5 + 1) / math.log(10))  # mid-warmup
    assert lrs[10] == pytest.approx(0.001 + (0.01 - 0.001) * math.log(9 + 1) / math.log(10))  # last warmup it
    assert lrs[10] == pytest.approx(0.01)
    assert lrs[11] == pytest.approx(0.01)  # it 10: after warmup, hold
    assert lrs[50] == pytest.approx(0.01)
    assert sched.last_batch_iteration == 49


def test_warmup_lr_linear():
    params = WarmupLRParams(warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=10, warmup_type="linear")
    opt, sched = _build("WarmupLR", params)
    lrs = _drive(opt, sched, 20)
    assert lrs[0] == 0.0
    assert lrs[1] == pytest.approx(0.0 + (0.01 - 0.0) * 0 / 10)
    assert lrs[2] == pytest.approx(0.0 + (0.01 - 0.0) * 1 / 10)
    assert lrs[6] == pytest.approx(0.0 + (0.01 - 0.0) * 5 / 10)
    assert lrs[10] == pytest.approx(0.0 + (0.01 - 0.0) * 9 / 10)  # linear never quite reaches max in warmup
    assert lrs[11] == pytest.approx(0.01)
    assert lrs[20] == pytest.approx(0.01)


def test_warmup_lr_clamps_warmup_steps_to_two():
    # DeepSpeed: warmup_num_steps = max(2, warmup_num_steps), so that log(W) > 0.
    opt, sched = _build("WarmupLR", WarmupLRParams(warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=0))
    lrs = _drive(opt, sched, 3)
    assert lrs == pytest.approx([0.0, 0.0, 0.01 * math.log(2) / math.log(2), 0.01])


def test_warmup_lr_without_max_warms_each_group_to_its_own_lr():
    # DeepSpeed (PRs #7360, #8171): warmup_max_lr unset -> each group's lr at construction.
    opt = _adamw(lr=0.1, groups=2)  # group lrs 0.1 and 0.2
    sched = build_scheduler(
        SchedulerConfig(type="WarmupLR", params=WarmupLRParams(warmup_max_lr=None, warmup_num_steps=10)), opt
    )
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]
    _drive(opt, sched, 2)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx(
        [0.1 * math.log(1 + 1) / math.log(10), 0.2 * math.log(1 + 1) / math.log(10)]
    )
    _drive(opt, sched, 10)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1, 0.2])


# --------------------------------------------------------------------------- WarmupDecayLR
@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_decay_lr(warmup_type):
    params = WarmupDecayLRParams(
        warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=10, warmup_type=warmup_type, total_num_steps=30
    )
    opt, sched = _build("WarmupDecayLR", params)
    lrs = _drive(opt, sched, 40)
    warm = (lambda it: math.log(it + 1) / math.log(10)) if warmup_type == "log" else (lambda it: it / 10)
    assert lrs[0] == 0.0
    assert lrs[1] == pytest.approx(0.01 * warm(0))
    assert lrs[6] == pytest.approx(0.01 * warm(5))  # mid-warmup
    assert lrs[11] == pytest.approx(0.01 * (30 - 10) / (30 - 10))  # it 10: end of warmup, max
    assert lrs[21] == pytest.approx(0.01 * (30 - 20) / (30 - 10))  # it 20: mid-decay, half
    assert lrs[31] == pytest.approx(0.0)  # it 30 == total_num_steps
    assert lrs[40] == 0.0  # past the end: max(0, ...)


# --------------------------------------------------------------------------- WarmupCosineLR
@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_cosine_lr(warmup_type):
    params = WarmupCosineLRParams(
        total_num_steps=20, warmup_min_ratio=0.1, warmup_num_steps=5, cos_min_ratio=0.01, warmup_type=warmup_type
    )
    opt = _adamw(lr=0.1, groups=2)  # group lrs 0.1 and 0.2: the ratio applies to each
    opt, sched = _build("WarmupCosineLR", params, opt)
    lrs = _drive(opt, sched, 30)
    warm = (lambda it: math.log(it + 1) / math.log(5)) if warmup_type == "log" else (lambda it: it / 5)

    def cos_ratio(it):  # it >= warmup
        return 0.01 + (1 - 0.01) * (1 + math.cos(math.pi * (it - 5 + 1) / (20 - 5))) / 2

    assert lrs[0] == 0.0
    assert lrs[1] == pytest.approx(0.1 * (0.1 + (1 - 0.1) * warm(0)))  # it 0: warmup_min_ratio
    assert lrs[1] == pytest.approx(0.1 * 0.1)
    assert lrs[3] == pytest.approx(0.1 * (0.1 + (1 - 0.1) * warm(2)))  # mid-warmup
    assert lrs[5] == pytest.approx(0.1 * (0.1 + (1 - 0.1) * warm(4)))  # last warmup it
    assert lrs[6] == pytest.approx(0.1 * cos_ratio(5))  # first cosine it, just under the peak
    assert lrs[13] == pytest.approx(0.1 * cos_ratio(12))  # mid-decay
    assert lrs[20] == pytest.approx(0.1 * cos_ratio(19))  # it 19: cos(pi) -> cos_min_ratio
    assert lrs[20] == pytest.approx(0.1 * 0.01)
    assert lrs[30] == pytest.approx(0.1 * 0.01)  # past the end: held (DeepSpeed's would rise again)
    assert opt.param_groups[1]["lr"] == pytest.approx(0.2 * 0.01)  # second group: its own lr times the ratio
    if warmup_type == "log":
        assert lrs[5] == pytest.approx(0.1)


def test_warmup_cosine_sets_every_group_to_zero_at_start():
    opt = _adamw(lr=0.1, groups=2)
    build_scheduler(
        SchedulerConfig(type="WarmupCosineLR", params=WarmupCosineLRParams(total_num_steps=10, warmup_num_steps=5)), opt
    )
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]


# --------------------------------------------------------------------------- OneCycle
def _one_cycle_params(**overrides) -> OneCycleParams:
    base = dict(
        cycle_min_lr=0.001,
        cycle_max_lr=0.01,
        cycle_first_step_size=4,
        cycle_second_step_size=6,
        decay_step_size=2,
        decay_lr_rate=0.5,
        cycle_min_mom=0.85,
        cycle_max_mom=0.95,
        decay_mom_rate=0.1,
    )
    base.update(overrides)
    return OneCycleParams(**base)


def test_one_cycle_lr_and_momentum():
    opt, sched = _build("OneCycle", _one_cycle_params())
    lrs, moms = [opt.param_groups[0]["lr"]], [opt.param_groups[0]["betas"]]
    for _ in range(15):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
        moms.append(opt.param_groups[0]["betas"])
    # N = 4 + 6 = 10, rising for 4/10 of the cycle; s is the scale factor at b = it + 1.
    assert lrs[0] == 0.001 and moms[0] == (0.85, 0.999)  # construction: min lr, min momentum
    s = (1 / 10) / (4 / 10)  # after 1 step: it 0, b 1, rising
    assert lrs[1] == pytest.approx(0.001 + (0.01 - 0.001) * s)
    assert moms[1][0] == pytest.approx(0.95 - (0.95 - 0.85) * s)
    assert moms[1][1] == 0.999  # betas[1] untouched
    assert lrs[4] == pytest.approx(0.01)  # it 3, b 4: top of the cycle
    assert moms[4][0] == pytest.approx(0.85)
    s = (7 / 10 - 1) / (4 / 10 - 1)  # it 6, b 7: falling
    assert lrs[7] == pytest.approx(0.001 + (0.01 - 0.001) * s)
    assert moms[7][0] == pytest.approx(0.95 - (0.95 - 0.85) * s)
    assert lrs[10] == pytest.approx(0.001)  # it 9, b 10: back at the bottom
    assert moms[10][0] == pytest.approx(0.95)
    # Decay phase: d = it - N + 1.
    assert lrs[11] == pytest.approx(0.001 / (1 + 0.5 * 1 / 2))  # it 10, d 1
    assert moms[11][0] == pytest.approx(0.95 * (1 + 0.1 * 1 / 2))
    assert lrs[15] == pytest.approx(0.001 / (1 + 0.5 * 5 / 2))  # it 14, d 5
    assert moms[15][0] == pytest.approx(0.95 * (1 + 0.1 * 5 / 2))


def test_one_cycle_without_decay_holds_min_lr_and_max_momentum():
    opt, sched = _build("OneCycle", _one_cycle_params(decay_step_size=0, cycle_second_step_size=None))
    lrs = _drive(opt, sched, 12)
    # Symmetric cycle of 4 + 4; afterwards cycle_min_lr forever.
    assert lrs[2] == pytest.approx(0.001 + (0.01 - 0.001) * (2 / 8) / (4 / 8))
    assert lrs[4] == pytest.approx(0.01)
    assert lrs[9] == pytest.approx(0.001) and lrs[12] == pytest.approx(0.001)
    assert opt.param_groups[0]["betas"][0] == pytest.approx(0.95)


def test_one_cycle_sgd_cycles_lr_only():
    # DeepSpeed disables momentum cycling for optimizers without betas (it warns); so do we.
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)
    with pytest.warns(UserWarning, match="cycle_momentum is disabled"):
        _, sched = _build("OneCycle", _one_cycle_params(), opt)
    lrs = _drive(opt, sched, 4)
    assert lrs[4] == pytest.approx(0.01)
    assert opt.param_groups[0]["momentum"] == 0.9


def test_one_cycle_stairs():
    # Halves of 8 steps, 2 stairs each: the scale factor holds the value at the start of each
    # 4-step stair. b = it + 1 is the position in the 16-step cycle.
    params = _one_cycle_params(cycle_first_step_size=8, cycle_second_step_size=8, cycle_first_stair_count=2,
                               decay_step_size=0)
    opt, sched = _build("OneCycle", params)
    lrs = _drive(opt, sched, 16)

    def lr(s):
        return 0.001 + (0.01 - 0.001) * s

    for b in range(1, 17):
        if b <= 8:  # rising: s = floor(2 * b / 8) / 2
            s = math.floor(2 * b / 8) / 2
        else:  # falling: s = 1 - floor(2 * (b - 8) / 8) / 2
            s = 1 - math.floor(2 * (b - 8) / 8) / 2
        s = 0.0 if b == 16 else s  # b == N: the next cycle starts at 0
        assert lrs[b] == pytest.approx(lr(s)), b
    assert lrs[1] == lrs[3] == pytest.approx(0.001)  # flat within the first stair
    assert lrs[4] == pytest.approx(lr(0.5)) and lrs[8] == pytest.approx(0.01)
    assert lrs[9] == lrs[11] == pytest.approx(0.01)  # the falling half holds the top first
    assert opt.param_groups[0]["betas"][0] == pytest.approx(0.95)


def test_one_cycle_stairs_as_many_as_steps_is_continuous():
    base = dict(cycle_first_step_size=10, cycle_second_step_size=21, decay_step_size=0)
    _, continuous = _build("OneCycle", _one_cycle_params(**base))
    _, stairs = _build("OneCycle", _one_cycle_params(**base, cycle_first_stair_count=10, cycle_second_stair_count=21))
    for it in range(31):
        assert stairs.lr_at(it) == pytest.approx(continuous.lr_at(it))
    assert stairs.lr_at(9) == pytest.approx([0.01])  # the peak is not floored away


# --------------------------------------------------------------------------- LRRangeTest
def test_lr_range_test_continuous():
    params = LRRangeTestParams(lr_range_test_min_lr=0.01, lr_range_test_step_size=4, lr_range_test_step_rate=0.5)
    opt, sched = _build("LRRangeTest", params)
    lrs = _drive(opt, sched, 9)
    assert lrs[0] == 0.01
    assert lrs[1] == pytest.approx(0.01 * (1 + 0.5 * (0 + 1) / 4))  # it 0 already grows (b = it + 1)
    assert lrs[4] == pytest.approx(0.01 * (1 + 0.5 * (3 + 1) / 4))
    assert lrs[9] == pytest.approx(0.01 * (1 + 0.5 * (8 + 1) / 4))


def test_lr_range_test_staircase():
    params = LRRangeTestParams(
        lr_range_test_min_lr=0.01, lr_range_test_step_size=4, lr_range_test_step_rate=0.5, lr_range_test_staircase=True
    )
    opt, sched = _build("LRRangeTest", params)
    lrs = _drive(opt, sched, 9)
    assert lrs[3] == pytest.approx(0.01 * (1 + 0.5 * math.floor(3 / 4)))
    assert lrs[4] == pytest.approx(0.01 * (1 + 0.5 * math.floor(4 / 4)))
    assert lrs[9] == pytest.approx(0.01 * (1 + 0.5 * math.floor(9 / 4)))


# --------------------------------------------------------------------------- state dict
@pytest.mark.parametrize(
    "kind,params",
    [
        ("WarmupDecayLR", WarmupDecayLRParams(warmup_max_lr=0.01, warmup_num_steps=10, total_num_steps=30)),
        ("WarmupCosineLR", WarmupCosineLRParams(total_num_steps=30, warmup_num_steps=10)),
        ("OneCycle", _one_cycle_params()),
        ("LRRangeTest", LRRangeTestParams(lr_range_test_step_size=3)),
    ],
)
def test_state_dict_round_trip_mid_warmup(kind, params):
    opt_a, sched_a = _build(kind, params)
    _drive(opt_a, sched_a, 6)
    saved_sched, saved_opt = sched_a.state_dict(), opt_a.state_dict()
    assert saved_sched["last_batch_iteration"] == 5

    # Resume: fresh optimizer and scheduler (built before loading, as torch recommends).
    opt_b, sched_b = _build(kind, params)
    opt_b.load_state_dict(saved_opt)
    sched_b.load_state_dict(saved_sched)
    assert sched_b.last_batch_iteration == 5
    assert sched_b.get_last_lr() == sched_a.get_last_lr()
    assert _drive(opt_b, sched_b, 12) == _drive(opt_a, sched_a, 12)
    assert opt_b.param_groups[0]["betas"] == opt_a.param_groups[0]["betas"]


def test_loads_deepspeed_state_dict():
    params = WarmupLRParams(warmup_min_lr=0.0, warmup_max_lr=0.01, warmup_num_steps=10, warmup_type="linear")
    opt, sched = _build("WarmupLR", params)
    sched.load_state_dict({"last_batch_iteration": 4})  # what DeepSpeed's schedulers save
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * 5 / 10)


# --------------------------------------------------------------------------- config handling
@pytest.mark.parametrize(
    "kind,params,field",
    [
        ("WarmupDecayLR", WarmupDecayLRParams(), "total_num_steps"),  # total_num_steps defaults to "auto"
        ("WarmupLR", WarmupLRParams(warmup_max_lr="auto"), "warmup_max_lr"),
        ("WarmupCosineLR", WarmupCosineLRParams(total_num_steps=10, warmup_num_steps="auto"), "warmup_num_steps"),
    ],
)
def test_auto_left_in_params_raises(kind, params, field):
    with pytest.raises(ValueError, match=f"scheduler.params.{field}"):
        _build(kind, params)


@pytest.mark.parametrize(
    "kind,params",
    [
        ("WarmupLR", WarmupLRParams(warmup_num_steps=-5)),
        ("WarmupCosineLR", WarmupCosineLRParams(total_num_steps=10, warmup_num_steps=None)),
        ("LRRangeTest", LRRangeTestParams(lr_range_test_step_size=0)),
        ("OneCycle", _one_cycle_params(cycle_first_step_size=0)),
        ("OneCycle", _one_cycle_params(cycle_second_step_size=-1)),
    ],
)
def test_invalid_step_counts_raise(kind, params):
    # DeepSpeed rejects these too (they would divide by zero or take log of <= 0).
    with pytest.raises(ValueError, match="must be an integer"):
        _build(kind, params)


def test_wrong_params_or_type_raise():
    with pytest.raises(ValueError, match="WarmupDecayLRParams"):
        _build("WarmupDecayLR", WarmupLRParams())
    with pytest.raises(ValueError, match="not supported"):
        _build("CosineAnnealing", WarmupLRParams())
    with pytest.raises(ValueError, match="warmup_type"):
        _build("WarmupLR", WarmupLRParams(warmup_type="cubic"))


def test_type_is_case_insensitive_and_step_takes_no_epoch():
    opt, sched = _build("warmuplr", WarmupLRParams())
    with pytest.raises(TypeError):
        sched.step(3)
