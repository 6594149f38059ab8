"""Hierarchical sharding through the Hugging Face Trainer: ``mics_shard_size`` and
``zero_hpz_partition_size`` on 4 gloo ranks started as 2 nodes x 2, training the real example
script (examples/finetune_qwen/finetune.py), as tests/distributed/test_hierarchical.py does with
hf_zero's engine API.

One launch of two ``hf-zero run --nnodes 2`` processes on localhost (ranks 0-1 are node 0, 2-3
node 1) runs, one after the other in each rank's process (scripts/run_several.py), flat ZeRO-3
(the reference), ZeRO-3 with ``zero_hpz_partition_size: 2`` and ZeRO-2 with ``mics_shard_size: 2``,
and Alpaca's train.py (a script's own ``trainer.model.state_dict()`` save) flat and with
``mics_shard_size: 2`` at stage 3: 4 optimizer steps of gradient_accumulation_steps 2, the same
seed and global batch (split over the 4 ranks, so the MiCS replicas train on different samples
and their gradients must be all-reduced across the nodes). MiCS's all-reduce across the replicas
runs at the accumulation boundary only, which the engine learns from the Trainer's training_step
(``set_gradient_accumulation_boundary(accelerator.sync_gradients)`` then ``forward_context()``).
Logged losses rtol 2e-4, gradient norms 2e-3, saved weights (``save_model``) rtol 1e-4 / atol 2e-5
against the flat run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _run import FINETUNE, REPO, assert_same_run, logged_grad_norms, write_config, zero_config

if str(REPO / "tests" / "distributed") not in sys.path:  # hf_zero_nodes: the two-node launch
    sys.path.append(str(REPO / "tests" / "distributed"))
from _launch import hf_zero_nodes  # noqa: E402

pytestmark = pytest.mark.slow

WORLD, NODES = 4, 2
GLOBAL_BATCH = 4  # per micro-step, over the 4 ranks: 1 sample each
GAS = 2
STEPS = 4
COMMON = ["--max_steps", str(STEPS), "--gradient_accumulation_steps", str(GAS), "--logging_steps", "1",
          "--report_to", "none", "--learning_rate", "2e-3", "--seed", "7", "--save_strategy", "no",
          "--max_grad_norm", "1.0", "--per_device_train_batch_size", str(GLOBAL_BATCH // WORLD)]
RUN_SEVERAL = "integration_tests/scripts/run_several.py"
INITIAL = REPO / "assets" / "tiny-qwen2" / "model.safetensors"  # finetune.py's default model

# name: (stage, zero_optimization keys), the flat run first (the reference)
RUNS = {
    "flat3": (3, {}),
    "hpz3": (3, {"zero_hpz_partition_size": 2}),
    "mics2": (2, {"mics_shard_size": 2}),
}
# MiCS at stage 3 runs Alpaca's train.py (scripts/alpaca_style_full.py), whose save is
# ``trainer.model.state_dict()`` on every rank and ``trainer._save`` on rank 0, against the same script
# flat: the training and a script's state_dict() on the 2-D mesh in one pair of runs.
ALPACA = "integration_tests/scripts/alpaca_style_full.py"
ALPACA_RUNS = {"alpaca_flat3": (3, {}), "alpaca_mics3": (3, {"mics_shard_size": 2})}
# What rank 0's start-up log says each key became (hf_zero/distributed/mesh.py MeshPlan.describe).
_MICS = ("zero_optimization.mics_shard_size=2: parameters, gradients and optimizer state sharded inside "
         "2 groups of 2 ranks, replicated across them (FSDP2 over a 2 x 2 replicate x shard mesh)")
DESCRIBED = {
    "alpaca_mics3": _MICS,
    "hpz3": ("zero_optimization.zero_hpz_partition_size=2: after the forward, parameters stay sharded over "
             "groups of 2 ranks"),
    "mics2": _MICS,
}


def _config(root: Path, name: str, stage: int, keys: dict) -> Path:
    cfg = zero_config(stage)
    cfg["zero_optimization"] = {**cfg["zero_optimization"], **keys}
    return write_config(root / f"{name}.json", cfg)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hierarchical")
    several = []
    for name, (stage, keys) in RUNS.items():
        several += ["+++", name, FINETUNE, "--zero_config", str(_config(root, name, stage, keys)),
                    "--output_dir", str(root / name), *COMMON]
    for name, (stage, keys) in ALPACA_RUNS.items():
        several += ["+++", name, ALPACA, "--deepspeed", str(_config(root, name, stage, keys)),  # the script's own flag
                    "--output_dir", str(root / name), *COMMON]
    hf_zero_nodes(RUN_SEVERAL, str(root / "logs"), *several, nodes=NODES, nproc_per_node=WORLD // NODES, strict=False,
                  timeout=400)
    return root


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


@pytest.mark.parametrize("name", ["hpz3", "mics2", "alpaca_mics3"])
def test_same_training_as_flat_zero3(runs, name):
    """Same logged losses and gradient norms at every step, same saved weights as flat ZeRO-3 (of
    the same script): the shards inside each node and the all-reduce across the nodes make up the
    whole global batch's gradient, at the boundary of every accumulation window."""
    reference = "alpaca_flat3" if name.startswith("alpaca") else "flat3"
    assert len(logged_grad_norms(runs / reference)) == STEPS
    assert_same_run(runs / name, runs / reference, STEPS)

def test_weights_moved(runs):
    """The runs trained: every saved tensor of the reference differs from the loaded model's (equal
    final weights would prove nothing if nothing had been updated)."""
    initial, final = load_file(INITIAL), _weights(runs / "flat3")
    assert final.keys() <= initial.keys()
    for key, value in final.items():
        assert (value.float() - initial[key].float()).abs().max() > 1e-4, key


def test_global_batch_split_over_the_four_ranks(runs):
    """Every run trained on 4 ranks with 1 sample each per micro-step (the MiCS replicas see
    different samples, so equal results need the all-reduce across them), GAS micro-steps a step."""
    for name, (stage, _) in {**RUNS, **ALPACA_RUNS}.items():
        state = json.loads((runs / name / "trainer_state.json").read_text())
        assert state["train_batch_size"] == GLOBAL_BATCH // WORLD == 1, name
        assert state["global_step"] == STEPS, name
        log = (runs / "logs" / f"{name}.rank0.log").read_text()
        assert f"ZeRO stage {stage}, fp32, world size {WORLD} " in log, (name, log)


def test_startup_log_says_what_each_key_became(runs):
    for name, words in DESCRIBED.items():
        log = (runs / "logs" / f"{name}.rank0.log").read_text()
        assert words in log, (name, log)
    assert "mics_shard_size" not in (runs / "logs" / "hpz3.rank0.log").read_text()
    flat = (runs / "logs" / "flat3.rank0.log").read_text()
    assert "mics_shard_size" not in flat and "zero_hpz_partition_size" not in flat


def test_a_scripts_state_dict_is_whole_on_the_2d_mesh(runs):
    """``trainer.model.state_dict()`` from a script (Alpaca's save) under MiCS: rank 0 wrote whole
    tensors (the hook gathers each (Replicate, Shard) entry), not one shard group's slices; their
    values are test_same_training_as_flat_zero3's."""
    from transformers import AutoModelForCausalLM

    want = {k: v.shape for k, v in AutoModelForCausalLM.from_pretrained(INITIAL.parent).state_dict().items()}
    got = _weights(runs / "alpaca_mics3")
    assert got.keys() <= want.keys() and len(got) >= len(want) - 1  # a tied head may be written once
    for key, value in got.items():
        assert value.shape == want[key], key
