"""Loss scalers: scripted overflow sequences with the scales worked out by hand from DeepSpeed's
``DynamicLossScaler.update_scale`` (deepspeed/runtime/fp16/loss_scaler.py)."""

from __future__ import annotations

import pytest
import torch

from hf_zero.config.schema import FP16Config
from hf_zero.precision import (
    DynamicLossScaler,
    StaticLossScaler,
    build_loss_scaler,
    grads_have_inf_or_nan,
)

O, _ = True, False  # overflow / no overflow

# 14 steps: growth after 3 quiet steps, an overflow eaten by hysteresis, two overflows in a row, ...
SEQUENCE = [_, _, _, O, _, O, O, _, _, _, O, _, _, _]

# hysteresis 2, window 3, consecutive_hysteresis false. Step by step (it = cur_iter, lo = last
# overflow iter, h = hysteresis left); growth needs (it - lo) % 3 == 0 and refills h:
#  it0 _ (0+1)%3=1             16   | it7  _ (7-6)=1      8
#  it1 _ 2                     16   | it8  _ 2            8
#  it2 _ 3%3=0 -> x2, h=2      32   | it9  _ 3 -> x2, h=2 16
#  it3 O h 2->1, lo=3          32   | it10 O h 2->1       16
#  it4 _ (4-3)=1, h stays 1    32   | it11 _ 1            16
#  it5 O h==1 -> /2, lo=5      16   | it12 _ 2            16
#  it6 O h still 1 -> /2, lo=6  8   | it13 _ 3 -> x2      32
EXPECTED_PLAIN = [16, 16, 32, 32, 32, 16, 8, 8, 8, 16, 16, 16, 16, 32]

# Same, consecutive_hysteresis true: every quiet step refills h, so it4 gives h=2 back and the
# overflow at it5 is tolerated too; only the second overflow in a row (it6) halves the scale.
#  it0-2 as above -> 32 | it3 O h 2->1: 32 | it4 _ h=2: 32 | it5 O h 2->1: 32 | it6 O h==1 -> 16
#  it7 _ 16 | it8 _ 16 | it9 _ (9-6)%3=0 -> 32 | it10 O h->1: 32 | it11, it12: 32 | it13 -> 64
EXPECTED_CONSECUTIVE = [16, 16, 32, 32, 32, 32, 16, 16, 16, 32, 32, 32, 32, 64]


def _scaler(consecutive: bool) -> DynamicLossScaler:
    return DynamicLossScaler(
        init_scale=2.0**4, scale_window=3, min_scale=1.0, delayed_shift=2, consecutive_hysteresis=consecutive
    )


@pytest.mark.parametrize(
    "consecutive,expected", [(False, EXPECTED_PLAIN), (True, EXPECTED_CONSECUTIVE)], ids=["plain", "consecutive"]
)
def test_scripted_sequence(consecutive, expected):
    scaler = _scaler(consecutive)
    assert scaler.loss_scale == 16.0 and scaler.dynamic
    got = [scaler.update_scale(overflow) for overflow in SEQUENCE]
    assert got == expected
    assert scaler.loss_scale == expected[-1]
    assert scaler.cur_iter == len(SEQUENCE)


def test_no_hysteresis_halves_at_once_and_clamps_at_min():
    scaler = DynamicLossScaler(init_scale=8.0, scale_window=100, min_scale=3.0, delayed_shift=1)
    assert [scaler.update_scale(O) for _ in range(3)] == [4.0, 3.0, 3.0]  # max(8/2, 3), max(4/2, 3), ...


def test_raise_error_at_min_scale_is_opt_in():
    scaler = DynamicLossScaler(init_scale=2.0, min_scale=1.0, delayed_shift=1, raise_error_at_min_scale=True)
    assert scaler.update_scale(O) == 1.0
    with pytest.raises(RuntimeError, match="min_loss_scale"):
        scaler.update_scale(O)


def test_state_dict_round_trip_mid_sequence():
    first = _scaler(consecutive=False)
    for overflow in SEQUENCE[:7]:
        first.update_scale(overflow)
    saved = first.state_dict()
    assert saved == {"cur_scale": 8.0, "cur_iter": 7, "last_overflow_iter": 6, "cur_hysteresis": 1}

    resumed = _scaler(consecutive=False)
    resumed.load_state_dict(saved)
    rest = SEQUENCE[7:]
    assert [resumed.update_scale(o) for o in rest] == [first.update_scale(o) for o in rest]
    assert resumed.state_dict() == first.state_dict()
    assert resumed.loss_scale == EXPECTED_PLAIN[-1]


