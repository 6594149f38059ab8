"""Muon (``optimizer.type: "Muon"``) against the update rule written out here, torch's AdamW and Muon,
and DeepSpeed's own MuonWithAuxAdam when a DeepSpeed venv is at hand; the config keys and errors."""

from __future__ import annotations

import math
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from hf_zero.config import ZeroConfigError, load_config, parse_config
from hf_zero.config.refused import UNSUPPORTED_WITH_OPTIMIZER
from hf_zero.config.schema import OptimizerConfig
from hf_zero.optim import MuonWithAuxAdam, build_optimizer, muon_param_groups, uses_muon

REPO = Path(__file__).resolve().parents[2]
DS_PYTHON = os.environ.get("HF_ZERO_DEEPSPEED_PYTHON", "/tmp/ds-venv/bin/python")
STEPS = 4


# --------------------------------------------------------------------------- the formula, by hand
def _newton_schulz(m: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Quintic Newton-Schulz with DeepSpeed's coefficients, in float64, one matrix."""
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = m.shape[0] > m.shape[1]
    x = m.T if tall else m
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + b * s @ x + c * s @ s @ x
    return x.T if tall else x


def _muon_reference(w, grads, lr, beta, wd, nesterov=True):
    w, m = w.double(), torch.zeros_like(w, dtype=torch.float64)
    rows, cols = w.shape[-2], w.shape[-1]
    for g in grads:
        g = g.double()
        m = beta * m + (1 - beta) * g
        u = (1 - beta) * g + beta * m if nesterov else m
        o = _newton_schulz(u.reshape(u.shape[0], -1)).reshape(u.shape) * math.sqrt(max(1.0, rows / cols))
        w = w * (1 - lr * wd) - lr * o
    return w


def _grads(shape, n=STEPS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen) for _ in range(n)]


def _run_muon(shape, method, nesterov=True, ns_dtype=None, lr=0.05, beta=0.9, wd=0.1):
    w0 = torch.randn(*shape, generator=torch.Generator().manual_seed(7))
    p = torch.nn.Parameter(w0.clone())
    opt = MuonWithAuxAdam([{"params": [p], "use_muon": True}], lr=lr, momentum=beta, weight_decay=wd,
                          ns_method=method, nesterov=nesterov, ns_dtype=ns_dtype)
    grads = _grads(shape)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach(), _muon_reference(w0, grads, lr, beta, wd, nesterov), w0


@pytest.mark.parametrize("shape", [(16, 40), (40, 16), (24, 24)], ids=["wide", "tall", "square"])
@pytest.mark.parametrize("method", ["gram", "standard"])
def test_muon_matches_the_formula_in_fp32(shape, method):
    got, ref, w0 = _run_muon(shape, method)  # CPU: the iteration runs in fp32
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-5)
    assert (got - w0).abs().max() > 0.05  # it moved by a Muon-sized step


def test_muon_without_nesterov_matches_the_formula():
    got, ref, _ = _run_muon((24, 40), "standard", nesterov=False)
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-5)
    _, with_nesterov, _ = _run_muon((24, 40), "standard", nesterov=True)
    assert (with_nesterov - ref).abs().max() > 1e-3  # the flag matters, so the test can tell


def test_four_dim_weights_are_orthogonalized_as_out_by_rest():
    got, ref, _ = _run_muon((6, 4, 3, 3), "gram")
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-5)


def test_explicit_half_precision_iteration_is_close_to_fp32():
    fp32, _, w0 = _run_muon((32, 48), "gram", ns_dtype="float32")
    fp16, _, _ = _run_muon((32, 48), "gram", ns_dtype="float16")
    bf16, _, _ = _run_muon((32, 48), "standard", ns_dtype="bfloat16")
    step = (fp32 - w0).abs().max()
    assert 0 < (fp16 - fp32).abs().max() < 0.02 * step
    assert 0 < (bf16 - fp32).abs().max() < 0.05 * step


