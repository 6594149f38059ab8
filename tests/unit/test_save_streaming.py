"""Saving a model one tensor at a time: the streaming safetensors writer, the files it makes against
``save_pretrained``'s own (MoE experts, remote code, shards), and the host memory a save takes.

References are made by transformers and safetensors themselves (``save_pretrained``, ``save_file``),
never by hf_zero's helpers.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hf_zero.checkpoint.export16 import save_16bit_model
from hf_zero.checkpoint.safetensors_stream import SafetensorsStreamWriter

REPO = Path(__file__).resolve().parents[2]


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 5, generator=g).bfloat16(),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "ids": torch.arange(7),
        "mask": torch.tensor([True, False]),
        "half": torch.randn(9, generator=g).half(),
        "f64": torch.randn(2, generator=g).double(),
    }


# ----------------------------------------------------------------------------------------------- writer
def test_stream_writer_reads_back_like_save_file(tmp_path):
    tensors = _tensors()
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    with SafetensorsStreamWriter(str(ours), {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()},
                                 metadata={"format": "pt"}) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
    save_file(tensors, str(theirs), metadata={"format": "pt"})
    a, b = load_file(str(ours)), load_file(str(theirs))
    assert a.keys() == b.keys() == tensors.keys()
    for name in tensors:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    with safe_open(str(ours), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    header_len = int.from_bytes(ours.read_bytes()[:8], "little")
    assert header_len % 8 == 0  # data 8-byte aligned, as save_file writes it


def test_stream_writer_refuses_what_it_did_not_announce(tmp_path):
    path = str(tmp_path / "x.safetensors")
    writer = SafetensorsStreamWriter(path, {"a": ((2,), torch.float32), "b": ((3,), torch.float32)})
    with pytest.raises(ValueError, match="wrote 'b', expected 'a'"):
        writer.write("b", torch.zeros(3))
    with pytest.raises(ValueError, match=r"'a' is \(3,\) torch.float32, announced as \(2,\)"):
        writer.write("a", torch.zeros(3))
    writer.write("a", torch.zeros(2))
    with pytest.raises(ValueError, match="closed after 1 of 2 tensors"):
        writer.close()
    with pytest.raises(ValueError, match="cannot store"):
        SafetensorsStreamWriter(path, {"c": ((1,), torch.complex64)})


# ----------------------------------------------------------------------------------------------- files
def _same_files(ours, theirs, *, ignore=("config.json",)):
    names = lambda d: sorted(n for n in os.listdir(d) if n not in ignore)  # noqa: E731
    assert names(ours) == names(theirs)
    index = "model.safetensors.index.json"
    if os.path.exists(os.path.join(theirs, index)):
        a = json.load(open(os.path.join(ours, index)))
        b = json.load(open(os.path.join(theirs, index)))
        assert a["weight_map"] == b["weight_map"]
        assert a["metadata"]["total_size"] == b["metadata"]["total_size"]
    for name in os.listdir(theirs):
        if name.endswith(".safetensors"):
            x, y = load_file(os.path.join(ours, name)), load_file(os.path.join(theirs, name))
            assert x.keys() == y.keys(), name
            for key in y:
                assert x[key].dtype == y[key].dtype and torch.equal(x[key], y[key]), key


def test_sharded_export_matches_save_pretrained(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=300))
    save_16bit_model(model, tmp_path / "ours", dtype=torch.float32, max_shard_size="100KB")
    model.save_pretrained(tmp_path / "theirs", max_shard_size="100KB")
    assert len([n for n in os.listdir(tmp_path / "theirs") if n.endswith(".safetensors")]) > 2
    _same_files(tmp_path / "ours", tmp_path / "theirs")


def test_moe_experts_are_written_in_the_checkpoint_layout(tmp_path):
    """transformers 5 fuses the experts on load; save_pretrained splits them again, and so do we."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen2MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, vocab_size=100)
    model = Qwen2MoeForCausalLM(config)
    import transformers

    fused = any(n.endswith("experts.gate_up_proj") for n in model.state_dict())
    # transformers 5 fuses the experts in memory; 4.x keeps them one module each, as stored.
    assert fused == (int(transformers.__version__.split(".")[0]) >= 5)
    for shard in ("5GB", "20KB"):
        ours, theirs = tmp_path / f"ours-{shard}", tmp_path / f"theirs-{shard}"
        save_16bit_model(model, ours, dtype=torch.float32, max_shard_size=shard)
        model.save_pretrained(theirs, max_shard_size=shard)
        keys = lambda d: {k for f in os.listdir(d) if f.endswith(".safetensors") for k in load_file(os.path.join(d, f))}  # noqa: E731
        assert keys(ours) == keys(theirs)
        assert "model.layers.0.mlp.experts.3.down_proj.weight" in keys(ours)
        if shard == "5GB":
            _same_files(ours, theirs)
        reloaded = AutoModelForCausalLM.from_pretrained(ours)
        for name, tensor in model.state_dict().items():
            assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_remote_code_model_files_are_copied(tmp_path, monkeypatch):
    """A trust_remote_code model (ChatGLM's kind): the folder carries its .py files and auto_map."""
    package = tmp_path / "remote_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "configuration_tinyremote.py").write_text(textwrap.dedent("""
        from transformers import PretrainedConfig

        class TinyRemoteConfig(PretrainedConfig):
            model_type = "tinyremote"

            def __init__(self, hidden=8, **kw):
                self.hidden = hidden
                super().__init__(**kw)
    """))
    (package / "modeling_tinyremote.py").write_text(textwrap.dedent("""
        import torch
        from transformers import PreTrainedModel
        from .configuration_tinyremote import TinyRemoteConfig

        class TinyRemoteModel(PreTrainedModel):
            config_class = TinyRemoteConfig

            def __init__(self, config):
                super().__init__(config)
                self.proj = torch.nn.Linear(config.hidden, config.hidden)
                self.post_init()

            def forward(self, x):
                return self.proj(x)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    from remote_pkg.configuration_tinyremote import TinyRemoteConfig
    from remote_pkg.modeling_tinyremote import TinyRemoteModel

    TinyRemoteConfig.register_for_auto_class()
    TinyRemoteModel.register_for_auto_class("AutoModel")
    model = TinyRemoteModel(TinyRemoteConfig())
    save_16bit_model(model, tmp_path / "ours", dtype=torch.float32)
    model.save_pretrained(tmp_path / "theirs")
    _same_files(tmp_path / "ours", tmp_path / "theirs", ignore=())
    ours = json.load(open(tmp_path / "ours" / "config.json"))
    assert ours["auto_map"] == json.load(open(tmp_path / "theirs" / "config.json"))["auto_map"]
    assert "modeling_tinyremote.py" in os.listdir(tmp_path / "ours")
    sys.modules.pop("remote_pkg", None)


# ----------------------------------------------------------------------------------------------- memory
@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to measure peak RSS")
@pytest.mark.parametrize("stage", [0, 3])
def test_save_holds_about_one_tensor_not_the_model(stage):
    """The writing rank's host memory grows by about the largest tensor, not by the model.

    Gathering the whole 16-bit state dict and handing it to save_pretrained (what the Trainer and
    DeepSpeed do) grows it by the model's size: measured in the same way, it shows the
    measurement sees a whole-model save. Each save runs in a fresh process (bench/save_memory.py).
    """
    sys.path.insert(0, str(REPO / "bench"))
    from save_memory import run_in_subprocess

    ours = run_in_subprocess("hf_zero", stage, hidden=256, layers=8, vocab=512)
    reference = run_in_subprocess("gather+save_pretrained", stage, hidden=256, layers=8, vocab=512)
    model, largest = ours["model_bytes_16bit"], ours["largest_tensor_bytes_16bit"]
    assert reference["peak_growth_bytes"] > 0.9 * model
    assert ours["peak_growth_bytes"] < 3 * largest + (1 << 20), ours
    assert ours["peak_growth_bytes"] < 0.2 * model, ours
