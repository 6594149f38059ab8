"""fp16 dynamic loss scaling skips the steps DeepSpeed skips, with or without accumulation and
optimizer offload, on transformers' regression test (y = a*x + b; tests/fp16_regression.py): one
batch of 16 and four micro-batches of 4 overflow at the same steps, because DeepSpeed sums the
micro-steps in fp16 and checks the sum, and a sum of in-range quarters can overflow as one."""

from __future__ import annotations

import pytest
import torch

import hf_zero
from tests.fp16_regression import (
    DEEPSPEED,
    SCALES,
    SKIPPED,
    TOL,
    RegressionModel,
    deepspeed_fp16_reference,
    train_hf_zero,
    zero_config,
)


def _train(stage: int, batch: int, accumulation: int, offload: str, tmp_path) -> dict:
    torch.manual_seed(0)
    engine = hf_zero.initialize(RegressionModel(), zero_config(stage, batch, accumulation, offload, str(tmp_path)))
    try:
        return train_hf_zero(engine)
    finally:
        engine.close()


def test_the_reference_is_deepspeed():
    for (batch, accumulation), want in DEEPSPEED.items():
        ref = deepspeed_fp16_reference(batch, accumulation)
        assert ref["skipped"] == SKIPPED and ref["scales"] == SCALES
        assert ref["a"] == pytest.approx(want["a"], abs=TOL) and ref["b"] == pytest.approx(want["b"], abs=TOL)


CASES = [(0, "none"), (1, "none"), (2, "none"), (3, "none"), (1, "cpu"), (2, "cpu"), (3, "cpu"), (3, "nvme")]


@pytest.mark.parametrize("stage,offload", CASES, ids=[f"stage{s}-{o}" for s, o in CASES])
def test_same_effective_batch_skips_the_same_steps_as_deepspeed(stage, offload, tmp_path):
    """16 x 1 and 4 x 4 skip steps 0-3 at DeepSpeed's scales and end at its weights. Before: at
    stages 2/3, 4 x 4 summed four in-range quarters in fp32 and skipped steps 0, 1 and 4 only; at
    stages 0/1 (an fp32 forward for this model) nothing was skipped; with the optimizer offloaded
    at stages 2/3 the first overflow (nan gradients) stopped the run with "FSDP2's reduce-scatter
    output is not laid out as hf_zero expects"."""
    one = _train(stage, 16, 1, offload, tmp_path)
    four = _train(stage, 4, 4, offload, tmp_path)
    for got, shape in ((one, (16, 1)), (four, (4, 4))):
        ref = deepspeed_fp16_reference(*shape)
        assert got["skipped"] == ref["skipped"] == SKIPPED, (shape, got["skipped"])
        assert got["scales"] == ref["scales"], shape
        assert got["a"] == pytest.approx(ref["a"], abs=TOL) and got["b"] == pytest.approx(ref["b"], abs=TOL), (shape, got)
    assert four["a"] == pytest.approx(one["a"], abs=TOL) and four["b"] == pytest.approx(one["b"], abs=TOL)


@pytest.mark.parametrize("stage", [2, 3])
def test_staged_accumulation_judges_the_sum_and_leaves_no_residue(stage, tmp_path):
    """Offloaded accumulation under the fake accelerator (copies land late, poisoned until then):
    from the 2nd micro-step on, gradients are added into the host buffers by a worker
    (offload/grad_accumulation.py). The overflow is judged on the sum of all four micro-steps,
    and the four skipped windows leave nothing in the host gradients of the next one: the skips,
    scales and weights are the reference's."""
    from hf_zero.distributed import device as accel
    from tests.fake_accelerator import fake_accelerator

    with fake_accelerator():
        accel.select_device(1)
        torch.manual_seed(0)
        engine = hf_zero.initialize(RegressionModel(), zero_config(stage, 4, 4, "cpu", str(tmp_path)))
        try:
            got = train_hf_zero(engine)
            staged = engine.optimizer._staged.staged
        finally:
            engine.close()
    assert staged == 2 * 3 * 8, "the gradients were not added through the staging blocks"  # a, b x 3 adds x 8 steps
    ref = deepspeed_fp16_reference(4, 4)
    assert got["skipped"] == ref["skipped"] and got["scales"] == ref["scales"]
    assert got["a"] == pytest.approx(ref["a"], abs=TOL) and got["b"] == pytest.approx(ref["b"], abs=TOL)


def test_gradient_layout_is_checked_again_after_a_nan_step(monkeypatch):
    """The layout check of FSDP2's fp32 reduce-scatter output (offload/grad_feeds.py) takes nan for
    nan, so that an overflowed fp16 step does not stop the run; such a step proves nothing about
    the layout, so the next one checks it again and a wrong layout still stops the first update."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_zero.offload import grad_feeds
    from hf_zero.offload.base import OffloadError

    # every read one element behind the last: in bounds, wrong values
    monkeypatch.setattr(grad_feeds, "padded_shard_numel", lambda param, world: max(1, param.numel() - 1))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))
    cfg = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
           "fp16": {"enabled": True, "initial_scale_power": 8}, "train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine = hf_zero.initialize(model, cfg)
    try:
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        engine.backward(engine(input_ids=ids, labels=ids).loss * float("nan"))  # every gradient nan
        engine.step()
        assert engine.last_step_skipped
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        with pytest.raises(OffloadError, match="not laid out as hf_zero expects"):
            engine.step()
    finally:
        engine.close()