def test_same_update_as_torch_muon_in_bf16():
    """torch.optim.Muon (bf16 iteration, sqrt(max(1, A/B)) scaling, Nesterov, decoupled decay) and
    the "standard" method in bf16 differ only by rounding."""
    for shape in [(16, 40), (40, 16)]:
        w0 = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
        ours, theirs = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
        a = MuonWithAuxAdam([{"params": [ours], "use_muon": True}], lr=0.02, momentum=0.95, weight_decay=0.1,
                            ns_method="standard", ns_dtype="bfloat16")
        b = torch.optim.Muon([theirs], lr=0.02, momentum=0.95, weight_decay=0.1, nesterov=True,
                             adjust_lr_fn="original")
        for g in _grads(shape, 3):
            ours.grad, theirs.grad = g.clone(), g.clone()
            a.step()
            b.step()
        step = (theirs - w0).abs().max()
        assert (ours - theirs).abs().max() < 0.05 * step


def test_non_finite_gradient_keeps_the_momentum():
    p = torch.nn.Parameter(torch.ones(8, 12))
    opt = MuonWithAuxAdam([{"params": [p], "use_muon": True}], lr=0.01)
    p.grad = torch.randn(8, 12)
    opt.step()
    kept = opt.state[p]["momentum_buffer"].clone()
    p.grad = torch.full((8, 12), float("inf"))
    opt.step()
    torch.testing.assert_close(opt.state[p]["momentum_buffer"], kept, rtol=0, atol=0)
    assert not torch.isfinite(p).all()  # the overflow shows in the weights, as in DeepSpeed


# --------------------------------------------------------------------------- the Adam half
def _mixed_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(12, 20, generator=gen), "b": torch.randn(20, generator=gen),
            "emb": torch.randn(10, 12, generator=gen)}


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_adam_half_is_torch_adamw(adam_w_mode):
    init = _mixed_params()
    grads = [_mixed_params(seed=s + 1) for s in range(STEPS)]
    ours = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    plain = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    opt = MuonWithAuxAdam([{"params": [ours["w"]], "use_muon": True},
                           {"params": [ours["b"], ours["emb"]], "use_muon": False}],
                          lr=0.05, adam_lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1, adam_w_mode=adam_w_mode)
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    hyper = dict(lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    fused_ref = cls([plain["b"], plain["emb"]], fused=True, **hyper)
    loop = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    loop_ref = cls([loop["b"], loop["emb"]], foreach=False, **hyper)
    for g in grads:
        for params in (ours, plain, loop):
            for k, p in params.items():
                p.grad = g[k].clone()
        opt.step()
        fused_ref.step()
        loop_ref.step()
    for k in ("b", "emb"):
        torch.testing.assert_close(ours[k], plain[k], rtol=0, atol=0)  # the same kernel: bit for bit
        torch.testing.assert_close(ours[k], loop[k], rtol=1e-6, atol=1e-7)
    assert set(opt.state[ours["b"]]) == {"step", "exp_avg", "exp_avg_sq"}
    assert set(opt.state[ours["w"]]) == {"momentum_buffer"}


def test_group_settings_override_both_halves():
    """A Trainer-style no-decay group stays undecayed in both halves (DeepSpeed keeps group keys)."""
    w, b = torch.nn.Parameter(torch.ones(8, 8)), torch.nn.Parameter(torch.ones(8))
    groups = muon_param_groups([{"params": [w, b], "weight_decay": 0.0}], {id(w): "layer.weight", id(b): "layer.bias"})
    assert [(g["use_muon"], g["weight_decay"]) for g in groups] == [(True, 0.0), (False, 0.0)]
    opt = MuonWithAuxAdam(groups, lr=0.1, weight_decay=0.5)
    w.grad, b.grad = torch.zeros(8, 8), torch.zeros(8)
    opt.step()
    torch.testing.assert_close(w.detach(), torch.ones(8, 8))  # no decay, zero update
    torch.testing.assert_close(b.detach(), torch.ones(8))


def test_state_dict_round_trip_resumes_the_same_run():
    def build(params):
        return MuonWithAuxAdam([{"params": [params["w"]], "use_muon": True},
                                {"params": [params["b"], params["emb"]], "use_muon": False}],
                               lr=0.05, adam_lr=0.01, weight_decay=0.1)

    init, grads = _mixed_params(), [_mixed_params(seed=s + 1) for s in range(STEPS)]
    straight = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    opt = build(straight)
    for g in grads:
        for k, p in straight.items():
            p.grad = g[k].clone()
        opt.step()
    resumed = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    first = build(resumed)
    for g in grads[:2]:
        for k, p in resumed.items():
            p.grad = g[k].clone()
        first.step()
    second = build(resumed)
    second.load_state_dict(first.state_dict())
    for g in grads[2:]:
        for k, p in resumed.items():
            p.grad = g[k].clone()
        second.step()
    for k in init:
        torch.testing.assert_close(resumed[k], straight[k], rtol=0, atol=0)


def test_groups_must_say_use_muon_and_muon_groups_hold_matrices():
    with pytest.raises(ValueError, match="use_muon"):
        MuonWithAuxAdam([torch.nn.Parameter(torch.ones(4, 4))])
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        MuonWithAuxAdam([{"params": [torch.nn.Parameter(torch.ones(4))], "use_muon": True}])
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\)"):
        MuonWithAuxAdam([{"params": [torch.nn.Parameter(torch.ones(4, 4))], "use_muon": True}], momentum=1.0)


