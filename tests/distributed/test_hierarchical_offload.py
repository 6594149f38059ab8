"""Offload on the hierarchical layouts, on 4 gloo ranks started as 2 nodes x 2.

``mics_shard_size: 2`` (MiCS: FSDP2 over a 2 replicate x 2 shard mesh) and ``zero_hpz_partition_size:
2`` (hpZ: ``reshard_after_forward=2`` on the flat mesh of 4) with ``offload_optimizer`` and
``offload_param`` on cpu and nvme. One launch of two ``hf-zero run --nnodes 2`` processes trains
every case (``hier_offload_worker.py``); each is compared with the single-process reference of the
same seed and global batch (``_reference.py``): losses, gradient norms (a norm reduced over all 4
ranks instead of the shard group counts every gradient twice: sqrt(2) too large), and final weights
within the drift bound. The frozen cases prepare a reference model (TRL's DPO) beside an offloaded
policy on the same layouts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from _drift_bound import assert_within
from _launch import hf_zero_nodes
from _models import tiny_model
from _reference import reference_run
from hier_offload_worker import ALPHA, HierOffloadCase as C

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
WORLD = 4
CASES = [
    C(stage=3, dtype="fp32", gas=1, model="llama", optimizer="cpu", mics=2),
    C(stage=2, dtype="fp32", gas=2, model="qwen2_tied", optimizer="cpu", mics=2),
    C(stage=3, dtype="fp32", gas=1, model="qwen2_tied", optimizer="cpu", params="cpu", mics=2),
    # max_in_cpu: about one block's shard on 4 ranks, so units leave host memory during the step
    C(stage=3, dtype="fp32", gas=1, model="llama", optimizer="nvme", params="nvme", mics=2, max_in_cpu=10_000),
    C(stage=3, dtype="fp32", gas=1, model="llama", optimizer="nvme", params="nvme", hpz=2, max_in_cpu=10_000),
    C(stage=3, dtype="fp32", gas=2, model="qwen2_tied", optimizer="cpu", params="cpu", hpz=2),
]
# bf16 on MiCS with a vocabulary FSDP2 pads by the shard group (130 rows: 65 per rank of 2, where
# a world of 4 would pad to 33): the offloaded feed reads bf16 runs' fp32 gradients at offsets in
# the reduce-scatter output. Compared with the same config without offload (exact, as
# test_offload_parity.py compares), there being no 1-process reference for this model.
PADDED = C(stage=3, dtype="bf16", gas=1, model="llama", optimizer="cpu", mics=2, vocab=130, steps=3, baseline=True)
FROZEN = [
    C(stage=3, dtype="fp32", gas=1, model="llama", optimizer="cpu", params="cpu", mics=2, steps=1),
    C(stage=3, dtype="fp32", gas=1, model="llama", optimizer="cpu", hpz=2, steps=1),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hier_offload")
    nvme = tmp / "nvme"
    nvme.mkdir()
    spec = {"cases": [c.to_dict() for c in [*CASES, PADDED]], "frozen": [c.to_dict() for c in FROZEN]}
    (tmp / "cases.json").write_text(json.dumps(spec))
    hf_zero_nodes("tests/distributed/hier_offload_worker.py", str(tmp / "cases.json"), str(tmp / "out.pt"), str(nvme))
    result = torch.load(tmp / "out.pt", weights_only=False)
    result["_leftover"] = sorted(os.listdir(nvme))
    return result


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_single_process_reference(case: C, runs):
    got = runs[case.name]
    ref = reference_run(case.base, world=WORLD)
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=0)
    torch.testing.assert_close(got["grad_norms"], ref["grad_norms"], rtol=1e-4, atol=0)
    assert set(got["final_state"]) == set(ref["final_state"])
    for name, tensor in ref["final_state"].items():  # within what reduction order explains (_drift_bound.py)
        assert_within(got["final_state"][name], tensor, ref["drift"].get(name, 0.0), name, case.steps)
    moved = sum(not torch.equal(ref["final_state"][k], ref["initial_state"][k]) for k in ref["final_state"])
    assert moved == len(ref["final_state"])
    assert all(r["global_steps"] == case.steps for r in got["ranks"])


@pytest.mark.parametrize("case", [*CASES, PADDED], ids=lambda c: c.name)
def test_each_rank_holds_and_steps_its_groups_share(case: C, runs):
    ranks = runs[case.name]["ranks"]
    shard = case.mics if case.mics > 0 else WORLD
    full = ranks[0]["full_param_numel"]
    local = [r["local_param_numel"] for r in ranks]
    masters = [r["master_numel"] for r in ranks]
    # Inside a shard group the shards add up to every parameter once; the offloaded optimizer holds
    # fp32 masters of exactly the rank's shards (all parameters train).
    for group in ([0, 1], [2, 3]) if shard == 2 else ([0, 1, 2, 3],):
        assert sum(local[r] for r in group) == full
    assert masters == local
    if case.vocab == 128:  # the tiny models' dimensions divide by 4: 1/shard on every rank
        assert local == [full // shard] * WORLD
    for r in ranks:
        mem = r["memory"]
        assert mem["optimizer_state"]["accelerator"] == 0 and mem["grads"]["accelerator"] == 0
        tier = "nvme" if case.optimizer == "nvme" else "host"
        assert mem["optimizer_state"][tier] >= 3 * 4 * r["master_numel"]  # master + 2 moments
        if case.params != "none":
            assert mem["params"]["accelerator"] == 0 and mem["params"][case.params if case.params == "nvme" else "host"] > 0


def test_hpz_backward_reads_no_swapped_parameters(runs):
    """offload_param nvme with hpZ: units leave host memory (max_in_cpu holds about one), yet the
    backward reads none back: it gathers from the 1/hpZ copies the forward left on the device."""
    for case in [c for c in CASES if c.params == "nvme" and c.hpz > 1]:
        for r in runs[case.name]["ranks"]:
            assert r["units"] == 3 and r["memory"]["params"]["host"] <= case.max_in_cpu * 4, r
            assert r["backward_reads"] == 0, r


def test_shards_padded_by_the_shard_group_train_as_without_offload(runs):
    got, base = runs[PADDED.name], runs[PADDED.name]["baseline"]
    close = dict(rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(got["losses"], base["losses"], **close)
    torch.testing.assert_close(got["grad_norms"], base["grad_norms"], **close)
    assert set(got["final_state"]) == set(base["final_state"])
    for name, tensor in base["final_state"].items():
        torch.testing.assert_close(got["final_state"][name], tensor, **close, msg=name)
    assert got["losses"][0] != got["losses"][-1]
    assert got["final_state"]["lm_head.weight"].shape[0] == 130
    assert [r["local_param_numel"] for r in got["ranks"]] == [r["local_param_numel"] for r in base["ranks"]]


def test_swap_files_are_per_rank_and_gone_after_close(runs):
    for case in [c for c in CASES if "nvme" in (c.optimizer, c.params)]:
        ranks = runs[case.name]["ranks"]
        folders = set()
        for rank, r in enumerate(ranks):
            assert r["files"] and r["files_exist"], r
            assert all(f"rank{rank}" in f for f in r["files"])  # global ranks: replicas never share files
            folders |= {os.path.dirname(f) for f in r["files"]}
            assert r["dirs_after_close"] == [] and r["run_dirs_after_close"] == []
        assert len(folders) == WORLD
    assert runs["_leftover"] == []


@pytest.mark.parametrize("case", FROZEN, ids=lambda c: c.name)
def test_frozen_reference_model_on_the_layout(case: C, runs):
    got_ranks = runs[f"frozen-{case.name}"]
    plain = tiny_model(case.model, seed=2).eval()
    full_fp32 = sum(p.numel() for p in plain.parameters()) * 4
    shard = case.mics if case.mics > 0 else WORLD
    for r, got in enumerate(got_ranks):
        with torch.no_grad():
            want = plain(input_ids=got["ids"]).logits
        # Every rank (the meta-built ones and the one with other weights) computes with rank 0's.
        torch.testing.assert_close(got["logits"], want, rtol=1e-5, atol=1e-5, msg=f"rank {r}")
        assert not got["requires_grad"] and not got["training"]
        assert got["bytes"] == full_fp32 // shard, r
        if case.params == "cpu":
            assert got["devices"] == ["cpu"]
        # After its forwards the frozen model's parameters are the shards on the trained model's
        # mesh (hpZ's post-forward copies would sit on a 2-rank mesh): TRL's sync mixes shard with shard.
        mesh = "[[0, 1], [2, 3]]" if case.mics > 0 else "[0, 1, 2, 3]"
        assert [m for m, _ in got["placements"]] == [mesh], got["placements"]
        for after, ref, policy in zip(got["after"], got["before"]["ref"], got["before"]["policy"], strict=True):
            torch.testing.assert_close(after, (1 - ALPHA) * ref + ALPHA * policy, rtol=1e-6, atol=1e-7)
        assert not torch.allclose(got["logits"], got["synced_logits"])
    for other in got_ranks[1:]:
        for a, b in zip(got_ranks[0]["after"], other["after"]):
            assert torch.equal(a, b)
