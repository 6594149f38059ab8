"""ZeroTrainer beyond plain training: LoRA with gradient checkpointing under stage 3 (adapter round
trip through PeftModel.from_pretrained), evaluate/predict/generate on sharded weights, MoE blocks
(the ChatGLM-style LoRA example through hf-zero run is in test_example_flows.py)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from _run import REPO, run

pytestmark = pytest.mark.slow
WORKER = "integration_tests/scripts/zero_trainer_worker.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Every scenario in one 2-rank launch (it used to be one launch each: 6 interpreter starts and
    imports for 6 tiny runs); each writes ``<scenario>-s<stage>/``. ``save_fails`` goes last: it
    breaks rank 0's model writer for the rest of the process."""
    root = tmp_path_factory.mktemp("zero_trainer")
    scenarios = ["lora:0", "lora:1", "lora:2", "lora:3", "moe:3", "save_fails:3"]
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER, str(root),
         *scenarios])
    return root


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_lora_gradient_checkpointing_eval_predict_generate(stage, runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tmp_path = runs / f"lora-s{stage}"
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["world_size"] == 2
    assert len(result["losses"]) == 3 and all(math.isfinite(x) for x in result["losses"])
    assert math.isfinite(result["eval"]["eval_loss"])
    assert result["predict_shape"][0] == 4
    assert result["generated_len"] == 5
    if stage == 3:
        assert result["frozen_sharded"], "frozen base weights must be sharded at stage 3"

    # Adapter only, and it loads into the base model with the engine's values.
    assert (tmp_path / "adapter_model.safetensors").exists()
    assert not (tmp_path / "model.safetensors").exists()
    engine_adapter = torch.load(tmp_path / "engine_adapter.pt")
    base = AutoModelForCausalLM.from_pretrained(REPO / "assets" / "tiny-qwen2")
    loaded = PeftModel.from_pretrained(base, tmp_path)
    loaded_sd = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert set(loaded_sd) == set(engine_adapter) and loaded_sd
    for key, value in engine_adapter.items():
        # saved in the compute dtype (fp32 here)
        torch.testing.assert_close(loaded_sd[key], value, rtol=0, atol=0, msg=key)
    assert any(float(v.abs().sum()) > 0 for k, v in loaded_sd.items() if "lora_B" in k)  # it trained


def test_moe_blocks_train_under_stage_3(runs):
    result = json.loads((runs / "moe-s3" / "result.json").read_text())
    assert len(result["losses"]) == 3 and all(math.isfinite(x) for x in result["losses"])
    assert all(math.isfinite(g) and g > 0 for g in result["grad_norms"])


def test_model_write_failing_on_rank_0_raises_on_every_rank(runs):
    tmp_path = runs / "save_fails-s3"
    errors = json.loads((tmp_path / "result.json").read_text())["save_errors"]
    assert "No space left on device" in errors[0]
    assert errors[1] is not None and "rank 0" in errors[1] and "No space left" in errors[1]
    assert not (tmp_path / "model.safetensors").exists()
