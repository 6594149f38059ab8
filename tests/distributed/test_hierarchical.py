"""Hierarchical sharding from DeepSpeed's keys, on 4 gloo ranks started as 2 nodes x 2.

``mics_shard_size: 2`` (MiCS) is FSDP2 over a (2 replicate x 2 shard) mesh; ``zero_hpz_partition_size:
2`` (ZeRO++ hpZ) on a flat 4-rank mesh is ``reshard_after_forward=2``. Each case trains in one
launch of two ``hf-zero run --nnodes 2`` processes on localhost (ranks 0-1 are node 0, 2-3 node 1)
and is compared with the single-process reference of the same seed and global batch
(``_reference.py``), as the stage parity tests are; the bytes each collective moved, per process
group, are counted where torch.distributed is called (``hier_worker.py``), not from hf_zero's own
bookkeeping.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _cases import Case
from _launch import hf_zero_nodes, torchrun
from _reference import assert_matches_reference, reference_run

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
WORLD = 4
NODE0, NODE1 = "0,1", "2,3"
CASES = [
    Case(stage=3, dtype="fp32", gas=1, model="llama", mics=2),
    Case(stage=2, dtype="fp32", gas=2, model="qwen2_tied", mics=2),
    Case(stage=3, dtype="fp32", gas=1, model="qwen2_tied", hpz=2),
    # For the communication plan: padded shards (dims no group divides), 16-bit gathers; DDP's stage 1.
    Case(stage=3, dtype="bf16", gas=2, model="llama_odd", mics=2),
    Case(stage=1, dtype="fp32", gas=2, model="llama"),
]
SHARDED_EVENLY = CASES[:3]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hier")
    (tmp / "cases.json").write_text(json.dumps([c.to_dict() for c in CASES]))
    hf_zero_nodes("tests/distributed/hier_worker.py", str(tmp / "cases.json"), str(tmp / "out.pt"))
    return torch.load(tmp / "out.pt", weights_only=False)


def _traffic(run, rank: int) -> dict[tuple[str, str], int]:
    out = {}
    for key, nbytes in run["traffic"][rank].items():
        op, group = key.split("|")
        out[(op, group)] = nbytes
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_single_process_reference(case: Case, runs):
    got = runs[case.name]
    ref = reference_run(case, world=WORLD)
    assert_matches_reference(got, ref, case)
    moved = sum(not torch.equal(ref["final_state"][k], ref["initial_state"][k]) for k in ref["final_state"])
    assert moved == len(ref["final_state"])


@pytest.mark.parametrize("case", SHARDED_EVENLY, ids=lambda c: c.name)
def test_each_rank_holds_its_groups_share(case: Case, runs):
    ranks = runs[case.name]["ranks"]
    shard = case.mics if case.mics > 0 else WORLD
    full = ranks[0]["sharding"]["full_param_numel"]
    local = [r["sharding"]["local_param_numel"] for r in ranks]
    # Inside a shard group the shards add up to every parameter once (no padding: the tiny models'
    # first dimensions divide by 4); each rank holds 1/shard of it.
    for group in ([0, 1], [2, 3]) if shard == 2 else ([0, 1, 2, 3],):
        assert sum(local[r] for r in group) == full
    assert local == [full // shard] * WORLD


def test_mics_keeps_gathers_and_reduce_scatters_inside_the_node(runs):
    for case in CASES[:2]:
        run = runs[case.name]
        for rank in range(WORLD):
            t = _traffic(run, rank)
            node = NODE0 if rank < 2 else NODE1
            gathers = {g for (op, g) in t if op in ("all_gather", "reduce_scatter")}
            assert gathers == {node}, (case.name, rank, t)
            # The replicas complete the gradients with one all-reduce across the nodes: as many
            # bytes as the reduce-scatter's output (the shard's gradients), once per step however
            # many micro-steps it accumulates (as DeepSpeed's MiCS: the network carries 1/gas).
            across = "0,2" if rank % 2 == 0 else "1,3"
            assert t[("all_reduce", across)] * 2 * case.gas == t[("reduce_scatter", node)], (case.name, rank, t)


def test_hpz_gathers_the_backward_inside_the_node(runs):
    case = CASES[2]
    run = runs[case.name]
    for rank in range(WORLD):
        t = _traffic(run, rank)
        node = NODE0 if rank < 2 else NODE1
        world = "0,1,2,3"
        # The forward gathers over the whole shard group, the backward over the node's 2 ranks
        # (the secondary copy hpZ keeps after the forward); gradients reduce-scatter over all 4.
        assert t[("all_gather", world)] > 0 and t[("all_gather", node)] > 0, t
        assert {g for (op, g) in t if op == "reduce_scatter"} == {world}, t
        assert not any(op == "all_gather" and g not in (world, node) for (op, g) in t), t


def test_checkpoints_move_between_flat_and_hierarchical_layouts(runs):
    """A checkpoint saved on the 2 x 2 MiCS mesh resumes on a flat 4-rank mesh and the other way
    round: the loaded weights are the saved ones bit for bit (a fresh model of other weights was
    loaded into), and the next steps' losses are those of the run that went on (reduction order
    differs between the layouts: 1e-5)."""
    ck = runs["checkpoints"]
    for name in ("mics_to_flat", "flat_to_mics"):
        got = ck[name]
        assert set(got["loaded"]) == set(got["saved"])
        for key, value in got["saved"].items():
            assert torch.equal(got["loaded"][key], value), (name, key)
        torch.testing.assert_close(got["resumed"], got["continued"], rtol=1e-5, atol=0)


def test_16bit_export_and_consolidate_from_the_2d_mesh(runs):
    from safetensors.torch import load_file

    ck = runs["checkpoints"]
    saved = ck["mics_to_flat"]["saved"]
    for folder in (ck["export"], ck["consolidated"]):
        files = sorted(Path(folder).glob("*.safetensors"))
        assert files, folder
        weights = {}
        for f in files:
            weights.update(load_file(str(f)))
        for key, value in saved.items():
            if key in weights:  # a tied head is written once
                assert torch.equal(weights[key].float(), value), (folder, key)
        assert len(weights) >= len(saved) - 1


def test_a_hierarchical_checkpoint_loads_on_another_world_size(runs, tmp_path):
    """The 2 x 2 MiCS run's checkpoint, loaded by 2 ranks on a flat mesh: the same weights."""
    ck = runs["checkpoints"]["mics_to_flat"]
    torchrun("tests/distributed/hier_worker.py", "--load", ck["ckpt"], str(tmp_path / "out.pt"), nproc=2)
    got = torch.load(tmp_path / "out.pt", weights_only=False)
    assert got["world"] == 2
    assert set(got["loaded"]) == set(ck["saved"])
    for key, value in ck["saved"].items():
        assert torch.equal(got["loaded"][key], value), key


