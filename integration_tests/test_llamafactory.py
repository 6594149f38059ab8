"""LLaMA-Factory (0.9.5, with its pins: transformers <= 5.6, accelerate <= 1.11, peft <= 0.18.1,
trl <= 0.24) trained under hf_zero the ways its users launch it, against plain ``torchrun`` DDP of
the same YAML without ``deepspeed:``:

- ``hf-zero run --nproc_per_node 2 .../llamafactory/launcher.py cfg.yaml`` with ``deepspeed:
  ds_z3.json`` (or a stage-2 file) inside the YAML: SFT full and LoRA, DPO full and LoRA;
- ``hf-zero run -m llamafactory.launcher cfg.yaml``, the module form of that line;
- ``FORCE_TORCHRUN=1 llamafactory-cli train cfg.yaml`` unchanged, with a ``torchrun`` on ``PATH``
  that runs ``hf-zero run`` (LLaMA-Factory starts ``torchrun`` by name: launcher.py).

Losses to 2e-3 (fp32), saved weights equal. The model and the data sets are local (a tiny Qwen2 from
``assets/``, datasets registered in a temporary ``dataset_info.json``). Skipped where LLaMA-Factory is
not installed (the dev venv, CI); ``scripts/test_versions.sh lf`` builds a venv that has it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from _run import REPO, logged_losses, run, write_config

if importlib.util.find_spec("llamafactory") is None:
    pytest.skip("LLaMA-Factory is not installed (pip install llamafactory==0.9.5 with its pins; "
                "scripts/test_versions.sh lf builds such a venv)", allow_module_level=True)

pytestmark = pytest.mark.slow

LAUNCHER = Path(importlib.util.find_spec("llamafactory").submodule_search_locations[0]) / "launcher.py"
MODEL = REPO / "assets" / "tiny-qwen2"
STEPS = 4
WORDS = "the a cat dog sat ran on under mat tree blue red big small quickly slowly".split()

# LLaMA-Factory's own examples/deepspeed/ds_z{2,3}_config.json, as its users have them.
_FP16 = {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
         "hysteresis": 2, "min_loss_scale": 1}
_TOP = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_allow_untested_optimizer": True, "fp16": _FP16, "bf16": {"enabled": "auto"}}
DS_CONFIGS = {
    2: {**_TOP, "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 5e8,
                                      "overlap_comm": False, "reduce_scatter": True, "reduce_bucket_size": 5e8,
                                      "contiguous_gradients": True, "round_robin_gradients": True}},
    3: {**_TOP, "zero_optimization": {"stage": 3, "overlap_comm": False, "contiguous_gradients": True,
                                      "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                                      "stage3_prefetch_bucket_size": "auto",
                                      "stage3_param_persistence_threshold": "auto",
                                      "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                                      "stage3_gather_16bit_weights_on_model_save": True}},
}

COMMON = {
    "model_name_or_path": str(MODEL), "do_train": True, "template": "qwen", "cutoff_len": 64,
    "overwrite_cache": True, "preprocessing_num_workers": 1, "dataloader_num_workers": 0,
    "logging_steps": 1, "save_strategy": "no", "report_to": "none", "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 2, "learning_rate": 1.0e-3, "max_steps": STEPS, "lr_scheduler_type": "cosine",
    "warmup_ratio": 0.25, "seed": 3,
    # LLaMA-Factory's examples train in bf16; fp32 here so that the weights compare to a few ulps.
    "bf16": False,
}
LORA = {"finetuning_type": "lora", "lora_rank": 8, "lora_alpha": 16, "lora_target": "q_proj,v_proj"}
FLOWS = {
    "sft_full": {"stage": "sft", "dataset": "tiny_sft", "finetuning_type": "full"},
    "sft_lora": {"stage": "sft", "dataset": "tiny_sft", **LORA},
    "dpo_full": {"stage": "dpo", "dataset": "tiny_dpo", "finetuning_type": "full", "pref_beta": 0.1},
    "dpo_lora": {"stage": "dpo", "dataset": "tiny_dpo", "pref_beta": 0.1, **LORA},
}
CASES = [("sft_full", 3), ("sft_full", 2), ("sft_lora", 3), ("dpo_full", 3), ("dpo_lora", 2), ("dpo_lora", 3)]


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> Path:
    """Alpaca-style SFT rows and ranked (chosen/rejected) rows, registered as LLaMA-Factory's users do."""
    root = tmp_path_factory.mktemp("lf_data")
    g = torch.Generator().manual_seed(0)

    def phrase(n):
        return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g))

    (root / "sft.json").write_text(json.dumps(
        [{"instruction": phrase(6), "input": "", "output": phrase(8)} for _ in range(16)]))
    (root / "dpo.json").write_text(json.dumps(
        [{"instruction": phrase(6), "input": "", "chosen": phrase(7), "rejected": phrase(5)} for _ in range(16)]))
    (root / "dataset_info.json").write_text(json.dumps({
        "tiny_sft": {"file_name": "sft.json"},
        "tiny_dpo": {"file_name": "dpo.json", "ranking": True,
                     "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected"}},
    }))
    return root


