"""build_optimizer, Lion and Lamb against update rules written out by hand (3 steps each)."""

from __future__ import annotations

import math

import pytest
import torch

from hf_zero.config.schema import OptimizerConfig
from hf_zero.optim import Lamb, Lion, build_optimizer, optimizer_state_bytes

STEPS = 3


def _start() -> torch.Tensor:
    return torch.tensor([[0.5, -1.0, 2.0], [0.25, -0.75, 1.5]], dtype=torch.float64)


def _grads() -> list[torch.Tensor]:
    # Fixed gradients, one per step; element [0, 1] is 0 on every step (Lion's sign(0) case).
    return [
        torch.tensor([[0.1, 0.0, -0.3], [0.2, -0.05, 0.4]], dtype=torch.float64),
        torch.tensor([[-0.2, 0.0, 0.1], [0.3, 0.15, -0.1]], dtype=torch.float64),
        torch.tensor([[0.05, 0.0, -0.2], [-0.1, 0.25, 0.3]], dtype=torch.float64),
    ]


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], grads_per_param: list[list[torch.Tensor]]):
    for step in range(STEPS):
        for p, grads in zip(params, grads_per_param):
            p.grad = grads[step].clone()
        opt.step()


def _one_param(cfg: OptimizerConfig) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    p = torch.nn.Parameter(_start())
    opt = build_optimizer(cfg, [p])
    _run(opt, [p], [_grads()])
    return p.detach(), opt


# --------------------------------------------------------------------------- Adam family
def _adam_reference(lr, b1, b2, eps, wd, decoupled: bool) -> torch.Tensor:
    p = _start()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    for t, g in enumerate(_grads(), start=1):
        if decoupled:
            p = p * (1 - lr * wd)  # AdamW: decay the weights
        else:
            g = g + wd * p  # Adam: L2 term in the gradient
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat = m / (1 - b1**t)
        v_hat = v / (1 - b2**t)
        p = p - lr * m_hat / (v_hat.sqrt() + eps)
    return p


ADAM_KW = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


def test_adamw_matches_reference():
    p, opt = _one_param(OptimizerConfig(type="adamw", **ADAM_KW))
    assert type(opt) is torch.optim.AdamW
    torch.testing.assert_close(p, _adam_reference(0.01, 0.9, 0.99, 1e-8, 0.1, decoupled=True))


def test_adam_default_is_adamw():
    # DeepSpeed: "Optimizer name of Adam forces AdamW logic unless adam_w_mode is explicitly set".
    p, opt = _one_param(OptimizerConfig(type="adam", **ADAM_KW))
    assert type(opt) is torch.optim.AdamW
    torch.testing.assert_close(p, _adam_reference(0.01, 0.9, 0.99, 1e-8, 0.1, decoupled=True))


def test_adam_w_mode_false_is_adam_with_l2():
    p_l2, opt = _one_param(OptimizerConfig(type="adam", adam_w_mode=False, **ADAM_KW))
    assert type(opt) is torch.optim.Adam
    torch.testing.assert_close(p_l2, _adam_reference(0.01, 0.9, 0.99, 1e-8, 0.1, decoupled=False))
    p_w, _ = _one_param(OptimizerConfig(type="adam", adam_w_mode=True, **ADAM_KW))
    # The two modes really differ (by the weight-decay placement only).
    assert (p_l2 - p_w).abs().max() > 1e-6


def test_adamw_ignores_adam_w_mode_false():
    _, opt = _one_param(OptimizerConfig(type="adamw", adam_w_mode=False, **ADAM_KW))
    assert type(opt) is torch.optim.AdamW


def test_adam_uses_fused_kernel_on_cpu():
    _, opt = _one_param(OptimizerConfig(type="adamw", **ADAM_KW))
    assert opt.defaults["fused"] is True


def test_adam_bias_correction_false_rejected():
    with pytest.raises(ValueError, match="bias_correction"):
        build_optimizer(OptimizerConfig(type="adam", bias_correction=False), [torch.nn.Parameter(_start())])


