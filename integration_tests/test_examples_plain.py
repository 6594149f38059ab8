"""The example scripts run WITHOUT hf_zero: plain `python examples/.../*.py` on CPU, one process.

They establish the baseline that the hf_zero runs of the same scripts are compared with: each script
trains a few steps on the tiny committed assets (assets/, made by scripts/make_tiny_assets.py), the
logged loss falls, the saved model / LoRA adapter loads with from_pretrained, and the inference
script generates from it.

    pytest integration_tests/test_examples_plain.py          # ~1 min on 2 cores
    pytest integration_tests/test_examples_plain.py -m "not slow"   # only the quick checks
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "assets"
QWEN_DIR = REPO / "examples" / "finetune_qwen"
LORA_DIR = REPO / "examples" / "chatglm_lora"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # A test run under torchrun (or with a GPU) must not leak into the child: one CPU process.
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID", "ACCELERATE_USE_DEEPSPEED"):
        env.pop(key, None)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        CUDA_VISIBLE_DEVICES="",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        WANDB_DISABLED="true",
        PYTHONUNBUFFERED="1",
    )
    return env


def run_script(*args: str | Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `python <args>` from the repository root; fail with the output tail if it exits non-zero."""
    cmd = [sys.executable, *map(str, args)]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(
            f"exit code {proc.returncode}: {' '.join(cmd)}\n--- stdout (tail) ---\n{proc.stdout[-3000:]}"
            f"\n--- stderr (tail) ---\n{proc.stderr[-5000:]}"
        )
    return proc


def logged_losses(output_dir: Path) -> list[float]:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    losses = [entry["loss"] for entry in state["log_history"] if "loss" in entry]
    assert losses, f"no loss logged in {output_dir / 'trainer_state.json'}"
    assert all(math.isfinite(x) for x in losses), losses
    return losses


def assert_generates(model_dir: Path, prompt: str, tokenizer_dir: Path) -> str:
    """inference_hf.py prints the prompt, the 8 new token ids and their decoded text (last line)."""
    from transformers import AutoTokenizer

    proc = run_script(LORA_DIR / "inference_hf.py", model_dir, "--prompt", prompt,
                      "--max_new_tokens", "8", "--min_new_tokens", "8")
    out = proc.stdout
    assert f"prompt: {prompt}\n" in out, out
    ids = json.loads(out.split("new token ids: ", 1)[1].split("\n", 1)[0])
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert len(ids) == 8 and all(0 <= i < len(tokenizer) for i in ids), out
    response = out.split("response: ", 1)[1]
    assert response == tokenizer.decode(ids, skip_special_tokens=True) + "\n", out
    return response


def _load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------ Alpaca / Qwen
@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-qwen2", "tiny-llama"])
def test_finetune_qwen_plain(tmp_path, model):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "out"
    run_script(
        QWEN_DIR / "finetune.py",
        "--model_name_or_path", ASSETS / model,
        "--output_dir", out,
        "--max_steps", "6",
        "--per_device_train_batch_size", "4",
        "--learning_rate", "2e-3",
        "--logging_steps", "1",
        "--save_strategy", "no",
        "--report_to", "none",
        "--seed", "0",
    )

    losses = logged_losses(out)
    assert len(losses) == 6, losses
    assert losses[0] > 5.5, f"starts near ln(512) = 6.2 for random weights: {losses}"
    assert losses[-1] < losses[0], f"loss did not fall: {losses}"

    model_out = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(ASSETS / model)
    assert type(model_out) is type(base)
    assert model_out.config.tie_word_embeddings == base.config.tie_word_embeddings
    saved = load_file(out / "model.safetensors")
    base_sd = base.state_dict()
    changed = [k for k, v in saved.items() if k in base_sd and not torch.equal(v, base_sd[k])]
    assert "model.embed_tokens.weight" in changed and len(changed) > len(saved) // 2, changed
    # the checkpoint holds the trained values, not just the shapes
    out_sd = model_out.state_dict()
    for key, value in saved.items():
        torch.testing.assert_close(out_sd[key], value, rtol=0, atol=0)
    assert len(AutoTokenizer.from_pretrained(out)) == model_out.config.vocab_size

    assert_generates(out, "Add the two numbers.", out)


