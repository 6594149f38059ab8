"""Offload faults end with one clear error on every rank, without a hang, and leave the last saved
checkpoint intact (``offload_worker.py faults``, 2 gloo ranks, one launch under a timeout).

Each scenario injects its fault on one rank only where that is possible -- the interesting case,
since the other rank would otherwise walk into the next collective and wait there for the
process-group timeout (30 minutes) -- and checks that both ranks raise an error naming the path or
the config setting.
"""

from __future__ import annotations

import os

import pytest
import torch
from _launch import torchrun

pytestmark = pytest.mark.slow

WORLD = 2
SETTING = "zero_optimization.offload_optimizer"


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offload_faults")
    nvme = tmp / "nvme"
    nvme.mkdir()
    (tmp / "cases.json").write_text("[]")
    # A hang would show up as this timeout, far below the 30-minute process-group timeout.
    torchrun("tests/distributed/offload_worker.py", "faults", str(tmp / "cases.json"), str(tmp / "out.pt"), str(nvme),
             nproc=WORLD, timeout=240)
    result = torch.load(tmp / "out.pt", weights_only=False)
    result["_nvme"] = str(nvme)
    result["_leftover"] = sorted(os.listdir(nvme))
    return result


def _errors(faults, scenario):
    ranks = faults[scenario]
    assert len(ranks) == WORLD
    for rank, r in enumerate(ranks):
        assert r["error"], f"rank {rank} finished {scenario} without an error"
        assert r["type"] == "OffloadError", r
        assert r["leftover"] == [], f"swap folders left after {scenario}: {r['leftover']}"
    return [r["error"] for r in ranks]


def test_missing_nvme_path_names_the_setting_and_path(faults):
    for error in _errors(faults, "missing_path"):
        assert f"{SETTING}.nvme_path=" in error and "does-not-exist" in error and "does not exist" in error


def test_unwritable_nvme_path_fails_on_every_rank(faults):
    mine, other = _errors(faults, "unwritable_rank1")[1], _errors(faults, "unwritable_rank1")[0]
    assert "is not writable" in mine and faults["_nvme"] in mine
    assert other.startswith("setting up the offloaded optimizer failed on rank 1") and "is not writable" in other


def test_host_memory_that_cannot_be_pinned(faults):
    rank0, rank1 = _errors(faults, "pin_rank1")
    assert "could not pin" in rank1 and f"{SETTING}.pin_memory=false" in rank1
    assert "failed on rank 1" in rank0 and f"{SETTING}.pin_memory" in rank0


def test_disk_full_during_the_run(faults):
    rank0, rank1 = _errors(faults, "enospc_rank1")
    for error in (rank0, rank1):
        assert "disk is full (ENOSPC)" in error and "optimizer_chunk" in error and f"{SETTING}.nvme_path" in error
    assert "failed on rank 1" in rank0
    assert all(r["checkpoint_intact"] for r in faults["enospc_rank1"])


def test_truncated_optimizer_swap_file(faults):
    victim = faults["truncate_rank0"][0]["victim"]
    for error in _errors(faults, "truncate_rank0"):
        assert victim in error and "truncated" in error
    assert all(r["checkpoint_intact"] for r in faults["truncate_rank0"])


def test_deleted_parameter_swap_file(faults):
    victim = faults["delete_param_rank1"][1]["victim"]
    for error in _errors(faults, "delete_param_rank1"):
        assert victim in error and "deleted" in error and "zero_optimization.offload_param.nvme_path" in error
    assert all(r["checkpoint_intact"] for r in faults["delete_param_rank1"])


def test_no_swap_folder_survives_the_faults(faults):
    assert faults["_leftover"] == []