# --------------------------------------------------------------------------- which parameters
def _tiny_llama(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("tie", [False, True])
def test_deepspeeds_rule_splits_a_causal_lm(tie):
    model = _tiny_llama(tie)
    named = dict(model.named_parameters())
    muon = {n for n, p in named.items() if uses_muon(n, p)}
    assert muon == {f"model.layers.0.{m}.weight" for m in
                    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    groups = muon_param_groups([{"params": list(named.values())}], {id(p): n for n, p in named.items()})
    assert [g["use_muon"] for g in groups] == [True, False]
    adam = {n for n, p in named.items() if any(p is q for q in groups[1]["params"])}
    assert "model.embed_tokens.weight" in adam and "model.norm.weight" in adam
    assert ("lm_head.weight" in adam) is (not tie)  # tied: one parameter, named embed_tokens


# --------------------------------------------------------------------------- the config
def _error(raw) -> str:
    with pytest.raises(ZeroConfigError) as err:
        parse_config(raw)
    return str(err.value)


def test_config_parses_with_deepspeeds_keys():
    cfg = parse_config({"optimizer": {"type": "Muon", "params": {
        "lr": 0.01, "muon_lr": 0.03, "adam_lr": 2e-4, "momentum": 0.9, "weight_decay": 0.1, "ns_method": "standard",
        "betas": [0.8, 0.99], "eps": 1e-9, "adam_w_mode": False, "torch_adam": True}}}).optimizer
    assert (cfg.type, cfg.lr, cfg.muon_lr, cfg.adam_lr, cfg.momentum, cfg.weight_decay, cfg.ns_method, cfg.betas,
            cfg.eps, cfg.adam_w_mode) == ("muon", 0.01, 0.03, 2e-4, 0.9, 0.1, "standard", (0.8, 0.99), 1e-9, False)
    w, b = torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.ones(4))
    opt = build_optimizer(cfg, [{"params": [w], "use_muon": True}, {"params": [b], "use_muon": False}])
    assert [g["lr"] for g in opt.param_groups] == [0.03, 2e-4]
    assert type(opt._aux) is torch.optim.Adam  # adam_w_mode false: L2 decay


def test_absent_keys_take_deepspeeds_muon_defaults():
    cfg = parse_config({"optimizer": {"type": "muon"}}).optimizer
    assert (cfg.muon_lr, cfg.adam_lr, cfg.momentum, cfg.weight_decay, cfg.betas, cfg.eps, cfg.ns_method) == \
        (0.02, 3e-4, 0.95, 0.0, (0.9, 0.95), 1e-10, "gram")
    shared = parse_config({"optimizer": {"type": "Muon", "params": {"lr": 0.005}}}).optimizer
    w, b = torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.ones(4))
    opt = build_optimizer(shared, [{"params": [w], "use_muon": True}, {"params": [b], "use_muon": False}])
    assert [g["lr"] for g in opt.param_groups] == [0.005, 0.005]  # lr is both halves' lr


