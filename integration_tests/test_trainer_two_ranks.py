"""Trainer options that only show on more than one rank, against transformers' own Trainer under the
same torchrun launch (plain DDP): ``average_tokens_across_devices=False`` at stages 0-3 and its
default at stage 0, ``--optim galore_adamw`` with ``optim_target_modules`` at stages 2/3 (GaLore's
SVD on ZeRO's sharded gradients), submodules called directly after ``train()`` at stages 0/1, and
0-dim parameters with the config's optimizer section at stages 2/3 (read after ``train()`` on both ranks).

All runs share one 2-rank launch (``scripts/two_rank_options.py``; the GaLore runs only where
galore_torch is installed) to keep CI short. Losses rtol 2e-4, gradient norms 2e-3 (both the
Trainer's logged values), saved weights (``save_model``) rtol 1e-4.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _run import REPO, logged_grad_norms, logged_losses, run
from _run import assert_same_run as _assert_same_run

pytestmark = pytest.mark.slow
SCRIPT = REPO / "integration_tests" / "scripts" / "two_rank_options.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("two_ranks")
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT), str(out)],
        timeout=400)
    return out


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def assert_same_run(got: Path, want: Path) -> None:
    """Same logged losses and gradient norms, same saved weights (3 steps)."""
    _assert_same_run(got, want, 3)


def _differ(a: Path, b: Path) -> float:
    """Largest weight difference between two saved models."""
    wa, wb = _weights(a), _weights(b)
    return max(float((wa[n] - wb[n]).abs().max()) for n in wa)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_average_tokens_across_devices_false(runs, stage):
    # The setting matters here: each rank's batch masks a different number of label tokens.
    assert logged_grad_norms(runs / "ddp_per_rank") != pytest.approx(logged_grad_norms(runs / "ddp_default"), rel=1e-3)
    assert _differ(runs / "ddp_per_rank", runs / "ddp_default") > 1e-5
    assert_same_run(runs / f"s{stage}_per_rank", runs / "ddp_per_rank")


def test_average_tokens_across_devices_default_at_stage_0(runs):
    assert_same_run(runs / "s0_default", runs / "ddp_default")


@pytest.mark.parametrize("stage", [2, 3])
def test_galore_on_sharded_parameters(runs, stage):
    """GaLore's projection runs on the whole gradient (DTensor redistributes it for the SVD), so the
    training equals DDP's; were it refused, the ShardedOptimizerError would be in ``errors``."""
    if importlib.util.find_spec("galore_torch") is None:
        pytest.skip("galore_torch is not installed (pip install galore-torch)")
    errors = json.loads((runs / "result.json").read_text())["errors"]
    assert f"s{stage}_galore" not in errors, errors
    # GaLore trained differently from plain AdamW (same other options): the projection was applied.
    assert _differ(runs / "ddp_galore", runs / "ddp_default") > 1e-4
    assert_same_run(runs / f"s{stage}_galore", runs / "ddp_galore")


@pytest.mark.parametrize("stage", [0, 1])
def test_submodule_called_after_train(runs, stage):
    """As with the plain Trainer, the trained model's parts can be called directly at stages 0/1
    (parameters are never sharded there): the same outputs as DDP's model, and the embedding rows
    are the saved weights."""
    outputs = json.loads((runs / "result.json").read_text())["submodule"]
    got, want = outputs[f"s{stage}"], outputs["ddp"]
    for part in ("embedding", "mlp"):
        torch.testing.assert_close(torch.tensor(got[part]), torch.tensor(want[part]), rtol=1e-4, atol=2e-5)
    rows = _weights(runs / f"s{stage}_per_rank")["model.embed_tokens.weight"][torch.tensor([[5, 17, 42, 99]])]
    torch.testing.assert_close(torch.tensor(got["embedding"]), rows, rtol=0, atol=0)


@pytest.mark.parametrize("run,reference", [("s2_scalar_adamw", "ddp_scalar_adamw"),
                                           ("s3_scalar_lamb_offload", "ddp_scalar_lamb")])
def test_scalar_parameters_stepped_once_and_read_on_every_rank(runs, run, reference):
    """0-dim parameters with the config's optimizer section on 2 ranks: each parameter sits once in the
    optimizer and is stepped once per update, the losses are DDP's, and ``trainer.model.a.item()``
    reads the trained value on both ranks (rank 1's shard of the 1-element storage is empty)."""
    scalar = json.loads((runs / "result.json").read_text())["scalar"]
    for rank, counts in enumerate(scalar[run]):
        assert "error" not in counts, (rank, counts["error"])
        assert counts["listed"] == [1] * len(counts["listed"]) and counts["foreign"] == 0, (rank, counts)
        assert counts["steps"] and set(counts["steps"].values()) == {4.0}, (rank, counts)  # 4 updates
    # Same data and update as DDP; only the reduction's association differs (2 ranks' gradients
    # averaged by all-reduce vs reduce-scatter): fp32 rounding through 4 steps, rtol 1e-5. A scalar
    # stepped twice moves the losses by percents from step 2.
    torch.testing.assert_close(logged_losses(runs / run), logged_losses(runs / reference), rtol=1e-5, atol=0)
    want = scalar[reference][0]["reads"]
    for rank, counts in enumerate(scalar[run]):
        assert counts["reads"] == pytest.approx(want, rel=1e-5, abs=1e-7), rank
    assert want["a"] != 0.5  # trained
