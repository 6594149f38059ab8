"""Muon on 2 gloo ranks at ZeRO stages 0-3 gives the weights of a single-process plain-torch run,
and resumes from hf_zero's sharded checkpoint exactly.

One torchrun launch (``muon_worker.py``) trains every case in sequence; the reference here applies
Muon's formula to the *full* matrices (momentum, Nesterov, quintic Newton-Schulz with DeepSpeed's
coefficients, ``sqrt(max(1, rows/cols))``, decoupled decay) and ``torch.optim.AdamW`` to the rest,
after clipping the raw gradients as hf_zero's engine does. A Muon that orthogonalized each rank's
shard instead of the matrix, or split the parameters differently, would not reach it.

The model has a dimension that 2 ranks cannot split evenly (``intermediate_size`` 37, vocabulary
101), so uneven FSDP2 shards are covered.
"""

from __future__ import annotations

import math

import pytest
import torch

from _drift_bound import adam_step_drift, assert_within, gradient_noise, muon_step_drift

pytestmark = pytest.mark.slow

WORLD = 2
STEPS = 3
MICRO, SEQ, VOCAB = 2, 8, 101
MUON_LR, ADAM_LR, MOMENTUM, WD, BETAS, EPS, CLIP = 0.02, 3e-3, 0.9, 0.1, (0.9, 0.95), 1e-8, 1.0
CASES = {
    "stage0": {"stage": 0},
    "stage1": {"stage": 1},
    "stage2": {"stage": 2},
    "stage3": {"stage": 3},
    "stage3-offload-param": {"stage": 3, "offload_param": {"device": "cpu"}},
}


