"""TRL's own shipped scripts (``trl/scripts/sft.py``, ``dpo.py``, ``grpo.py``), run by path as
their users run them, under ``hf-zero run --deepspeed ds.json`` at stages 2 and 3 against plain
``torchrun`` DDP of the same command: SFT (full and LoRA), DPO with a reference model and TR-DPO's
``sync_ref_model``, GRPO with ``beta > 0`` (a reference model, generation). Losses to 2e-3, saved
weights equal and loadable; the reference model is sharded at stage 3 (half the elements on each
rank, from hf_zero's start-up log).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from _run import REPO, hf_zero_run, logged_losses, run, write_config, zero_config

trl = pytest.importorskip("trl", reason="TRL is a test dependency (pip install -e '.[test]')")
pytestmark = pytest.mark.slow

SCRIPTS = Path(trl.__file__).parent / "scripts"
MODEL = REPO / "assets" / "tiny-qwen2"
STEPS = 3
WORDS = "the a cat dog sat ran on under mat tree blue red big small quickly slowly".split()


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl_data")
    g = torch.Generator().manual_seed(0)

    def phrase(n):
        return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g))

    return {
        "text": _jsonl(root / "text", [{"text": phrase(12)} for _ in range(32)]),
        "pref": _jsonl(root / "pref", [{"prompt": phrase(6), "chosen": phrase(5), "rejected": phrase(5)}
                                       for _ in range(32)]),
        "prompts": _jsonl(root / "prompts", [{"prompt": phrase(6)} for _ in range(32)]),
    }


COMMON = ["--model_name_or_path", str(MODEL), "--per_device_train_batch_size", "2", "--max_steps", str(STEPS),
          "--logging_steps", "1", "--report_to", "none", "--use_cpu", "--learning_rate", "1e-3", "--seed", "3",
          "--save_strategy", "steps", "--save_steps", str(STEPS),
          # TRL's configs default to bf16; fp32 here so that the weights compare to a few ulps.
          "--bf16", "False"]
FLOWS = {
    "sft": ("sft.py", "text", ["--max_length", "32"]),
    "sft_lora": ("sft.py", "text", ["--max_length", "32", "--use_peft", "--lora_r", "8", "--lora_alpha", "16",
                                     "--lora_target_modules", "q_proj", "v_proj"]),
    "dpo_sync": ("dpo.py", "pref", ["--sync_ref_model", "--ref_model_sync_steps", "2",
                                    "--ref_model_mixup_alpha", "0.5"]),
    "grpo": ("grpo.py", "prompts", ["--reward_funcs", "integration_tests.trl_rewards.distinct_words",
                                    "--beta", "0.1", "--num_generations", "2", "--max_completion_length", "8"]),
}
CASES = [("sft", 2), ("sft", 3), ("sft_lora", 3), ("dpo_sync", 1), ("dpo_sync", 2), ("dpo_sync", 3), ("grpo", 3)]


def _args(flow: str, data: dict, out: Path) -> list[str]:
    script, dataset, extra = FLOWS[flow]
    return [str(SCRIPTS / script), "--dataset_name", str(data[dataset]), "--output_dir", str(out), *COMMON, *extra]


@pytest.fixture(scope="module")
def ddp(data, tmp_path_factory):
    """Each flow once under plain torchrun DDP (2 CPU ranks), on first use."""
    done: dict[str, Path] = {}

    def get(flow: str) -> Path:
        if flow not in done:
            out = tmp_path_factory.mktemp(f"ddp_{flow}")
            run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                 str(REPO / "integration_tests" / "scripts" / "plain_run.py"), *_args(flow, data, out)], timeout=300)
            done[flow] = out
        return done[flow]

    return get


def _weights(out: Path, lora: bool) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / ("adapter_model.safetensors" if lora else "model.safetensors"))


@pytest.mark.parametrize("flow,stage", CASES, ids=[f"{f}-s{s}" for f, s in CASES])
def test_trl_script_matches_ddp(flow, stage, data, ddp, tmp_path):
    want_out = ddp(flow)
    cfg = write_config(tmp_path / "ds.json", zero_config(stage))
    out = tmp_path / "out"
    proc = hf_zero_run(2, *_args(flow, data, out), "--deepspeed", str(cfg), timeout=300)
    got, want = logged_losses(out / f"checkpoint-{STEPS}"), logged_losses(want_out / f"checkpoint-{STEPS}")
    assert len(got) == len(want) == STEPS
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-3, atol=1e-6)

    lora = flow == "sft_lora"
    got_w, want_w = _weights(out, lora), _weights(want_out, lora)
    assert got_w.keys() == want_w.keys()
    for name, value in want_w.items():
        assert got_w[name].dtype == value.dtype, name
        torch.testing.assert_close(got_w[name], value, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    if lora:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(MODEL), out)
    else:
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(out)

    if flow in ("dpo_sync", "grpo") and stage >= 2:
        # The reference model went through prepare_frozen_model: sharded (half each) at 2/3.
        total = sum(t.numel() for t in _weights(want_out, False).values())
        frozen = re.findall(r"frozen \w+ sharded over 2 ranks \(([\d,]+) parameter elements", proc.stdout + proc.stderr)
        assert frozen, "no reference model was sharded"
        assert int(frozen[0].replace(",", "")) == total // 2