# --------------------------------------------------------------------------- SGD
@pytest.mark.parametrize("nesterov,dampening", [(False, 0.1), (True, 0.0)])
def test_sgd_matches_reference(nesterov, dampening):
    lr, mom, wd = 0.1, 0.9, 0.01
    cfg = OptimizerConfig(
        type="sgd", lr=lr, momentum=mom, dampening=dampening, nesterov=nesterov, weight_decay=wd
    )
    p_out, opt = _one_param(cfg)
    assert type(opt) is torch.optim.SGD

    p = _start()
    buf = None
    for g in _grads():
        g = g + wd * p
        # torch (and DeepSpeed, which uses torch's SGD): the first buffer is the gradient itself.
        buf = g.clone() if buf is None else mom * buf + (1 - dampening) * g
        d = g + mom * buf if nesterov else buf
        p = p - lr * d
    torch.testing.assert_close(p_out, p)


# --------------------------------------------------------------------------- Lion
def _lion_reference(lr, b1, b2, wd) -> torch.Tensor:
    p = _start()
    m = torch.zeros_like(p)
    for g in _grads():
        c = b1 * m + (1 - b1) * g
        p = p * (1 - lr * wd) - lr * torch.sign(c)
        m = b2 * m + (1 - b2) * g
    return p


def test_lion_matches_reference():
    lr, b1, b2, wd = 0.01, 0.9, 0.99, 0.5
    p, opt = _one_param(OptimizerConfig(type="lion", lr=lr, betas=(b1, b2), weight_decay=wd))
    assert isinstance(opt, Lion)
    torch.testing.assert_close(p, _lion_reference(lr, b1, b2, wd))
    # sign(0) = 0: the never-touched element only decays.
    assert p[0, 1].item() == pytest.approx(-1.0 * (1 - lr * wd) ** STEPS)