# ----------------------------------------------------------------------------- ChatGLM3-style LoRA
@pytest.mark.slow
def test_chatglm_lora_plain(tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    run_script(
        LORA_DIR / "finetune_hf.py",
        "assets/data", "assets/tiny-glm4", LORA_DIR / "configs" / "lora.yaml",
        "--output_dir", out,
        "--max_steps", "6",
        "--save_steps", "3",
        "--logging_steps", "1",
        "--log_level", "warning",
        "--report_to", "none",
    )

    losses = logged_losses(out)
    assert len(losses) == 6, losses
    assert losses[-1] < losses[0], f"loss did not fall: {losses}"
    for folder in (out, out / "checkpoint-3", out / "checkpoint-6"):
        assert (folder / "adapter_config.json").is_file(), sorted(p.name for p in folder.iterdir())
        assert (folder / "adapter_model.safetensors").is_file()
        assert not (folder / "model.safetensors").exists(), "a LoRA run saves the adapter only"
    adapter_cfg = json.loads((out / "adapter_config.json").read_text())
    assert adapter_cfg["r"] == 8 and adapter_cfg["lora_alpha"] == 32
    assert adapter_cfg["base_model_name_or_path"] == "assets/tiny-glm4"

    base = AutoModelForCausalLM.from_pretrained(ASSETS / "tiny-glm4")
    base_sd = {k: v.clone() for k, v in base.state_dict().items()}
    model = PeftModel.from_pretrained(base, out)
    lora_b = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    assert lora_b and all(torch.count_nonzero(p) > 0 for p in lora_b.values()), "lora_B still zero: untrained"
    # the frozen base weights are untouched (compare through the un-merged base layers)
    plain = model.get_base_model().state_dict()
    for key, value in base_sd.items():
        module, _, leaf = key.rpartition(".")
        peft_key = key if key in plain else f"{module}.base_layer.{leaf}"
        torch.testing.assert_close(plain[peft_key], value, rtol=0, atol=0)

    assert_generates(out, "类型#裙*颜色#蓝色*风格#清新*图案#蝴蝶结", ASSETS / "tiny-glm4")
    assert_generates(out / "checkpoint-3", "类型#裤*颜色#黑色*风格#简约*图案#条纹", ASSETS / "tiny-glm4")


# ----------------------------------------------------------------------------------- quick checks
def test_finetune_hf_argument_parsing():
    mod = _load_module(LORA_DIR / "finetune_hf.py", "finetune_hf_under_test")
    args, overrides = mod.parse_args(
        ["assets/data", "assets/tiny-qwen2", "c.yaml", "ds.json", "--max_steps", "6", "--learning_rate=1e-3",
         "--bf16", "--report_to", "none"]
    )
    assert args.ds_config == "ds.json" and args.zero_config is None
    assert overrides == {"max_steps": 6, "learning_rate": 1e-3, "bf16": True, "report_to": "none"}
    # an unknown option's value is not taken for the optional DS_CONFIG positional
    args, overrides = mod.parse_args(["d", "m", "c.yaml", "--max_steps", "6", "--deepspeed", "z.json"])
    assert args.ds_config is None and args.zero_config == "z.json" and overrides == {"max_steps": 6}
    args, _ = mod.parse_args(["d", "m", "c.yaml", "--zero_config", "z.json"])
    assert args.zero_config == "z.json"
    with pytest.raises(SystemExit):
        mod.parse_args(["d", "m", "c.yaml", "--not_a_training_arg", "1"])


def test_finetune_hf_reads_advertisegen_and_chatglm3_conversations_alike():
    """ChatGLM3's AdvertiseGen_fix records ({"conversations": [user, assistant]}) give the same
    tokens and labels as the original AdvertiseGen records ({"content", "summary"})."""
    from transformers import AutoTokenizer

    mod = _load_module(LORA_DIR / "finetune_hf.py", "finetune_hf_formats")
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tiny-glm4")
    records = [json.loads(line) for line in (ASSETS / "data" / "advertise_gen_tiny.jsonl").read_text().splitlines()[:3]]
    plain = {"content": [r["content"] for r in records], "summary": [r["summary"] for r in records]}
    conversations = {"conversations": [[{"role": "user", "content": r["content"]},
                                        {"role": "assistant", "content": r["summary"]}] for r in records]}
    a = mod.process_batch(plain, tokenizer, 64, 96)
    b = mod.process_batch(conversations, tokenizer, 64, 96)
    assert a == b
    first = a["labels"][0]
    n_prompt = first.count(-100)
    assert 0 < n_prompt < len(first) and first[:n_prompt] == [-100] * n_prompt
    assert tokenizer.decode(first[n_prompt:], skip_special_tokens=True) == records[0]["summary"]
    with pytest.raises(ValueError, match="content/summary"):
        mod.process_batch({"text": ["x"]}, tokenizer, 64, 96)


# The keys hf_zero reports as changing nothing, per example config: only keys that the source
# documents themselves write (openMind guide: its bf16 loss-scale keys, its ZeRO-2/3 bucketing keys;
# the ChatGLM3 tutorial's ds_zero_2.json and ChatGLM3's ds_zero_3.json). ds_zero3.json is ours: none.
_BF16_SCALER = ["bf16.loss_scale", "bf16.loss_scale_window", "bf16.initial_scale_power", "bf16.hysteresis",
                "bf16.min_loss_scale"]
_Z = "zero_optimization."
_GUIDE_Z3 = [_Z + "overlap_comm", _Z + "contiguous_gradients", _Z + "stage3_max_reuse_distance"]
EXPECTED_NO_EFFECT = {
    "examples/finetune_qwen/ds_config_zero1.json": _BF16_SCALER,
    "examples/finetune_qwen/ds_config_zero2.json": [_Z + k for k in ("allgather_partitions", "allgather_bucket_size",
                                                                     "overlap_comm", "reduce_scatter",
                                                                     "contiguous_gradients")] + _BF16_SCALER,
    "examples/finetune_qwen/ds_config_zero3.json": _GUIDE_Z3 + _BF16_SCALER,
    "examples/finetune_qwen/ds_config_zero3_offload.json": _GUIDE_Z3 + _BF16_SCALER,
    "examples/finetune_qwen/ds_zero3.json": [],
    "examples/chatglm_lora/configs/ds_zero_2.json": ["steps_per_print", "wall_clock_breakdown"] + [
        _Z + k for k in ("allgather_partitions", "allgather_bucket_size", "overlap_comm", "reduce_scatter",
                         "contiguous_gradients")],
    "examples/chatglm_lora/configs/ds_zero_3.json": ["zero_allow_untested_optimizer"] + [
        _Z + k for k in ("allgather_partitions", "allgather_bucket_size", "reduce_scatter", "contiguous_gradients",
                         "overlap_comm", "stage3_max_reuse_distance")],
}


@pytest.mark.parametrize("path", sorted(EXPECTED_NO_EFFECT))
def test_example_configs_report_only_the_source_documents_no_effect_keys(path):
    from hf_zero.config import parse_config

    cfg = parse_config(REPO / path)
    assert sorted(cfg.no_effect_keys) == sorted(EXPECTED_NO_EFFECT[path])


def test_every_example_config_is_listed():
    found = {str(p.relative_to(REPO)) for d in (QWEN_DIR, LORA_DIR / "configs") for p in d.glob("*.json")}
    assert found == set(EXPECTED_NO_EFFECT)


@pytest.mark.slow
def test_tiny_assets_regenerate_identically(tmp_path):
    """scripts/make_tiny_assets.py reproduces the committed data, tokenizer and weights."""
    import torch
    from safetensors.torch import load_file

    run_script(REPO / "scripts" / "make_tiny_assets.py", "--out", tmp_path)
    for rel in ("data/alpaca_tiny.json", "data/advertise_gen_tiny.jsonl", "data/advertise_gen_tiny_dev.jsonl",
                "tiny-qwen2/tokenizer.json", "tiny-llama/tokenizer.json", "tiny-glm4/tokenizer.json",
                "tiny-qwen2/chat_template.jinja", "tiny-glm4/chat_template.jinja", "tiny-glm4/tokenizer_config.json"):
        assert (tmp_path / rel).read_bytes() == (ASSETS / rel).read_bytes(), rel
    for model in ("tiny-qwen2", "tiny-llama", "tiny-glm4"):
        fresh, committed = load_file(tmp_path / model / "model.safetensors"), load_file(ASSETS / model / "model.safetensors")
        assert fresh.keys() == committed.keys()
        for key in fresh:
            assert torch.equal(fresh[key], committed[key]), f"{model}: {key}"
    # the model's description, not the transformers version line, must match
    for model in ("tiny-qwen2", "tiny-llama", "tiny-glm4"):
        fresh, committed = (json.loads((root / model / "config.json").read_text()) for root in (tmp_path, ASSETS))
        fresh.pop("transformers_version"), committed.pop("transformers_version")
        assert fresh == committed, model
    records = json.loads((ASSETS / "data" / "alpaca_tiny.json").read_text())
    assert len(records) == 200 and all(set(r) == {"instruction", "input", "output"} for r in records)
