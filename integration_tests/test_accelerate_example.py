"""examples/peft_accelerate run as its README says, against the same script under accelerate's DDP.

``hf-zero run --config_file fsdp_config.yaml peft_lora_seq2seq_accelerate_fsdp.py`` (2 CPU ranks:
ZeRO-3 with parameter offload, T5Block units, LoRA) and ``torchrun`` of the unchanged script
(accelerate's plain DDP) log the same losses and the same generated predictions; the adapter the
hf_zero run saved loads with ``PeftModel.from_pretrained`` on one process and generates those
predictions again, and its weights are the DDP run's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "peft_accelerate"
SCRIPT = "peft_lora_seq2seq_accelerate_fsdp.py"


def _run(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=EXAMPLE, env=full, timeout=900)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peft_accelerate")
    zero = _run([sys.executable, "-m", "hf_zero.cli.main", "run", "--config_file", "fsdp_config.yaml", SCRIPT,
                 "--output_dir", str(tmp / "zero")])
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT,
          "--output_dir", str(tmp / "plain")], env={"ACCELERATE_USE_CPU": "true"})
    return tmp, zero


def test_same_losses_and_predictions_as_accelerate_ddp(runs):
    tmp, proc = runs
    zero = json.loads((tmp / "zero" / "metrics.json").read_text())
    plain = json.loads((tmp / "plain" / "metrics.json").read_text())
    torch.testing.assert_close(zero["losses"], plain["losses"], rtol=2e-3, atol=0)
    assert zero["losses"][-1] < zero["losses"][0] * 0.6  # it learns
    assert zero["eval_preds"] == plain["eval_preds"] and zero["accuracy"] == plain["accuracy"]
    assert "ZeRO stage 3" in proc.stdout + proc.stderr  # hf_zero trained it, not accelerate's DDP


def test_saved_adapter_loads_and_predicts_the_same(runs):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tmp, _ = runs
    out = tmp / "zero"
    model = PeftModel.from_pretrained(AutoModelForSeq2SeqLM.from_pretrained(out / "base_model"), out / "adapter")
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "adapter")
    sys.path.insert(0, str(EXAMPLE))
    from peft_lora_seq2seq_accelerate_fsdp import make_examples

    rows = make_examples(16, seed=2)
    batch = tokenizer([r["sentence"] for r in rows], padding=True, return_tensors="pt")
    with torch.no_grad():
        preds = tokenizer.batch_decode(model.generate(**batch, max_new_tokens=3), skip_special_tokens=True)
    assert preds == json.loads((out / "metrics.json").read_text())["eval_preds"]
    mine, ref = load_file(out / "adapter" / "adapter_model.safetensors"), load_file(
        tmp / "plain" / "adapter" / "adapter_model.safetensors")
    assert mine.keys() == ref.keys() and any("lora_A" in k for k in mine)
    for key in ref:
        torch.testing.assert_close(mine[key], ref[key], rtol=2e-3, atol=1e-5)