def test_lion_class_defaults():
    opt = Lion([torch.nn.Parameter(_start())])
    assert opt.defaults == {"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0}


# --------------------------------------------------------------------------- Lamb
def _lamb_reference(params, grads_per_param, lr, b1, b2, eps, wd, bias_correction, max_coeff, min_coeff):
    """DeepSpeed FusedLamb kernel, written element-wise; returns final params and the last coeffs."""
    out, coeffs = [], []
    for p, grads in zip(params, grads_per_param):
        p = p.clone()
        m = torch.zeros_like(p)
        v = torch.zeros_like(p)
        for t, g in enumerate(grads, start=1):
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            update = m / (v.sqrt() + eps) + wd * p  # no bias correction inside the update
            w_norm = math.sqrt(float((p * p).sum()))
            u_norm = math.sqrt(float((update * update).sum()))
            raw = w_norm / u_norm if w_norm != 0 and u_norm != 0 else 1.0
            coeff = min(max(raw, min_coeff), max_coeff) if w_norm != 0 and u_norm != 0 else 1.0
            if bias_correction:
                step_size = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
            else:
                step_size = lr
            p = p - step_size * coeff * update
        out.append(p)
        coeffs.append(raw)
    return out, coeffs


@pytest.mark.parametrize("bias_correction", [True, False])
def test_lamb_matches_reference_with_clamp(bias_correction):
    lr, b1, b2, eps, wd = 0.01, 0.9, 0.999, 1e-6, 0.01
    starts = [
        _start(),  # trust ratio inside [min_coeff, max_coeff]
        _start() * 100.0,  # ||w|| >> ||update||: ratio clamped to max_coeff
        _start() * 1e-5,  # ||w|| << ||update||: ratio clamped to min_coeff
        torch.zeros(2, 3, dtype=torch.float64),  # ||w|| == 0: coefficient 1
    ]
    grads = [_grads() for _ in starts]
    params = [torch.nn.Parameter(s.clone()) for s in starts]
    cfg = OptimizerConfig(
        type="lamb", lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, bias_correction=bias_correction
    )
    opt = build_optimizer(cfg, params)
    assert isinstance(opt, Lamb)
    _run(opt, params, grads)

    expected, raw_ratios = _lamb_reference(starts, grads, lr, b1, b2, eps, wd, bias_correction, 10.0, 0.01)
    # The cases exercise what they claim to.
    assert 0.01 < raw_ratios[0] < 10.0
    assert raw_ratios[1] > 10.0
    assert raw_ratios[2] < 0.01
    for got, want in zip(params, expected):
        torch.testing.assert_close(got.detach(), want)


def test_lamb_defaults_rebuild_the_optimizer():
    # Stage 1 rebuilds the optimizer as cls(groups, **defaults); every key must be an __init__ kwarg.
    opt = Lamb([torch.nn.Parameter(_start())], lr=0.1, max_coeff=5.0)
    again = Lamb([torch.nn.Parameter(_start())], **opt.defaults)
    assert again.defaults == opt.defaults
    lion = Lion([torch.nn.Parameter(_start())], lr=0.1)
    assert Lion([torch.nn.Parameter(_start())], **lion.defaults).defaults == lion.defaults


def test_lion_lamb_reject_amsgrad():
    for kind in ("lion", "lamb"):
        with pytest.raises(ValueError, match="amsgrad"):
            build_optimizer(OptimizerConfig(type=kind, amsgrad=True), [torch.nn.Parameter(_start())])


# --------------------------------------------------------------------------- config handling
@pytest.mark.parametrize("field", ["lr", "betas", "eps", "weight_decay"])
def test_auto_left_in_config_raises(field):
    cfg = OptimizerConfig(type="adamw", **{field: "auto"})
    with pytest.raises(ValueError, match=f"optimizer.params.{field}"):
        build_optimizer(cfg, [torch.nn.Parameter(_start())])


def test_unknown_type_raises():
    with pytest.raises(ValueError, match="not supported"):
        build_optimizer(OptimizerConfig(type="adagrad9"), [torch.nn.Parameter(_start())])


@pytest.mark.parametrize("kind", ["adam", "adamw", "sgd", "lion", "lamb"])
def test_param_groups_kept(kind):
    a = torch.nn.Parameter(_start())
    b = torch.nn.Parameter(_start())
    groups = ({"params": (x for x in [a]), "name": "decay"}, {"params": [b], "weight_decay": 0.0, "lr": 0.5})
    opt = build_optimizer(OptimizerConfig(type=kind, lr=0.01, weight_decay=0.1), groups)
    assert len(opt.param_groups) == 2
    assert opt.param_groups[0]["params"] == [a] and opt.param_groups[1]["params"] == [b]
    assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[0]["lr"] == 0.01
    assert opt.param_groups[0]["name"] == "decay"
    assert opt.param_groups[1]["weight_decay"] == 0.0 and opt.param_groups[1]["lr"] == 0.5


def test_optimizer_state_bytes_counts_local_state():
    p = torch.nn.Parameter(torch.zeros(10, dtype=torch.float32))
    opt = build_optimizer(OptimizerConfig(type="adamw"), [p])
    assert optimizer_state_bytes(opt) == 0  # state is created on the first step
    p.grad = torch.ones(10)
    opt.step()
    step_bytes = opt.state[p]["step"].numel() * opt.state[p]["step"].element_size()
    assert optimizer_state_bytes(opt) == 2 * 10 * 4 + step_bytes  # exp_avg + exp_avg_sq + step


# --------------------------------------------------------------------------- DTensor (1 rank)
@pytest.mark.parametrize("kind", ["adamw", "sgd", "lion", "lamb"])
def test_optimizers_step_dtensor_params(one_rank_mesh, kind):
    """The same updates on DTensor (sharded) parameters as on plain ones.

    One rank only checks that every op runs on DTensor and gives the same numbers; that Lamb's norms
    are global across ranks is the job of a multi-rank test (norms reduce via full_tensor()).
    """
    from torch.distributed.tensor import Shard, distribute_tensor

    cfg = OptimizerConfig(type=kind, lr=0.01, weight_decay=0.1, momentum=0.9)
    plain = torch.nn.Parameter(_start().float())
    sharded = torch.nn.Parameter(distribute_tensor(_start().float(), one_rank_mesh, [Shard(0)]))
    opt_plain = build_optimizer(cfg, [plain])
    opt_sharded = build_optimizer(cfg, [sharded])
    grads = [g.float() for g in _grads()]
    _run(opt_plain, [plain], [grads])
    _run(opt_sharded, [sharded], [[distribute_tensor(g, one_rank_mesh, [Shard(0)]) for g in grads]])
    torch.testing.assert_close(sharded.detach().full_tensor(), plain.detach())
    assert optimizer_state_bytes(opt_sharded) == optimizer_state_bytes(opt_plain)
