"""Low-memory loading for ZeRO-3 (hf_zero.engine.materialize).

Quick tests (one process) pretend to be local rank 1 of 2 through the environment and check what
``from_pretrained`` builds there. The slow test launches 2 gloo ranks once
(``materialize_worker.py``): rank 1 loads on the meta device, the stage-3 engine fills its shards
from rank 0, and the gathered weights, buffers, tied embeddings, logits, a LoRA model, resized
embeddings and a ZeroTrainer run (after ``install_low_memory_loading()``, as ``hf-zero run`` would)
are checked against the saved files and normally loaded references.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from _launch import torchrun
from _models import tiny_model

from hf_zero.engine import materialize as mz
from hf_zero.engine import meta_loading

WORKER = "tests/distributed/materialize_worker.py"


# ------------------------------------------------------------------------------------ quick
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("mz")
    for kind in ("qwen2_tied", "llama"):
        tiny_model(kind, seed=1).save_pretrained(root / kind)
    return root


@pytest.fixture
def as_rank(monkeypatch):
    def set_rank(local_rank: int, world: int = 2):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        monkeypatch.delenv(mz.ENV_SWITCH, raising=False)

    return set_rank


def _load(path, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **kw)


def test_policy(monkeypatch, as_rank):
    as_rank(1)
    assert mz.skips_weight_loading()
    assert mz.should_use_low_memory_loading({"zero_optimization": {"stage": 3}})
    assert not mz.should_use_low_memory_loading({"zero_optimization": {"stage": 2}})
    assert not mz.should_use_low_memory_loading(None)
    from hf_zero.config.parse import parse_config

    cfg = parse_config({"zero_optimization": {"stage": 3}})
    assert mz.should_use_low_memory_loading(cfg) and mz.should_use_low_memory_loading(cfg.zero_optimization)
    monkeypatch.setenv(mz.ENV_SWITCH, "0")
    assert not mz.should_use_low_memory_loading(cfg) and not mz.skips_weight_loading()
    as_rank(0)
    assert not mz.skips_weight_loading()
    as_rank(1, world=1)
    assert not mz.skips_weight_loading()
    argv = ["--output_dir", "o", "--deepspeed", "ds.json"]
    assert mz.zero_config_from_argv(argv) == "ds.json"
    assert mz.zero_config_from_argv(["--zero_config=z.yaml"]) == "z.yaml"
    assert mz.zero_config_from_argv(["--lr", "1"]) is None


def test_zero_config_inside_an_arguments_file(tmp_path, monkeypatch):
    """LLaMA-Factory's ``launcher.py cfg.yaml`` (``deepspeed:`` in the YAML, ``key=value``
    overrides after it) and HfArgumentParser's ``train.py args.json``."""
    import json

    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.yaml").write_text("model_name_or_path: m\ndeepspeed: ds_z3.json\nstage: sft\n")
    (tmp_path / "args.json").write_text(json.dumps({"output_dir": "o", "zero_config": {"zero_optimization": {"stage": 3}}}))
    (tmp_path / "plain.yaml").write_text("model_name_or_path: m\n")
    assert mz.zero_config_from_argv(["cfg.yaml"]) == "ds_z3.json"
    assert mz.zero_config_from_argv(["cfg.yaml", "deepspeed=ds_z2.json"]) == "ds_z2.json"
    assert mz.zero_config_from_argv(["cfg.yaml", "--deepspeed", "ds.json"]) == "ds.json"
    assert mz.zero_config_from_argv(["args.json"]) == {"zero_optimization": {"stage": 3}}
    assert mz.should_use_low_memory_loading(mz.zero_config_from_argv(["args.json"]))
    assert mz.zero_config_from_argv(["plain.yaml"]) is None
    assert mz.zero_config_from_argv(["--config", "cfg.yaml"]) is None  # a flag's value is not an arguments file
    assert mz.zero_config_from_argv(["missing.yaml"]) is None


@pytest.mark.parametrize("kind", ["qwen2_tied", "llama"])
def test_meta_load_on_local_rank_1(saved, as_rank, kind):
    as_rank(1)
    real = _load(saved / kind)
    with mz.low_memory_loading():
        meta = _load(saved / kind)
    assert mz.has_meta_params(meta) and not mz.has_meta_params(real)
    assert type(meta) is type(real) and meta.config.to_dict() == real.config.to_dict()
    assert [(n, p.shape, p.dtype) for n, p in meta.named_parameters()] == [
        (n, p.shape, p.dtype) for n, p in real.named_parameters()
    ]
    tied = lambda m: m.lm_head.weight is m.model.embed_tokens.weight  # noqa: E731
    assert tied(meta) == tied(real) == (kind == "qwen2_tied")
    # Non-persistent buffers (rotary inv_freq) are computed, not loaded: real and right.
    for (n, b), (_, rb) in zip(meta.named_buffers(), real.named_buffers()):
        assert not b.is_meta and torch.equal(b, rb), n
    with mz.low_memory_loading():
        bf16 = _load(saved / kind, dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16} and mz.has_meta_params(bf16)


