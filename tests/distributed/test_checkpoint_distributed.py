"""Checkpoints on 2 gloo ranks: 16-bit export, sharded save/resume (also across world sizes and
stages 2 -> 3), consolidation, and saves interrupted mid-way.

Three torchrun launches serve every test (each launch costs seconds):

1. 2 ranks: exports at stages 0-3 (tied and untied, fp32 and bf16, small shards), a LoRA adapter
   export at stage 3, train 3 steps -> save -> train 3 more at stages 0-3 (the continuous
   reference), interrupted saves.
2. 1 rank: resume the 2-rank stage 1 and 2 checkpoints (2 -> 1); train/save at stages 1 and 3.
3. 2 ranks: resume the stage 0-3 checkpoints on the same ranks, at other stages (2 -> 3, 1 -> 3,
   2 -> 0), and the 1-rank ones (1 -> 2); resume from copies holding crafted files.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from _launch import torchrun
from _models import tiny_model

pytestmark = pytest.mark.slow

WORKER = "tests/distributed/checkpoint_worker.py"
MODEL_OF_STAGE = {0: "qwen2_tied", 1: "llama", 2: "qwen2_tied", 3: "llama"}
SAME_RANKS = [0, 1, 2, 3]
TIMINGS: dict[str, float] = {}


def _launch(tmp, name: str, tasks: list[dict], nproc: int) -> dict:
    (tmp / f"{name}.json").write_text(json.dumps(tasks))
    started = time.perf_counter()
    torchrun(WORKER, str(tmp / f"{name}.json"), str(tmp / f"{name}.pt"), nproc=nproc)
    TIMINGS[name] = time.perf_counter() - started
    return torch.load(tmp / f"{name}.pt", weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    ck = lambda name: str(tmp / name)  # noqa: E731
    first = []
    for stage in range(4):
        for model in ("qwen2_tied", "llama"):
            # Small shards for half of the exports: several files + index.
            shard = "100KB" if (stage + (model == "llama")) % 2 else "5GB"
            first.append({"kind": "export", "name": f"export-s{stage}-{model}", "stage": stage, "model": model,
                          "dir": ck(f"export-s{stage}-{model}"), "max_shard_size": shard})
    first.append({"kind": "export", "name": "export-s3-lora", "stage": 3, "model": "llama", "peft": True,
                  "dir": ck("export-s3-lora")})
    for stage in range(4):
        first.append({"kind": "train_save", "name": f"save-s{stage}", "stage": stage, "model": MODEL_OF_STAGE[stage],
                      "ckpt": ck(f"ckpt-s{stage}"), **({"foreign_file": "trainer_state.json"} if stage == 2 else {})})
    first.append({"kind": "train_save", "name": "save-s2-fp16", "stage": 2, "model": "qwen2_tied", "dtype": "fp16",
                  "ckpt": ck("ckpt-s2-fp16")})
    first.append({"kind": "train_save", "name": "save-s3-lora", "stage": 3, "model": "llama", "peft": True,
                  "ckpt": ck("ckpt-s3-lora")})
    first.append({"kind": "interrupt", "name": "interrupt", "stage": 2, "model": "qwen2_tied", "dir": ck("interrupt")})
    os.makedirs(ck("interrupt"))
    results = _launch(tmp, "two_ranks_save", first, nproc=2)

    second = [
        {"kind": "resume", "name": "resume-s1-2to1", "stage": 1, "model": "llama", "ckpt": ck("ckpt-s1")},
        {"kind": "resume", "name": "resume-s2-2to1", "stage": 2, "model": "qwen2_tied", "ckpt": ck("ckpt-s2")},
        {"kind": "train_save", "name": "save-s1-1rank", "stage": 1, "model": "llama", "ckpt": ck("ckpt-s1-1rank")},
        {"kind": "train_save", "name": "save-s3-1rank", "stage": 3, "model": "llama", "ckpt": ck("ckpt-s3-1rank")},
    ]
    results.update(_launch(tmp, "one_rank", second, nproc=1))

    third = [
        {"kind": "resume", "name": f"resume-s{s}", "stage": s, "model": MODEL_OF_STAGE[s], "ckpt": ck(f"ckpt-s{s}")}
        for s in SAME_RANKS
    ]
    third += [
        {"kind": "resume", "name": "resume-s2-as-s3", "stage": 3, "model": "qwen2_tied", "ckpt": ck("ckpt-s2")},
        {"kind": "resume", "name": "resume-s1-as-s3", "stage": 3, "model": "llama", "ckpt": ck("ckpt-s1")},
        {"kind": "resume", "name": "resume-s2-as-s0", "stage": 0, "model": "qwen2_tied", "ckpt": ck("ckpt-s2")},
        {"kind": "resume", "name": "resume-s2-fp16", "stage": 2, "model": "qwen2_tied", "dtype": "fp16",
         "ckpt": ck("ckpt-s2-fp16")},
        {"kind": "resume", "name": "resume-s3-lora", "stage": 3, "model": "llama", "peft": True, "ckpt": ck("ckpt-s3-lora")},
        {"kind": "resume", "name": "resume-s1-1to2", "stage": 1, "model": "llama", "ckpt": ck("ckpt-s1-1rank")},
        {"kind": "resume", "name": "resume-s3-1to2", "stage": 3, "model": "llama", "ckpt": ck("ckpt-s3-1rank")},
        {"kind": "crafted", "name": "crafted", "stage": 2, "model": "qwen2_tied", "ckpt": ck("ckpt-s2"),
         "dir": ck("crafted")},
    ]
    os.makedirs(ck("crafted"))
    results.update(_launch(tmp, "two_ranks_resume", third, nproc=2))
    results["_tmp"] = tmp
    print("torchrun launches (s):", {k: round(v, 1) for k, v in TIMINGS.items()})
    return results


def _load_causal_lm(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")


# ----------------------------------------------------------------------------------------------- export
@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("model", ["qwen2_tied", "llama"])
def test_16bit_export_loads_with_from_pretrained(runs, stage, model):
    got = runs[f"export-s{stage}-{model}"]
    expected = got["expected"]
    sharded = (stage + (model == "llama")) % 2 == 1
    for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        files = sorted(os.listdir(got["dirs"][dtype]))
        if sharded:
            assert "model.safetensors.index.json" in files and "model.safetensors" not in files
            shards = [f for f in files if f.startswith("model-")]
            assert len(shards) > 1 and all(f.endswith(f"-of-{len(shards):05d}.safetensors") for f in shards)
        else:
            assert "model.safetensors" in files and "model.safetensors.index.json" not in files
        assert {"config.json", "generation_config.json"} <= set(files)
        assert not any(f.startswith(".") for f in os.listdir(os.path.dirname(got["dirs"][dtype])))  # no temp dir left

        loaded = _load_causal_lm(got["dirs"][dtype])
        assert loaded.dtype == torch_dtype
        state = loaded.state_dict()
        assert set(state) == set(expected)
        for name, tensor in expected.items():
            want = tensor if dtype == "fp32" else tensor.to(torch.bfloat16)
            assert torch.equal(state[name], want), (dtype, name)
        if model == "qwen2_tied":
            assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # re-tied on load
            from safetensors import safe_open

            keys = set()
            for f in files:
                if f.endswith(".safetensors"):
                    with safe_open(os.path.join(got["dirs"][dtype], f), "pt") as fh:
                        keys |= set(fh.keys())
            assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys


def test_lora_adapter_export_loads_with_peft(runs):
    from peft import PeftModel

    got = runs["export-s3-lora"]
    for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        directory = got["dirs"][dtype]
        assert sorted(os.listdir(directory)) == ["adapter_config.json", "adapter_model.safetensors"]
        peft_model = PeftModel.from_pretrained(tiny_model("llama"), directory)
        state = peft_model.state_dict()
        lora_keys = [k for k in got["expected"] if "lora_" in k]
        assert lora_keys and all(k in state for k in lora_keys)
        for name in lora_keys:
            want = got["expected"][name].to(torch_dtype).float()
            assert torch.equal(state[name].float(), want), (dtype, name)
        # The B matrices start at zero; equal non-zero values show the trained adapter arrived.
        assert any(float(got["expected"][k].abs().sum()) > 0 for k in lora_keys if "lora_B" in k)


# ----------------------------------------------------------------------------------------------- resume
def _assert_same_losses(resumed, reference, exact: bool):
    if exact:
        assert resumed == reference
    else:
        torch.testing.assert_close(resumed, reference, rtol=1e-5, atol=0)


@pytest.mark.parametrize("stage", SAME_RANKS)
def test_resume_on_the_same_ranks_continues_the_run(runs, stage):
    saved, resumed = runs[f"save-s{stage}"], runs[f"resume-s{stage}"]
    assert saved["global_steps"] == 6 and resumed["global_steps_loaded"] == 3
    assert resumed["extra"] == {"step": 3, "note": f"save-s{stage}"}
    _assert_same_losses(resumed["after"], saved["after"], exact=True)
    assert resumed["rng"] == saved["rng"]  # every rank's python/numpy/torch generators


@pytest.mark.parametrize(
    ("resumed", "saved"),
    [
        ("resume-s1-2to1", "save-s1"),
        ("resume-s2-2to1", "save-s2"),
        ("resume-s1-1to2", "save-s1-1rank"),
        ("resume-s3-1to2", "save-s3-1rank"),
    ],
)
def test_resume_on_another_world_size(runs, resumed, saved):
    got, ref = runs[resumed], runs[saved]
    assert got["global_steps_loaded"] == 3 and got["extra"]["step"] == 3
    _assert_same_losses(got["after"], ref["after"], exact=False)
    assert got["rng"][0] == ref["rng"][0]  # rank 0 restores rank 0's generators


def test_one_rank_and_two_rank_runs_agree(runs):
    # The world-size comparisons above rest on this: same global batch, same losses.
    torch.testing.assert_close(runs["save-s1-1rank"]["before"], runs["save-s1"]["before"], rtol=1e-5, atol=0)
    torch.testing.assert_close(runs["save-s3-1rank"]["after"], runs["save-s3"]["after"], rtol=1e-5, atol=0)


@pytest.mark.parametrize(("resumed", "saved"), [("resume-s2-as-s3", "save-s2"), ("resume-s1-as-s3", "save-s1"),
                                                ("resume-s2-as-s0", "save-s2")])
def test_resume_at_another_stage(runs, resumed, saved):
    # Parameter-name keys make the layouts interchangeable: DCP reads whole tensors into shards
    # (stage 1 -> 3) and shards into whole tensors (stage 2 -> 0).
    _assert_same_losses(runs[resumed]["after"], runs[saved]["after"], exact=False)


def test_resume_fp16_restores_the_loss_scaler(runs):
    saved, resumed = runs["save-s2-fp16"], runs["resume-s2-fp16"]
    assert resumed["loss_scale_loaded"] == saved["loss_scale_saved"] != 2.0**16  # not the fresh-engine default
    _assert_same_losses(resumed["after"], saved["after"], exact=True)


def test_resume_lora_under_stage3(runs):
    _assert_same_losses(runs["resume-s3-lora"]["after"], runs["save-s3-lora"]["after"], exact=True)


def test_save_keeps_other_files_in_an_existing_directory(runs):
    files = set(os.listdir(runs["_tmp"] / "ckpt-s2"))
    assert {"trainer_state.json", "hf_zero_checkpoint.json", ".metadata", "config.json"} <= files
    assert {"hf_zero_rng_0.pth", "hf_zero_rng_1.pth", "hf_zero_extra_state.json"} <= files


# ----------------------------------------------------------------------------------------------- consolidate
@pytest.mark.parametrize("stage", [1, 3])
def test_consolidated_checkpoint_equals_the_gathered_weights(runs, stage, tmp_path):
    from hf_zero.checkpoint.consolidate import consolidate_checkpoint

    expected = runs[f"save-s{stage}"]["expected"]
    ckpt = runs["_tmp"] / f"ckpt-s{stage}"
    consolidate_checkpoint(ckpt, tmp_path / "fp32", dtype="fp32", progress=False)
    loaded = _load_causal_lm(tmp_path / "fp32").state_dict()
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name

    consolidate_checkpoint(ckpt, tmp_path / "bf16", dtype="bf16", max_shard_size="100KB", progress=False)
    assert "model.safetensors.index.json" in os.listdir(tmp_path / "bf16")
    loaded = _load_causal_lm(tmp_path / "bf16")
    assert loaded.dtype == torch.bfloat16
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name].to(torch.bfloat16)), name


def test_consolidated_lora_checkpoint_is_the_adapter(runs, tmp_path):
    from peft import PeftModel

    from hf_zero.checkpoint.consolidate import consolidate_checkpoint

    expected = runs["save-s3-lora"]["expected"]
    consolidate_checkpoint(runs["_tmp"] / "ckpt-s3-lora", tmp_path / "adapter", progress=False)
    assert sorted(os.listdir(tmp_path / "adapter")) == ["adapter_config.json", "adapter_model.safetensors"]
    state = PeftModel.from_pretrained(tiny_model("llama"), tmp_path / "adapter").state_dict()
    lora_keys = [k for k in expected if "lora_" in k]
    assert lora_keys
    for name in lora_keys:
        assert torch.equal(state[name], expected[name]), name


# ----------------------------------------------------------------------------------------------- interrupted
def test_interrupted_saves_leave_no_checkpoint(runs):
    got = runs["interrupt"]
    marker = got["marker"]
    assert "simulated crash while writing the marker" in marker["errors"][0]
    assert "failed on rank 0" in marker["errors"][1] and "simulated crash" in marker["errors"][1]
    assert marker["leftovers"] == []
    data = got["data_rank1"]
    assert all(e is not None and "simulated disk full on rank 1" in e for e in data["errors"]), data["errors"]
    assert data["leftovers"] == []
    assert "hf_zero_checkpoint.json" in got["after"]


# ----------------------------------------------------------------------------------------------- crafted files
def test_crafted_files_are_refused_on_every_rank(runs):
    """A pickle that would run code, in the metadata, in a .distcp entry or in one rank's RNG file:
    both ranks raise a CheckpointError naming the file (none waits in a collective), and the code
    never runs. test_checkpoint_safety.py covers each file kind in one process."""
    got = runs["crafted"]
    for kind in ("metadata", "bytes_entry", "rng_rank1"):
        result = got[kind]
        assert not result["ran"], kind
        for error in result["errors"]:
            assert error is not None and error.startswith("CheckpointError"), (kind, error)
            assert result["file"] in error and "refusing to load it" in error, (kind, error)
    rng = got["rng_rank1"]["errors"]
    assert "failed on rank 1" in rng[0]  # rank 0's own file was fine: it hears of rank 1's refusal
    assert "failed on rank" not in rng[1]