def test_gathered_parameters_reads_and_edits_on_the_2d_mesh(runs):
    for rank, got in enumerate(runs["gathered"]):
        assert got == {"read_whole": True, "edited": True}, (rank, got)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_communication_plan_is_the_measured_bytes_per_group(case: Case, runs):
    """``hf-zero estimate --plan`` counts, from the model's shapes, what every collective of a step
    moves per process group; the hook on torch.distributed measured it on every rank: equal, exactly."""
    from hf_zero.estimator.comm_plan import fsdp_units_of, group_ranks, step_collectives
    from _models import tiny_model

    shard = case.mics if case.mics > 0 else WORLD
    plan = step_collectives(fsdp_units_of(tiny_model(case.model)), stage=case.stage, world=WORLD, gas=case.gas,
                            param_bytes=2 if case.dtype in ("bf16", "fp16") else 4, shard=shard, hpz=case.hpz)
    for rank in range(WORLD):
        want: dict[str, int] = {}
        count: dict[str, int] = {}
        for c in plan:
            key = f"{c.op}|{','.join(map(str, group_ranks(c.group, rank, WORLD, shard, case.hpz)))}"
            want[key] = want.get(key, 0) + c.nbytes * case.steps
            count[key] = count.get(key, 0) + (c.calls or 0) * case.steps
        assert runs[case.name]["traffic"][rank] == want, (case.name, rank)
        if case.stage >= 2:  # one collective per unit (FSDP2's foreach), one for the norm; DDP buckets vary
            assert runs[case.name]["calls"][rank] == count, (case.name, rank)


def test_mics_all_reduces_at_the_boundary_the_engine_marks(runs):
    for rank, got in enumerate(runs["boundary"]):
        assert "were not all-reduced across the replicas" in got["module"], (rank, got)
        assert "engine(...)" in got["module"]
        assert got["engine"] == "stepped" and got["replicas_equal"], (rank, got)