def tiny_llama():
    """Llama, hidden 32, 2 layers; gate/up are [37, 32] and the embedding [101, 32] (uneven shards)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def make_data(world: int) -> torch.Tensor:
    """Token ids (steps, world, micro, seq): rank r reads ``data[s, r]``; the reference all of ``data[s]``."""
    return torch.randint(0, VOCAB, (STEPS, world, MICRO, SEQ), generator=torch.Generator().manual_seed(5))


# MuonWithAuxAdam on DTensors built by hand: name -> (shape, sharded dim). Three dim-0 matrices
# make a round with one idle rank, (1, 4) leaves rank 1 no rows, and the dim-1 one takes the
# full_tensor() path (not FSDP2's layout).
DIRECT = {"a": ((5, 3), 0), "b": ((1, 4), 0), "c": ((7, 6), 0), "d": ((6, 5), 1)}


def direct_data() -> tuple[dict, list[dict]]:
    gen = torch.Generator().manual_seed(11)
    init = {k: torch.randn(*shape, generator=gen) for k, (shape, _) in DIRECT.items()}
    grads = [{k: torch.randn(*shape, generator=gen) for k, (shape, _) in DIRECT.items()} for _ in range(STEPS)]
    return init, grads


def muon_config(zero: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "zero_optimization": zero,
        "optimizer": {"type": "Muon", "params": {
            "muon_lr": MUON_LR, "adam_lr": ADAM_LR, "momentum": MOMENTUM, "weight_decay": WD,
            "betas": list(BETAS), "eps": EPS, "ns_method": "gram"}},
    }


# --------------------------------------------------------------------------- the reference
def _orthogonalized(u: torch.Tensor) -> torch.Tensor:
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = u.shape[0] > u.shape[1]
    x = (u.T if tall else u).double()
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(5):
        s = x @ x.T
        x = a * x + b * s @ x + c * s @ s @ x
    x = x.T if tall else x
    return (x * math.sqrt(max(1.0, u.shape[0] / u.shape[1]))).float()


def _muon_reference(w: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    m = torch.zeros_like(w)
    for g in grads:
        m = MOMENTUM * m + (1 - MOMENTUM) * g
        w = w * (1 - MUON_LR * WD) - MUON_LR * _orthogonalized((1 - MOMENTUM) * g + MOMENTUM * m)
    return w


def reference_run() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor | float]]:
    """The final weights, and per weight how far reduction order alone may move a sharded run
    from them (``_drift_bound.py``: Adam's bound per entry from its second moment, Muon's per matrix)."""
    model = tiny_llama()
    named = dict(model.named_parameters())
    is_matrix = {n: p.ndim >= 2 and "embed" not in n and "lm_head" not in n for n, p in named.items()}
    adam = torch.optim.AdamW([p for n, p in named.items() if not is_matrix[n]], lr=ADAM_LR, betas=BETAS, eps=EPS,
                             weight_decay=WD)
    momentum = {n: torch.zeros_like(p) for n, p in named.items() if is_matrix[n]}
    drift = {n: STEPS * muon_step_drift(MUON_LR, p.shape) if is_matrix[n] else torch.zeros_like(p)
             for n, p in named.items()}
    data = make_data(WORLD)
    for step in range(STEPS):
        ids = data[step].reshape(WORLD * MICRO, SEQ)
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        delta = gradient_noise(p.grad for p in named.values())
        with torch.no_grad():
            for n, m in momentum.items():
                p = named[n]
                m.mul_(MOMENTUM).add_(p.grad, alpha=1 - MOMENTUM)
                update = _orthogonalized((1 - MOMENTUM) * p.grad + MOMENTUM * m)
                p.mul_(1 - MUON_LR * WD).sub_(MUON_LR * update)
        adam.step()
        for n, p in named.items():
            if not is_matrix[n]:
                state = adam.state[p]
                drift[n] += adam_step_drift(state["exp_avg_sq"], int(state["step"]), ADAM_LR, BETAS, EPS, delta)
        model.zero_grad(set_to_none=True)
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}, drift


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from _launch import torchrun

    tmp = tmp_path_factory.mktemp("muon")
    torchrun("tests/distributed/muon_worker.py", str(tmp / "out.pt"), str(tmp / "checkpoints"), nproc=WORLD)
    return torch.load(tmp / "out.pt", weights_only=False)


@pytest.fixture(scope="module")
def reference():
    final, drift = reference_run()
    return {"initial": {k: v.detach().clone() for k, v in tiny_llama().state_dict().items()}, "final": final,
            "drift": drift}


@pytest.mark.parametrize("case", list(CASES))
def test_weights_match_the_full_matrix_reference(case, runs, reference):
    """Entry by entry within what reduction order explains (``_drift_bound.py``): a Muon that
    orthogonalized shards, or an Adam entry stepped wrongly, is off by about an ``lr``."""
    got, ref, initial = runs[case]["final_state"], reference["final"], reference["initial"]
    assert set(got) == set(ref)
    for name, tensor in ref.items():
        assert_within(got[name], tensor, reference["drift"][name], name, STEPS)
        assert not torch.equal(tensor, initial[name]), name  # every weight moved (the reference can fail)


@pytest.mark.parametrize("case", list(CASES))
def test_matrices_go_to_muon_and_its_momentum_is_sharded_as_the_stage_says(case, runs):
    ranks = runs[case]["ranks"]
    assert all(r["optimizer"] == "MuonWithAuxAdam" for r in ranks)
    momentum = [r["momentum"] for r in ranks]
    assert all(use_muon for m in momentum for use_muon, _, _ in m.values())
    stage = CASES[case]["stage"]
    every = set(momentum[0]) | set(momentum[1])
    assert every == {f"model.layers.{i}.{m}.weight" for i in range(2) for m in
                     ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    if stage == 0:
        assert momentum[0] == momentum[1]  # replicated
    elif stage == 1:
        assert set(momentum[0]).isdisjoint(momentum[1])  # each matrix stepped whole by one rank
        assert all(local == full for m in momentum for _, local, full in m.values())
    else:
        for name in every:  # dim-0 shards of the momentum, 19 + 18 rows for gate/up
            assert momentum[0][name][1] + momentum[1][name][1] == momentum[0][name][2], name
            assert momentum[0][name][1] < momentum[0][name][2], name
    adam = set(ranks[0]["adam_params"]) | set(ranks[1]["adam_params"])
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= adam


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_resumed_run_continues_exactly(stage, runs):
    """hf_zero's sharded checkpoint brings back Muon's momentum and the Adam half's moments."""
    assert runs["resume"][stage] == 0.0


def test_hand_built_dtensors_match_the_formula(runs):
    """Rounds with an idle rank, a shard without rows, and a dim-1 layout (gathered whole)."""
    init, grads = direct_data()
    for name, got in runs["direct"].items():
        ref = _muon_reference(init[name], [g[name] for g in grads])
        # Same inputs on every rank and in the reference: only the fp32 iteration's rounding differs.
        assert_within(got, ref, STEPS * muon_step_drift(MUON_LR, ref.shape), name, STEPS)
        assert (ref - init[name]).abs().max() > 1e-3