def test_local_rank_0_and_switches(saved, as_rank, monkeypatch):
    as_rank(0)
    with mz.low_memory_loading():
        assert not mz.has_meta_params(_load(saved / "llama"))
    as_rank(1)
    with mz.low_memory_loading(), mz.low_memory_loading(enabled=False):
        assert not mz.has_meta_params(_load(saved / "llama"))
    monkeypatch.setenv(mz.ENV_SWITCH, "0")
    with mz.low_memory_loading():
        assert not mz.has_meta_params(_load(saved / "llama"))


def test_install_is_global_and_idempotent(saved, as_rank):
    from transformers import PreTrainedModel

    as_rank(1)
    before = PreTrainedModel.__dict__["from_pretrained"]
    try:
        mz.install_low_memory_loading()
        mz.install_low_memory_loading()
        assert mz.has_meta_params(_load(saved / "llama"))
    finally:
        mz.uninstall_low_memory_loading()
    assert not mz.has_meta_params(_load(saved / "llama"))
    assert PreTrainedModel.__dict__["from_pretrained"] is before or not meta_loading._State.installed


def test_peft_on_meta_base(saved, as_rank):
    from peft import LoraConfig, get_peft_model

    as_rank(1)
    with mz.low_memory_loading():
        base = _load(saved / "qwen2_tied")
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert lora and all(p.requires_grad for p in lora.values())
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    assert mz.has_meta_params(model)


def test_resize_token_embeddings_on_meta_model(saved, as_rank):
    as_rank(1)
    for kind in ("qwen2_tied", "llama"):
        with mz.low_memory_loading():
            model = _load(saved / kind)
        model.resize_token_embeddings(140)  # mean_resizing reads values: skipped on meta
        assert model.get_input_embeddings().weight.shape[0] == model.lm_head.weight.shape[0] == 140
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == (kind == "qwen2_tied")
    as_rank(0)
    real = _load(saved / "llama")
    real.resize_token_embeddings(140)  # still initialises the new rows from the mean on a real model
    assert torch.isfinite(real.get_input_embeddings().weight[-12:]).all()


def test_single_process_is_a_noop_or_an_error(saved, as_rank):
    as_rank(0, world=1)
    real = _load(saved / "llama")
    assert mz.capture_full_state(real) is None
    mz.fill_sharded_from_rank0(real, None)  # nothing to do
    with torch.device("meta"):
        meta = tiny_model("llama")
    with pytest.raises(RuntimeError, match="meta device"):
        mz.capture_full_state(meta)


# ------------------------------------------------------------------------------------ 2 ranks
@pytest.mark.slow
def test_two_ranks_fill_from_rank0(tmp_path):
    started = time.perf_counter()
    torchrun(WORKER, str(tmp_path), str(tmp_path / "out.json"), nproc=2)
    elapsed = time.perf_counter() - started
    out = json.loads((tmp_path / "out.json").read_text())
    checks = out["checks"]
    failed = {name: per_rank for name, per_rank in checks.items() if not all(ok for ok, _ in per_rank.values())}
    assert not failed, json.dumps(failed, indent=1)
    expected = [
        f"{m}/{c}"
        for m in ("qwen2_tied", "llama", "llama-bf16", "qwen2_tied-bf16-offload")
        for c in ("meta_on_rank1_only", "tied_after_wrap", "weights_equal", "buffers/weights_equal", "logits_equal", "train_step",
                  "no_full_params_when_sharding")
    ] + ["qwen2_tied/lm_head_is_embedding", "broadcast/weights_equal", "noop/capture_is_none",
         "release/meta_inside_block", "release/error_propagates", "release/rank0_restored_on_error",
         "peft/lora_meta_on_rank1_only", "peft/weights_equal", "peft/base/weights_equal", "peft/logits_equal"] + [
        f"resize-{m}/{c}" for m in ("qwen2_tied", "llama")
        for c in ("meta_on_rank1_only", "weights_equal", "shape", "tied_after_wrap", "logits_equal")
    ] + ["trainer/meta_on_rank1_only", "trainer/losses_equal", "trainer/saved_equal", "stage_integrated"] + [
        f"fp32-weights-opt-offload/{c}" for c in ("sharded_in_bf16", "masters_exact", "train_step")]
    missing = [name for name in expected if set(checks.get(name, {})) != {"0", "1"}]
    assert not missing, missing
    print(f"2-rank materialize run: {elapsed:.1f}s; timings {out['timings']}")
