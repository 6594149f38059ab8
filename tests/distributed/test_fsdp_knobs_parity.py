"""DeepSpeed's tuning knobs on 2 gloo ranks: they change the schedule, never the numbers.

One torchrun launch trains a tiny Llama (hidden 64, 2 layers) a few steps per case: stage 3 and
stage 2 with FSDP2's defaults, and the same stages with non-default knobs (deep prefetch, every
block persistent, a live-parameter cap, ``gradient_predivide_factor``, ``prescale_gradients``,
optimizer offload with a predivide factor). Compared: each case's losses with its stage's default
run, and the first step's gradients with the mean of the ranks' gradients computed by plain
autograd on an unsharded copy (all-reduced by hand): the reference is torch, not hf_zero.

    torchrun --standalone --nproc_per_node 2 tests/distributed/test_fsdp_knobs_parity.py OUT.pt   (the worker)
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

STEPS = 3
BASE = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    # SGD: the update is proportional to the gradient, so a wrong reduction scale shows in the
    # losses (Adam would normalise it away).
    "optimizer": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.0}},
}
KNOBS = {"stage3_prefetch_bucket_size": 1e9, "stage3_param_persistence_threshold": 1e9,
         "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 0}
CASES = {
    "s3_default": ({"stage": 3}, {}),
    "s3_knobs": ({"stage": 3, **KNOBS}, {"gradient_predivide_factor": 4.0}),
    "s3_live_cap": ({"stage": 3, "stage3_prefetch_bucket_size": 1e9, "stage3_max_live_parameters": 1}, {}),
    "s3_offload_predivide": ({"stage": 3, "offload_optimizer": {"device": "cpu"}}, {"gradient_predivide_factor": 4.0}),
    "s2_default": ({"stage": 2}, {}),
    "s2_prescale": ({"stage": 2}, {"prescale_gradients": True}),
}


# ---------------------------------------------------------------------------------------- worker
def _run_case(zero: dict, top: dict) -> dict:
    import torch.distributed as dist

    import hf_zero
    from _models import make_data, tiny_model

    model = tiny_model("llama")
    reference = tiny_model("llama")  # same seed: the same weights as rank 0's, unsharded
    engine = hf_zero.initialize(model, {**BASE, **top, "zero_optimization": zero})
    rank, world = engine.env.rank, engine.env.world_size
    data = make_data(STEPS, 1, world, 2, 16)
    losses, grads = [], None
    for step in range(STEPS):
        ids = data[step, 0, rank]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        if step == 0 and "offload_optimizer" not in zero:
            grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.grad is not None}
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    # The mean gradient of step 0 by hand: each rank's plain autograd, summed, divided by the world.
    ids = data[0, 0, rank]
    reference(input_ids=ids, labels=ids).loss.backward()
    mean = {}
    for name, p in reference.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        mean[name] = g / world
    return {"losses": losses, "grads": grads, "mean_grads": mean}


def _worker(out: str) -> None:
    from _worker_io import save_results_and_exit

    results = {name: _run_case(zero, top) for name, (zero, top) in CASES.items()}
    save_results_and_exit(results, out)


# ---------------------------------------------------------------------------------------- tests
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from _launch import torchrun

    out = tmp_path_factory.mktemp("fsdp_knobs") / "out.pt"
    torchrun(__file__, str(out))
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("name, default", [
    ("s3_knobs", "s3_default"), ("s3_live_cap", "s3_default"), ("s3_offload_predivide", "s3_default"),
    ("s2_prescale", "s2_default"),
])
def test_knobs_keep_the_default_losses(results, name, default):
    torch.testing.assert_close(results[name]["losses"], results[default]["losses"], rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", ["s3_default", "s3_knobs", "s3_live_cap", "s2_default", "s2_prescale"])
def test_gradients_are_the_mean_of_the_ranks(results, name):
    got, mean = results[name]["grads"], results[name]["mean_grads"]
    assert got.keys() == mean.keys()
    for key in mean:
        torch.testing.assert_close(got[key], mean[key], rtol=1e-5, atol=1e-7, msg=key)


if __name__ == "__main__":
    from tests.strict_collectives import install_from_env

    install_from_env()  # HF_ZERO_STRICT_COLLECTIVES=1 (tests/distributed/_launch.py sets it by default)
    _worker(sys.argv[1])