def test_static_scaler():
    scaler = StaticLossScaler(128.0)
    assert not scaler.dynamic
    assert [scaler.update_scale(o) for o in (O, _, O)] == [128.0, 128.0, 128.0]
    assert scaler.state_dict() == {"cur_scale": 128.0}
    scaler.load_state_dict({"cur_scale": 4.0})  # the configured static scale wins on resume
    assert scaler.loss_scale == 128.0
    with pytest.raises(ValueError):
        StaticLossScaler(0.0)


def test_build_loss_scaler():
    dynamic = build_loss_scaler(FP16Config(enabled=True), enabled=True)
    assert isinstance(dynamic, DynamicLossScaler)
    # Schema defaults: 2**16 start, window 1000, hysteresis 2, floor 1.
    assert (dynamic.loss_scale, dynamic.scale_window, dynamic.delayed_shift, dynamic.min_scale) == (
        65536.0,
        1000,
        2,
        1.0,
    )
    assert dynamic.scale_factor == 2.0 and not dynamic.raise_error_at_min_scale

    custom = build_loss_scaler(
        FP16Config(enabled=True, initial_scale_power=8, loss_scale_window=50, hysteresis=4,
                   consecutive_hysteresis=True, min_loss_scale=0.5),
        enabled=True,
    )
    assert (custom.loss_scale, custom.scale_window, custom.delayed_shift, custom.min_scale) == (256.0, 50, 4, 0.5)
    assert custom.consecutive_hysteresis

    static = build_loss_scaler(FP16Config(enabled=True, loss_scale=1024.0), enabled=True)
    assert isinstance(static, StaticLossScaler) and static.loss_scale == 1024.0

    off = build_loss_scaler(FP16Config(), enabled=False)  # bf16 / fp32
    assert not off.dynamic and off.loss_scale == 1.0

    with pytest.raises(ValueError, match="loss_scale"):
        build_loss_scaler(FP16Config(enabled=True, loss_scale=-1.0), enabled=True)


def test_grads_have_inf_or_nan():
    finite = [torch.ones(3), None, torch.zeros(2, 2, dtype=torch.float16)]
    flag = grads_have_inf_or_nan(finite)
    assert flag.dtype == torch.bool and flag.dim() == 0 and not flag
    assert grads_have_inf_or_nan(finite + [torch.tensor([1.0, float("inf")])])
    assert grads_have_inf_or_nan(finite + [torch.tensor([float("-inf")], dtype=torch.float16)])
    assert grads_have_inf_or_nan([torch.tensor([float("nan"), 1.0]), torch.ones(2)])
    assert not grads_have_inf_or_nan([])
    assert not grads_have_inf_or_nan([None, torch.empty(0)])


def test_grads_have_inf_or_nan_reads_dtensor_local_shard(one_rank_mesh):
    from torch.distributed.tensor import Shard, distribute_tensor

    good = distribute_tensor(torch.ones(4, 2), one_rank_mesh, [Shard(0)])
    bad = distribute_tensor(torch.tensor([[1.0, float("nan")]]), one_rank_mesh, [Shard(0)])
    assert not grads_have_inf_or_nan([good])
    assert grads_have_inf_or_nan([good, bad])


def test_held_in_fp16_counts_what_an_fp16_cast_makes_inf():
    """hf_zero sums micro-steps in fp32 where DeepSpeed keeps an fp16 sum: a value past fp16's range
    must count as an overflow, exactly where torch's own cast to fp16 gives inf."""
    edge = torch.tensor(65520.0)
    values = [edge, edge.nextafter(torch.tensor(0.0)), -edge, torch.tensor(65504.0), torch.tensor(1e5), torch.tensor(1.0)]
    for v in values:
        want = bool(torch.isinf(v.half()))
        assert bool(grads_have_inf_or_nan([torch.ones(3), v.reshape(1)], held_in=torch.float16)) == want, float(v)
        assert not grads_have_inf_or_nan([v.reshape(1)])  # finite in fp32: only held_in makes it an overflow
    assert [bool(torch.isinf(v.half())) for v in values] == [True, False, True, False, True, False]
    assert grads_have_inf_or_nan([torch.tensor([float("nan")])], held_in=torch.float16)
