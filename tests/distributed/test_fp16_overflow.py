"""An fp16 overflow on one rank skips the update on every rank, leaves the weights and the
scheduler alone, and backs the loss scale off (DeepSpeed's semantics)."""

from __future__ import annotations

import json
import math

import pytest

from _launch import torchrun

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("stage", [1, 3])
def test_overflow_on_one_rank_skips_everywhere(stage, tmp_path):
    out = tmp_path / "overflow.json"
    torchrun("tests/distributed/overflow_worker.py", str(stage), str(out))
    ranks = json.loads(out.read_text())
    assert ranks[0] == [{**r, "grad_norm": ranks[0][i]["grad_norm"]} for i, r in enumerate(ranks[1])]  # same decisions
    step0, step1, step2 = ranks[0]
    # WarmupLR (linear, 1e-4 -> 1e-3 over 10 steps). DeepSpeed's step() sets the lr of iteration
    # last_batch_iteration, which starts at -1, so after n steps the lr is that of iteration n - 1.
    def lr_after(n):
        return 1e-4 + (1e-3 - 1e-4) * (n - 1) / 10

    # step 0: normal update, the scheduler advances once.
    assert step0["weights_changed"] and step0["skipped"] == 0 and step0["scale"] == 2.0**10
    assert step0["lr"] == pytest.approx(lr_after(1))
    # step 1: rank 1 overflowed -> skipped everywhere: weights and lr unchanged, scale halved (hysteresis 1).
    assert not step1["weights_changed"] and step1["skipped"] == 1 and step1["global_steps"] == 2
    assert step1["lr"] == pytest.approx(lr_after(1)) and step1["scale"] == 2.0**9
    assert math.isinf(step1["grad_norm"])
    # step 2: training goes on at the lower scale; the scheduler resumes where it stopped.
    assert step2["weights_changed"] and step2["lr"] == pytest.approx(lr_after(2)) and step2["scale"] == 2.0**9