def test_auto_values_come_from_training_arguments(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), learning_rate=0.004, weight_decay=0.05, adam_beta1=0.85,
                             adam_beta2=0.97, adam_epsilon=1e-7, use_cpu=True, report_to=[])
    raw = {"optimizer": {"type": "Muon", "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto",
                                                    "eps": "auto", "adam_lr": 1e-3}}}
    cfg = load_config(raw, args, world_size=1).optimizer
    assert (cfg.lr, cfg.weight_decay, cfg.betas, cfg.eps, cfg.muon_lr, cfg.adam_lr) == \
        (0.004, 0.05, (0.85, 0.97), 1e-7, None, 1e-3)
    assert "muon_lr" in _error({"optimizer": {"type": "Muon", "params": {"muon_lr": "auto"}}})


@pytest.mark.parametrize("params, names", [
    ({"momentum": 1.5}, ("optimizer.params.momentum", "must be <= 1")),
    ({"momentum": 1.0}, ("optimizer.params.momentum", "must be < 1 for Muon")),
    ({"ns_method": "fast"}, ("optimizer.params.ns_method", '"gram", "standard"')),
    ({"ns_method": "Gram"}, ("optimizer.params.ns_method", 'did you mean "gram"')),
    ({"ns_steps": 3}, ("optimizer.params.ns_steps", "always runs 5 Newton-Schulz steps")),
    ({"nesterov": False}, ("optimizer.params.nesterov", "always uses Nesterov momentum")),
    ({"amsgrad": True}, ("optimizer.params.amsgrad", "is not a parameter of Muon")),
    ({"muon_lr": -1}, ("optimizer.params.muon_lr", "must be >= 0")),
    ({"per_head_muon": True}, ("optimizer.params.per_head_muon", "remove per_head_muon")),
])
def test_bad_params_name_the_key(params, names):
    message = _error({"optimizer": {"type": "Muon", "params": params}})
    for text in names:
        assert text in message


def test_muon_keys_belong_to_muon():
    assert "optimizer.params.muon_lr" in _error({"optimizer": {"type": "AdamW", "params": {"muon_lr": 0.02}}})


def test_per_head_muon_false_is_accepted_with_no_effect():
    cfg = parse_config({"optimizer": {"type": "Muon", "params": {"per_head_muon": False}}})
    assert "optimizer.params.per_head_muon" in cfg.no_effect_keys


@pytest.mark.parametrize("zero", [
    {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/x"}},
    {"stage": 1, "cpu_offload": True},
])
def test_optimizer_offload_is_refused_with_muon(zero):
    message = _error({"zero_optimization": zero, "optimizer": {"type": "Muon"}})
    assert "zero_optimization.offload_optimizer.device" in message and 'with optimizer type "Muon"' in message
    assert 'offload_optimizer.device to "none"' in message


def test_muon_runs_with_offload_param_and_reduce_scatter_false():
    """offload_param alone is allowed; reduce_scatter false (which DeepSpeed's stage-3 Muon needs) is a
    no-effect key, and save_muon_momentum_buffer_in_memory too."""
    cfg = parse_config({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "reduce_scatter": False,
                                              "save_muon_momentum_buffer_in_memory": True},
                        "optimizer": {"type": "Muon"}})
    assert {"zero_optimization.reduce_scatter", "zero_optimization.save_muon_momentum_buffer_in_memory"} <= \
        set(cfg.no_effect_keys)


