"""``OffloadedOptimizer`` in one process: the same updates as the plain torch optimizer, whatever
the chunking, for CPU and NVMe state; gradient accumulation, norm and clipping; state dicts."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from hf_zero.config.schema import AioConfig, OptimizerConfig
from hf_zero.offload.cpu_optimizer import (
    HostOffloadConfig,
    OffloadedOptimizer,
    ParamPlan,
)
from hf_zero.optim.optimizers import build_optimizer

SHAPES = [(300, 3), (3,), (700,), (0, 4), (7, 7)]


def make_params(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(*s, generator=g)) for s in SHAPES]


def grads_for(step: int, micro: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + 10 * step + micro)
    return [torch.randn(*s, generator=g) for s in SHAPES]


def section(kind: str, **kw) -> OptimizerConfig:
    defaults = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
    if kind == "sgd":
        defaults = {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.1}
    return OptimizerConfig(type=kind, **{**defaults, **kw})


def offloaded(params, cfg: OptimizerConfig, tmp_path=None, *, device="cpu", sub_group_size=512, buffer_count=2,
              copy_back_thread=None):
    build = lambda groups: build_optimizer(cfg, groups)
    groups = [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}]
    probe = build(groups)
    names = {id(p): f"p{i}" for i, p in enumerate(params)}
    host = HostOffloadConfig(device=device, sub_group_size=sub_group_size, buffer_count=buffer_count,
                             nvme_path=str(tmp_path) if tmp_path else None,
                             aio=AioConfig(block_size=4096, thread_count=2), run_id="test")
    return OffloadedOptimizer(probe, build, names, host, ParamPlan(host=list(params)), copy_back_thread=copy_back_thread)


def reference(params, cfg: OptimizerConfig):
    return build_optimizer(cfg, [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}])


def train(opt, params, steps, gas=1, start=0, offload=True):
    for step in range(start, start + steps):
        for micro in range(gas):
            for p, g in zip(params, grads_for(step, micro)):
                if offload:
                    opt.accumulate_grad(p, g)
                elif p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad += g
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd", "lion", "lamb"])
@pytest.mark.parametrize("device", ["cpu", "nvme", "nvme-thread"])
def test_same_updates_as_the_plain_optimizer(kind, device, tmp_path):
    cfg = section(kind)
    mine, ref = make_params(), make_params()
    # "-thread": the copy-back on its worker thread (what a GPU run uses), overlapping the next chunk.
    opt = offloaded(mine, cfg, tmp_path, device=device.removesuffix("-thread"), copy_back_thread=device.endswith("-thread"))
    train(opt, mine, steps=3, gas=2)
    train(reference(ref, cfg), ref, steps=3, gas=2, offload=False)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    opt.close()


def test_chunks_respect_sub_group_size_for_elementwise_optimizers():
    opt = offloaded(make_params(), section("adamw"), sub_group_size=512)
    assert all(c.numel <= 512 for c in opt.chunks)
    # The 900- and 700-element parameters are split over several chunks, at multiples of 256
    # elements; each slot's pieces tile it exactly.
    for slot in opt.slots:
        assert sum(p.numel for p in slot.pieces) == slot.numel
        assert all(p.start % 256 == 0 for p in slot.pieces)
    assert max(len(s.pieces) for s in opt.slots) > 1
    opt.close()


def test_lamb_keeps_each_parameter_whole():
    opt = offloaded(make_params(), section("lamb"), sub_group_size=512)
    assert all(len(s.pieces) == 1 for s in opt.slots)
    assert max(c.numel for c in opt.chunks) == 900  # larger than sub_group_size: a chunk of its own
    opt.close()


def test_hyperparameters_follow_the_outer_param_groups():
    cfg = section("adamw")
    mine, ref = make_params(), make_params()
    opt, plain = offloaded(mine, cfg), reference(ref, cfg)
    for o in (opt, plain):
        for g in o.param_groups:
            g["lr"] = 0.5  # what a scheduler does
    train(opt, mine, 1)
    train(plain, ref, 1, offload=False)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    opt.close()


def test_grad_norm_clip_and_unscale_match_torch():
    params = make_params()
    opt = offloaded(params, section("adamw"))
    grads = grads_for(0)
    for p, g in zip(params, grads):
        opt.accumulate_grad(p, g)
    expected = torch.nn.utils.get_total_norm([g.clone() for g in grads], 2.0)
    torch.testing.assert_close(opt.total_grad_norm(2.0), expected)
    torch.testing.assert_close(opt.total_grad_norm(float("inf")), torch.stack([g.abs().max() for g in grads if g.numel()]).max())
    opt.unscale_grads_(0.5)
    torch.testing.assert_close(opt.total_grad_norm(2.0), expected * 0.5)
    assert not opt.grads_have_inf_or_nan()
    clipped = [g.clone() * 0.5 for g in grads]
    torch.nn.utils.clip_grads_with_norm_([nn.Parameter(torch.zeros_like(g)) for g in clipped], 1.0, expected * 0.5)
    opt.clip_grads_with_norm_(1.0, expected * 0.5)
    torch.testing.assert_close(opt.total_grad_norm(2.0), torch.tensor(1.0), rtol=1e-5, atol=0)
    opt.slots[0].grad[0] = float("nan")
    assert opt.grads_have_inf_or_nan()
    opt.close()


def test_zero_grad_starts_a_new_window():
    params = make_params()
    opt = offloaded(params, section("sgd"))
    for p, g in zip(params, grads_for(0)):
        opt.accumulate_grad(p, g)
    opt.zero_grad()
    for p, g in zip(params, grads_for(1)):
        opt.accumulate_grad(p, g)
    for slot, g in zip(opt.slots, grads_for(1)):
        assert torch.equal(slot.grad.view(g.shape), g)  # overwritten, not added
    opt.close()


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_checkpoint_state_round_trip(device, tmp_path):
    cfg = section("adamw")
    params = make_params()
    opt = offloaded(params, cfg, tmp_path, device=device)
    train(opt, params, 2)
    state, masters = opt.checkpoint_state()
    assert set(state["state"]) == {f"p{i}" for i in range(len(SHAPES))}
    assert state["param_groups"][0]["params"] == ["p0", "p1", "p2"]
    assert all(tuple(masters[f"p{i}"].shape) == s for i, s in enumerate(SHAPES))
    saved = {k: {kk: (vv.clone() if torch.is_tensor(vv) else vv) for kk, vv in v.items()} for k, v in state["state"].items()}
    saved_masters = {k: v.clone() for k, v in masters.items()}
    train(opt, params, 2, start=2)
    expected = [p.detach().clone() for p in params]
    opt.close()

    fresh = make_params(seed=5)
    other = offloaded(fresh, cfg, tmp_path, device=device)
    other.load_checkpoint_state({"state": saved, "param_groups": state["param_groups"]}, saved_masters)
    for p, m in zip(fresh, saved_masters.values()):
        assert torch.equal(p.detach(), m)  # the device copy follows the loaded master
    train(other, fresh, 2, start=2)
    for a, b in zip(fresh, expected):
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=0)
    other.close()


def test_torch_state_dict_api_round_trip():
    cfg = section("adamw")
    params = make_params()
    opt = offloaded(params, cfg)
    train(opt, params, 2)
    sd = opt.state_dict()
    assert set(sd["state"]) == set(range(len(SHAPES))) and "master" in sd["state"][0]
    other_params = make_params(seed=9)
    other = offloaded(other_params, cfg)
    other.load_state_dict(sd)
    train(opt, params, 1, start=2)
    train(other, other_params, 1, start=2)
    for a, b in zip(params, other_params):
        assert torch.equal(a.detach(), b.detach())
    opt.close()
    other.close()


def test_memory_report_counts_host_and_nvme_tiers(tmp_path):
    numel = sum(torch.Size(s).numel() for s in SHAPES)
    cpu = offloaded(make_params(), section("adamw"))
    train(cpu, cpu.managed_params(), 1)
    report = cpu.memory_report()
    assert report["grads"] == {"accelerator": 0, "host": 4 * numel, "nvme": 0}
    # master + exp_avg + exp_avg_sq, plus one 4-byte step counter per piece
    pieces = sum(len(c.pieces) for c in cpu.chunks)
    assert report["optimizer_state"]["host"] == 3 * 4 * numel + 4 * pieces
    assert report["optimizer_state"]["accelerator"] == report["optimizer_state"]["nvme"] == 0
    cpu.close()

    on_disk = offloaded(make_params(), section("adamw"), tmp_path, device="nvme", buffer_count=3)
    train(on_disk, on_disk.managed_params(), 1)
    report = on_disk.memory_report()
    assert report["optimizer_state"]["nvme"] >= 3 * 4 * numel
    assert report["optimizer_state"]["nvme"] == sum(os.path.getsize(f) for f in on_disk.swap_files())
    assert report["optimizer_state"]["host"] >= 3 * 4096  # the buffer pool
    files, folder = on_disk.swap_files(), on_disk.swap_dir
    assert files and all(os.path.exists(f) for f in files)
    on_disk.close()
    assert not os.path.exists(folder) and not any(os.path.exists(f) for f in files)


def test_an_optimizer_rebuilt_from_an_instance_steps_with_the_fused_cpu_kernel():
    # The Trainer's AdamW has fused=None: on CPU torch would take its per-tensor loop.
    params = make_params()
    user = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    build = lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)  # noqa: E731
    opt = OffloadedOptimizer(user, build, {id(p): f"p{i}" for i, p in enumerate(params)},
                             HostOffloadConfig(device="cpu", sub_group_size=512), ParamPlan(host=params))
    assert all(g["fused"] is True and g["foreach"] is False for c in opt.chunks for g in c.optimizer.param_groups)
    assert opt.param_groups[0]["fused"] is None  # what the caller sees is unchanged
    opt.close()
