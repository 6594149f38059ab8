"""Models as users bring them, on 2 gloo ranks, against plain-PyTorch single-process references.

- Ranks that built different weights train as DDP would: from rank 0's (stages 0-3).
- A bf16 checkpoint (``dtype="auto"``) trained with bf16 at lr 1e-6 moves every weight, as an
  fp32-master reference does: no update is lost to bf16 rounding (stages 0-3).
- A LoRA on a bf16 base without ``--bf16``: the frozen base stays bf16 (bytes per rank), and the
  losses are those of the same model in plain PyTorch from step 1.

The references are written from the user's side (``from_pretrained``, ``get_peft_model``,
``torch.optim.AdamW``), not with hf_zero's helpers.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call

from _drift_bound import adam_step_drift, assert_within, gradient_noise
from _launch import torchrun
from _models import make_data, tiny_model
from user_weights_worker import LORA_TARGETS, MICRO, SEQ, STEPS

pytestmark = pytest.mark.slow

WORLD = 2
STAGES = [0, 1, 2, 3]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("user_weights")
    torchrun("tests/distributed/user_weights_worker.py", str(tmp), str(tmp / "out.pt"), nproc=WORLD)
    return {"results": torch.load(tmp / "out.pt", weights_only=False), "workdir": tmp}


def _reference(model, lr: float, stage: int, compute: torch.dtype) -> dict:
    """One process, the global batch of both ranks, fp32 trainable weights (the masters) and the
    compute dtype of the stage's family: autocast at stages 0/1, parameters cast to 16 bit at
    stages 2/3 (FSDP2's mixed precision)."""
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    data = make_data(STEPS, 1, WORLD, MICRO, SEQ)
    losses = []
    drift = {id(p): torch.zeros_like(p) for p in trainable}  # what reduction order may move (_drift_bound.py)
    for step in range(STEPS):
        ids = data[step, 0].reshape(WORLD * MICRO, SEQ)
        if compute == torch.float32:
            out = model(input_ids=ids, labels=ids)
        elif stage in (0, 1):
            with torch.autocast("cpu", dtype=compute):
                out = model(input_ids=ids, labels=ids)
        else:
            cast = {n: p.to(compute) for n, p in model.named_parameters()}
            out = functional_call(model, cast, args=(), kwargs={"input_ids": ids, "labels": ids}, tie_weights=True)
        out.loss.float().backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        delta = gradient_noise(p.grad for p in trainable)
        opt.step()
        for p in trainable:
            drift[id(p)] += adam_step_drift(opt.state[p]["exp_avg_sq"], int(opt.state[p]["step"]), lr, (0.9, 0.999),
                                            1e-8, delta)
        opt.zero_grad(set_to_none=True)
        losses.append(float(out.loss.detach()))
    keyed = model.state_dict(keep_vars=True)
    return {"losses": losses, "final": {k: v.detach().float().clone() for k, v in keyed.items()},
            "drift": {k: drift.get(id(v), 0.0) for k, v in keyed.items()}}


def _load_bf16(workdir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(workdir / "bf16", dtype="auto")


def _deviation(got: dict, ref: dict, initial: dict) -> float:
    """|w_engine - w_ref| / |w_ref - w_initial| over all weights."""
    num = sum(float(((got[k] - ref[k]) ** 2).sum()) for k in ref)
    den = sum(float(((ref[k] - initial[k]) ** 2).sum()) for k in ref)
    return math.sqrt(num / den)


@pytest.mark.parametrize("stage", STAGES)
def test_ranks_with_different_weights_start_from_rank0(runs, stage):
    got = runs["results"][f"seeds-s{stage}"]
    ref = _reference(tiny_model("llama", seed=0), 5e-3, stage, torch.float32)
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=0)
    assert set(got["final"]) == set(ref["final"])
    for name, tensor in ref["final"].items():
        assert_within(got["final"][name], tensor, ref["drift"][name], name, STEPS)
    # The control: rank 1's own start (seed 1) would have given another first loss.
    other = _reference(tiny_model("llama", seed=1), 5e-3, stage, torch.float32)
    assert abs(other["losses"][0] - ref["losses"][0]) > 1e-3


@pytest.mark.parametrize("stage", STAGES)
def test_bf16_checkpoint_at_tiny_lr_moves_every_weight(runs, stage):
    got = runs["results"][f"bf16ckpt-s{stage}"]
    initial = {k: v.float() for k, v in _load_bf16(runs["workdir"]).state_dict().items()}
    ref = _reference(_load_bf16(runs["workdir"]), 1e-6, stage, torch.bfloat16)
    assert set(got["final"]) == set(ref["final"]) == set(initial)
    ref_still = [k for k in initial if torch.equal(ref["final"][k], initial[k])]
    got_still = [k for k in initial if torch.equal(got["final"][k], initial[k])]
    assert not ref_still  # the fp32-master reference moves every tensor ...
    assert not got_still, f"{len(got_still)} of {len(initial)} tensors never moved: {got_still[:5]}"  # ... so must we
    # ... and by the reference's amounts (Adam steps of ~lr per element; bf16 compute noise aside).
    assert _deviation(got["final"], ref["final"], initial) < 0.05
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=2e-3, atol=0)
    # In bf16 (what stepping the loaded parameters would keep) most of the update is lost: the control.
    lost = [k for k in initial if torch.equal(ref["final"][k].bfloat16().float(), initial[k])]
    assert lost


@pytest.mark.parametrize("stage", STAGES)
def test_lora_on_bf16_base_keeps_the_base_bf16(runs, stage):
    from peft import LoraConfig, get_peft_model

    got = runs["results"][f"lora-s{stage}"]
    torch.manual_seed(100)  # rank 0's seed: the LoRA every rank must start from
    model = get_peft_model(_load_bf16(runs["workdir"]),
                           LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights="gaussian"))
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}  # peft's own upcast
    ref = _reference(model, 5e-3, stage, torch.float32)

    torch.testing.assert_close(got["losses"], ref["losses"], rtol=2e-5, atol=0)
    for name, tensor in ref["final"].items():
        assert_within(got["final"][name], tensor, ref["drift"][name], name, STEPS)
    for r in got["ranks"]:
        assert r["frozen_dtypes"] == ["torch.bfloat16"] and r["trainable_dtypes"] == ["torch.float32"]
    param_bytes = [r["param_bytes"] for r in got["ranks"]]
    if stage in (0, 1):
        assert param_bytes == [frozen * 2 + lora * 4] * WORLD
    else:  # sharded: 2 bytes per frozen element, 4 per LoRA element, split over the ranks
        assert sum(param_bytes) == frozen * 2 + lora * 4
        assert max(param_bytes) < (frozen * 2 + lora * 4) * 0.55