def _yaml(path: Path, flow: str, dataset_dir: Path, out: Path, ds_config: Path | None = None) -> Path:
    """LLaMA-Factory's config file. JSON is YAML, and LLaMA-Factory reads .yaml files with yaml.safe_load."""
    cfg = {**COMMON, **FLOWS[flow], "dataset_dir": str(dataset_dir), "output_dir": str(out)}
    if ds_config is not None:
        cfg["deepspeed"] = str(ds_config)
    path.write_text(json.dumps(cfg, indent=1))
    return path


@pytest.fixture(scope="module")
def ddp(dataset_dir, tmp_path_factory):
    """Each flow once under plain torchrun DDP (2 CPU ranks), on first use."""
    done: dict[str, Path] = {}

    def get(flow: str) -> Path:
        if flow not in done:
            root = tmp_path_factory.mktemp(f"ddp_{flow}")
            cfg = _yaml(root / "cfg.yaml", flow, dataset_dir, root / "out")
            run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                 str(REPO / "integration_tests" / "scripts" / "plain_run.py"), str(LAUNCHER), str(cfg)], timeout=300)
            done[flow] = root / "out"
        return done[flow]

    return get


def _weights(out: Path, lora: bool) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / ("adapter_model.safetensors" if lora else "model.safetensors"))


def _assert_same_training(out: Path, want_out: Path, flow: str) -> None:
    got, want = logged_losses(out), logged_losses(want_out)
    assert len(got) == len(want) == STEPS
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-3, atol=1e-6)
    lora = flow.endswith("lora")
    got_w, want_w = _weights(out, lora), _weights(want_out, lora)
    assert got_w.keys() == want_w.keys()
    for name, value in want_w.items():
        assert got_w[name].dtype == value.dtype, name
        torch.testing.assert_close(got_w[name], value, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("flow,stage", CASES, ids=[f"{f}-s{s}" for f, s in CASES])
def test_launcher_yaml_deepspeed_matches_ddp(flow, stage, dataset_dir, ddp, tmp_path):
    """hf-zero run .../launcher.py cfg.yaml, the zero config given only inside the YAML."""
    ds = write_config(tmp_path / f"ds_z{stage}_config.json", DS_CONFIGS[stage])
    cfg = _yaml(tmp_path / "cfg.yaml", flow, dataset_dir, tmp_path / "out", ds)
    proc = run([sys.executable, "-m", "hf_zero.cli.main", "run", "--nproc_per_node", "2", str(LAUNCHER), str(cfg)],
               timeout=300)
    log = proc.stdout + proc.stderr
    assert f"ZeRO stage {stage}" in log
    if stage == 3 and flow.endswith("full"):
        # Low-memory loading found the config inside the YAML: rank 1 built the model on meta.
        assert "LOCAL_RANK 1 built Qwen2ForCausalLM on the meta device" in log
    if flow == "dpo_full" and stage == 3:
        # The reference model went to prepare_frozen_model (not TRL's prepare_deepspeed): sharded.
        assert re.search(r"frozen \w+ sharded over 2 ranks", log), log[-3000:]
    _assert_same_training(tmp_path / "out", ddp(flow), flow)


def test_module_form_matches_ddp(dataset_dir, ddp, tmp_path):
    """hf-zero run -m llamafactory.launcher cfg.yaml: what FORCE_TORCHRUN=1 llamafactory-cli train runs."""
    ds = write_config(tmp_path / "ds_z3_config.json", DS_CONFIGS[3])
    cfg = _yaml(tmp_path / "cfg.yaml", "sft_lora", dataset_dir, tmp_path / "out", ds)
    proc = run([sys.executable, "-m", "hf_zero.cli.main", "run", "--nproc_per_node", "2",
                "-m", "llamafactory.launcher", str(cfg)], timeout=300)
    assert "ZeRO stage 3" in proc.stdout + proc.stderr
    _assert_same_training(tmp_path / "out", ddp("sft_lora"), "sft_lora")


def test_llamafactory_cli_with_hf_zero_as_torchrun(dataset_dir, ddp, tmp_path, monkeypatch):
    """FORCE_TORCHRUN=1 llamafactory-cli train cfg.yaml, unchanged, with a ``torchrun`` first on PATH
    that is ``exec hf-zero run "$@"`` (the route docs/versions.md gives LlamaBoard and CLI users)."""
    cli = shutil.which("llamafactory-cli", path=os.path.dirname(sys.executable))
    assert cli, "llamafactory-cli is not next to this Python"
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "torchrun").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m hf_zero.cli.main run "$@"\n')
    (shim / "torchrun").chmod(0o755)
    ds = write_config(tmp_path / "ds_z3_config.json", DS_CONFIGS[3])
    cfg = _yaml(tmp_path / "cfg.yaml", "sft_lora", dataset_dir, tmp_path / "out", ds)
    monkeypatch.setenv("FORCE_TORCHRUN", "1")
    monkeypatch.setenv("NPROC_PER_NODE", "2")  # LLaMA-Factory counts GPUs for it; there are none here
    monkeypatch.setenv("PATH", f"{shim}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = run([cli, "train", str(cfg)], timeout=300)
    assert "ZeRO stage 3" in proc.stdout + proc.stderr
    _assert_same_training(tmp_path / "out", ddp("sft_lora"), "sft_lora")
