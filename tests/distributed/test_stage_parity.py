"""Stages 0-3 on 2 gloo ranks give the losses, gradient norms and weights of a 1-process run.

All cases train in one torchrun launch (a module fixture); each test then compares one case with
a plain-PyTorch reference of the same seed and global batch (``_reference.py``). The gradient norm
is compared too because Adam is almost invariant to a wrong gradient scale (e.g. summing instead of
averaging over ranks), which the loss alone would not show.
"""

from __future__ import annotations

import json

import pytest
import torch

from _cases import Case, parity_cases
from _launch import torchrun
from _reference import assert_matches_reference, reference_run

pytestmark = pytest.mark.slow

CASES = parity_cases()
WORLD = 2


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity")
    (tmp / "cases.json").write_text(json.dumps([c.to_dict() for c in CASES]))
    torchrun("tests/distributed/parity_worker.py", str(tmp / "cases.json"), str(tmp / "out.pt"), nproc=WORLD)
    return torch.load(tmp / "out.pt", weights_only=False)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_single_process_reference(case: Case, engine_runs):
    got = engine_runs[case.name]
    ref = reference_run(case, world=WORLD)
    assert_matches_reference(got, ref, case)
    torch.testing.assert_close(got["lrs"], ref["lrs"], rtol=1e-12, atol=0)
    assert all(r["sharding"]["skipped_steps"] == 0 for r in got["ranks"])
    if case.dtype == "fp16":
        assert got["loss_scales"] == [2.0**8] * case.steps


@pytest.mark.parametrize("case", [c for c in CASES if c.dtype == "fp32" and c.gas == 1], ids=lambda c: c.name)
def test_state_is_sharded_as_the_stage_says(case: Case, engine_runs):
    ranks = engine_runs[case.name]["ranks"]
    ref = reference_run(case, world=WORLD)
    total_opt = ref["optimizer_state_bytes"]
    opt_bytes = [r["memory"]["optimizer_state"]["accelerator"] for r in ranks]
    param_numel = [r["sharding"]["local_param_numel"] for r in ranks]
    full_numel = ranks[0]["sharding"]["full_param_numel"]
    names = [set(r["sharding"]["optimizer_param_names"]) for r in ranks]

    if case.stage == 0:
        assert opt_bytes == [total_opt] * WORLD  # replicated: the control for the measure itself
        assert names[0] == names[1]
    else:
        assert sum(opt_bytes) == total_opt
        for b in opt_bytes:
            assert abs(b / total_opt - 1 / WORLD) < 0.1, opt_bytes
    if case.stage == 1:
        assert names[0].isdisjoint(names[1]) and names[0] and names[1]  # each param stepped by one rank
    if case.stage in (0, 1):
        assert param_numel == [full_numel] * WORLD
        assert all(r["sharding"]["dtensor_params"] == 0 for r in ranks)
    else:
        assert sum(param_numel) == full_numel
        assert all(abs(n / full_numel - 1 / WORLD) < 0.05 for n in param_numel), param_numel
        param_bytes = [r["memory"]["params"]["accelerator"] for r in ranks]
        assert sum(param_bytes) == full_numel * 4  # fp32 master shards
        grad_bytes = [r["memory"]["grads"]["accelerator"] for r in ranks]
        assert sum(grad_bytes) == full_numel * 4 and grad_bytes[0] < full_numel * 4
