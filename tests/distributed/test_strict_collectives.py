"""Strict collectives (tests/strict_collectives.py) catch review finding F1 on CPU.

F1: with ``offload_param: cpu`` the offloaded DTensor shards (parameters and gradients) live in host
memory, and ``full_tensor()`` on them dies on an NCCL-only group at the first gradient norm and at
the first 16-bit save. hf_zero moves them with ``on_mesh_device`` first. On CPU with gloo every
collective accepts host memory, so the strict mode tracks what would be host memory on a GPU and
fails where NCCL would.

2 gloo ranks, ZeRO-3 with ``offload_param: cpu`` (with and without ``offload_optimizer: cpu``) and
the same run without offload, each: 2 training steps (gradient norm), a bf16 export
(``gather_full_state_dict``, what ``save_model`` writes) and a sharded checkpoint, all under strict
collectives. Today's code passes and gives the norms and weights of the run without offload; the
control, ``on_mesh_device`` replaced by the identity, fails with the strict error naming the
offloaded gradient (norm, without an offloaded optimizer: with one, the optimizer reduces its norm
on ``collective_device()``) and parameter (export) shards.

The strict launch also runs, each beside its own run without offload:

* ZeRO-2 with only the optimizer offloaded: its host gradient and master arenas
  (``offload/pinned.py`` ``HostArena``) are tagged as host memory (they were not: nothing of this
  case was tagged, so strict mode could not have seen them enter a collective);
* LAMB at ZeRO-3 with ``offload_param: cpu`` and no optimizer offload (review N2): its trust
  ratio's norms of host shards were reduced with ``full_tensor()`` on the host tensors, which NCCL
  refuses at the first step; now they are reduced on the mesh's device and LAMB's norms and
  weights equal the run without offload.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from _launch import torchrun
from offload_worker import OffloadCase

pytestmark = pytest.mark.slow

C = OffloadCase
PLAIN = C(stage=3, dtype="fp32", gas=1, model="llama", optimizer="none", params="none", steps=2)
OFFLOADED = [
    C(stage=3, dtype="fp32", gas=1, model="llama", optimizer="none", params="cpu", steps=2),
    C(stage=3, dtype="fp32", gas=1, model="llama", optimizer="cpu", params="cpu", steps=2),
]
# In the strict launch only (the control's expectations are about the cases above); each has its
# run without offload (same optimizer) in BASELINES.
ARENAS = C(stage=2, dtype="fp32", gas=1, model="llama", optimizer="cpu", params="none", steps=2)
LAMB = C(stage=3, dtype="fp32", gas=1, model="llama", optimizer="none", params="cpu", steps=2, optimizer_type="Lamb")
STRICT_ONLY = [ARENAS, LAMB]
BASELINES = {
    ARENAS.full_name: C(stage=2, dtype="fp32", gas=1, model="llama", optimizer="none", params="none", steps=2),
    LAMB.full_name: C(stage=3, dtype="fp32", gas=1, model="llama", optimizer="none", params="none", steps=2,
                      optimizer_type="Lamb"),
    **{c.full_name: PLAIN for c in OFFLOADED},
}


def _launch(tmp, control: bool) -> dict:
    nvme = tmp / "nvme"
    nvme.mkdir()
    cases = OFFLOADED + [PLAIN]
    if not control:
        cases += STRICT_ONLY + [BASELINES[c.full_name] for c in STRICT_ONLY]
    (tmp / "cases.json").write_text(json.dumps([c.to_dict() for c in cases]))
    env = {"HF_ZERO_STRICT_COLLECTIVES": "1", "HF_ZERO_STRICT_CONTROL": "bypass" if control else ""}
    torchrun("tests/distributed/offload_worker.py", "strict", str(tmp / "cases.json"), str(tmp / "out.pt"),
             str(nvme), timeout=300, env=env)
    return torch.load(tmp / "out.pt", weights_only=False)


@pytest.fixture(scope="module")
def strict(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("strict"), control=False)


@pytest.fixture(scope="module")
def bypassed(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("strict_control"), control=True)


@pytest.mark.parametrize("case", OFFLOADED + STRICT_ONLY, ids=lambda c: c.full_name)
def test_offloaded_run_passes_strict_collectives(case, strict):
    got = strict[case.full_name]
    assert got["errors"] == {}
    # Not vacuous: this case's host buffers or shards were tagged, and, where the parameters are
    # offloaded, on_mesh_device / FSDP2 moved tagged tensors (the stats count this case alone).
    assert got["stats"]["tagged"] > 0
    if case.params != "none":
        assert got["stats"]["moved"] > 0


# (ARENAS' numbers are test_offload_parity's business, to its tolerance: an offloaded optimizer
# steps host copies, not the DTensors.)
@pytest.mark.parametrize("case", OFFLOADED + [LAMB], ids=lambda c: c.full_name)
def test_strict_offloaded_run_equals_the_run_without_offload(case, strict):
    got, want = strict[case.full_name], strict[BASELINES[case.full_name].full_name]
    assert want["errors"] == {}
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(want["norms"]), rtol=1e-5, atol=1e-7)
    assert got["exported"].keys() == want["exported"].keys()
    for key, value in want["exported"].items():
        torch.testing.assert_close(got["exported"][key], value, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("case", OFFLOADED, ids=lambda c: c.full_name)
def test_bypassing_on_mesh_device_fails_strict_collectives(case, bypassed):
    errors = bypassed[case.full_name]["errors"]
    # The norm does not go through on_mesh_device: the engine's (distributed.collectives.dtensor_total_norm)
    # and the offloaded optimizer's both use offload/grad_norm.sharded_total_norm, which gathers the
    # per-tensor norms into a host vector and moves its powers to collective_device() for the one
    # all-reduce (the path the offloaded optimizer's H100 runs took). Only the export is left unguarded.
    assert set(errors) == {"export16"}, errors
    assert "offloaded parameter shard" in errors["export16"]
    assert "enters a collective" in errors["export16"]
    # The run without offload has no host tensors: nothing to catch.
    assert bypassed[PLAIN.full_name]["errors"] == {}