def test_docs_list_the_muon_refusals():
    page = (REPO / "docs" / "config_reference.md").read_text()
    for key in UNSUPPORTED_WITH_OPTIMIZER["muon"]:
        assert f"`{key}`" in page
    for key in ("muon_lr", "adam_lr", "ns_method", "per_head_muon"):
        assert f"`{key}`" in page


def test_build_optimizer_refuses_auto_and_untagged_groups():
    with pytest.raises(ValueError, match="optimizer.params.lr"):
        build_optimizer(OptimizerConfig(type="muon", lr="auto"), [{"params": [torch.nn.Parameter(torch.ones(2, 2))],
                                                                   "use_muon": True}])
    with pytest.raises(ValueError, match="muon_param_groups"):
        build_optimizer(OptimizerConfig(type="muon"), [torch.nn.Parameter(torch.ones(2, 2))])


# --------------------------------------------------------------------------- DeepSpeed itself
_DS_SCRIPT = textwrap.dedent("""
    import sys, torch
    import deepspeed.runtime.zero.muon.original_muon as om
    om.ns_compute_dtype = lambda method="gram": torch.float32  # its CPU accelerator would pick bf16/fp16
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    data = torch.load(sys.argv[1])
    params = {k: torch.nn.Parameter(v.clone()) for k, v in data["init"].items()}
    groups = [dict(params=[params["w1"], params["w2"]], use_muon=True, lr=0.05, momentum=0.9, weight_decay=0.1,
                   ns_method=data["method"]),
              dict(params=[params["b"], params["emb"]], use_muon=False, lr=0.01, betas=(0.9, 0.95), eps=1e-10,
                   weight_decay=0.1)]
    opt = MuonWithAuxAdam(groups, adam_optimizer=torch.optim.AdamW, adam_optimizer_kwargs={})
    for g in data["grads"]:
        for k, p in params.items():
            p.grad = g[k].clone()
        opt.step()
    torch.save({k: p.detach() for k, p in params.items()}, sys.argv[2])
""")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(DS_PYTHON), reason=f"no DeepSpeed venv at {DS_PYTHON} "
                    "(set HF_ZERO_DEEPSPEED_PYTHON to a python with deepspeed installed)")
@pytest.mark.parametrize("method", ["gram", "standard"])
def test_matches_deepspeeds_muon_with_aux_adam(method, tmp_path):
    gen = torch.Generator().manual_seed(0)
    shapes = {"w1": (12, 20), "w2": (20, 12), "b": (20,), "emb": (10, 12)}
    init = {k: torch.randn(*s, generator=gen) for k, s in shapes.items()}
    grads = [{k: torch.randn(*s, generator=gen) for k, s in shapes.items()} for _ in range(STEPS)]
    torch.save({"init": init, "grads": grads, "method": method}, tmp_path / "in.pt")
    (tmp_path / "ds.py").write_text(_DS_SCRIPT)
    subprocess.run([DS_PYTHON, str(tmp_path / "ds.py"), str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                   check=True, capture_output=True, timeout=300, env={**os.environ, "TORCHDYNAMO_DISABLE": "1"})
    theirs = torch.load(tmp_path / "out.pt")

    params = {k: torch.nn.Parameter(v.clone()) for k, v in init.items()}
    opt = MuonWithAuxAdam([{"params": [params["w1"], params["w2"]], "use_muon": True},
                           {"params": [params["b"], params["emb"]], "use_muon": False}],
                          lr=0.05, momentum=0.9, weight_decay=0.1, ns_method=method, adam_lr=0.01)
    for g in grads:
        for k, p in params.items():
            p.grad = g[k].clone()
        opt.step()
    for k, p in params.items():
        torch.testing.assert_close(p.detach(), theirs[k], rtol=0, atol=1e-6, msg=k)
        assert (p.detach() - init[k]).abs().max() > 1e-3
