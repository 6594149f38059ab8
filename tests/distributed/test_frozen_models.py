"""Frozen second models (TRL's reference models, teachers, reward models) beside a trained one.

One 2-rank launch (``frozen_worker.py``) prepares a reference model with
``hf_zero.prepare_frozen_model`` at stages 0-3 next to a policy engine. Checked against a plain
single-process model built with rank 0's seed: its logits on each rank's batch (so rank 1, which
built the model on the meta device at stage 3 or with other weights below it, computes with rank
0's weights), the bytes each rank holds (half at stages 2/3), and a TR-DPO sync written as TRL
writes it (``ref.data.mul_(1 - a).add_(policy.data, alpha=a)``), which mixes the two models'
parameters shard by shard at stages 2/3.
"""

from __future__ import annotations

import pytest
import torch
from _launch import torchrun
from _models import tiny_model
from frozen_worker import ALPHA

pytestmark = pytest.mark.slow

WORKER = "tests/distributed/frozen_worker.py"
CASES = ["s0-fp32", "s1-bf16", "s2-fp32", "s3-fp32", "s3-bf16"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("frozen") / "out.pt"
    torchrun(WORKER, str(out), nproc=2, timeout=300)
    return torch.load(out, weights_only=False)


def _reference():
    return tiny_model("llama", seed=2).eval()


@pytest.mark.parametrize("case", CASES)
def test_every_rank_computes_with_rank0s_weights(runs, case):
    ref = _reference()
    bf16 = case.endswith("bf16") and case.startswith("s3")  # stages 2/3 compute in the compute dtype
    if bf16:
        ref = ref.to(torch.bfloat16)
    for r, got in enumerate(runs[case]):
        with torch.no_grad():
            want = ref(input_ids=got["ids"]).logits.float()
        tol = dict(rtol=2e-2, atol=2e-2) if bf16 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["logits"], want, **tol, msg=f"rank {r}")
        assert not got["requires_grad"] and not got["training"]


@pytest.mark.parametrize("case", CASES)
def test_bytes_per_rank(runs, case):
    stage = int(case[1])
    full_fp32 = sum(p.numel() for p in _reference().parameters()) * 4
    elem = 2 if case.endswith("bf16") and stage >= 2 else 4  # stages 2/3 store frozen weights in the compute dtype
    want = full_fp32 // 4 * elem // (2 if stage >= 2 else 1)
    assert [got["bytes"] for got in runs[case]] == [want, want]


@pytest.mark.parametrize("case", CASES)
def test_sync_ref_model_mixes_the_two_models(runs, case):
    """TRL's SyncRefModelCallback update on the prepared models (it failed with "aten.add_.Tensor
    got mixed torch.Tensor and DTensor" when only the policy was sharded)."""
    for got in runs[case]:
        assert len(got["after"]) == len(got["before"]["ref"]) == len(got["before"]["policy"])
        for after, ref, policy in zip(got["after"], got["before"]["ref"], got["before"]["policy"]):
            want = (1 - ALPHA) * ref + ALPHA * policy
            tol = dict(rtol=1e-2, atol=1e-3) if after.dtype != want.dtype or "bf16" in case else dict(rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(after, want, **tol)
        assert not torch.allclose(got["logits"], got["synced_logits"])  # the sync reached the forward
    for a, b in zip(runs[case][0]["after"], runs[case][1]["after"]):
        assert torch.equal(a, b)  # both ranks hold the same synced model


def test_a_rank_that_cannot_place_its_copy_stops_every_rank(runs):
    """Rank 1 holds a meta model at stage 1: it raises with the remedy, and rank 0 raises naming
    rank 1 instead of waiting in a broadcast (the launch would time out)."""
    rank0, rank1 = runs["meta-s1"]
    assert rank1 is not None and "meta device" in rank1 and "HF_ZERO_LOW_MEMORY_LOADING=0" in rank1
    assert rank0 is not None and "failed on rank 1" in rank0
