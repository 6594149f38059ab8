"""Offline consolidation, the ``hf-zero consolidate`` command, checkpoint errors and atomic exports,
in one process with no process group (checkpoints are written here with DCP's single-process mode).

The 2-rank tests (tests/distributed/test_checkpoint_distributed.py) consolidate real engine
checkpoints of stages 1 and 3; these cover the file handling around it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

from _models import tiny_model  # noqa: E402

from hf_zero.checkpoint import consolidate as consolidate_mod  # noqa: E402
from hf_zero.checkpoint import export16, pretrained_files  # noqa: E402
from hf_zero.checkpoint.consolidate import consolidate_checkpoint  # noqa: E402
from hf_zero.checkpoint.sharded import (  # noqa: E402
    MARKER_NAME,
    IncompleteCheckpointError,
    _marker,
    _write_marker,
    load_checkpoint,
    read_marker,
)
from hf_zero.cli import consolidate_cmd  # noqa: E402


def _write_checkpoint(directory: Path, model: torch.nn.Module, *, marker: bool = True) -> None:
    """What save_checkpoint writes for the model part, without an engine or process group."""
    import torch.distributed.checkpoint as dcp

    directory.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"module": model.state_dict()}, storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)
    model.config.save_pretrained(directory)
    (directory / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    (directory / "tokenizer.json").write_text("{}\n")
    (directory / "trainer_state.json").write_text("{}\n")  # training state: not part of a model folder
    if marker:
        engine = SimpleNamespace(
            config=SimpleNamespace(zero_optimization=SimpleNamespace(stage=3), compute_dtype_name="bf16"),
            global_steps=5, micro_steps=5, optimizer=None,
        )
        _write_marker(str(directory / MARKER_NAME), _marker(engine, model, None, has_extra=False))


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory):
    model = tiny_model("qwen2_tied", seed=3)
    path = tmp_path_factory.mktemp("ckpt") / "checkpoint"
    _write_checkpoint(path, model)
    return path, {k: v.clone() for k, v in model.state_dict().items()}


def _load(path):
    from transformers import AutoModelForCausalLM

    # dtype="auto": the dtype the files hold (transformers 5's default; 4.x loads fp32 without it)
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype="auto")


# ----------------------------------------------------------------------------------------------- consolidate
def test_fp32_output_is_exact_and_loads(tied_checkpoint, tmp_path):
    ckpt, expected = tied_checkpoint
    written = consolidate_checkpoint(ckpt, tmp_path / "out", progress=False)
    files = sorted(os.listdir(tmp_path / "out"))
    assert files == sorted(written)
    assert files == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    loaded = _load(tmp_path / "out")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    from safetensors import safe_open

    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())  # the tied copy is written once
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"


def test_bf16_output_in_several_shards(tied_checkpoint, tmp_path):
    ckpt, expected = tied_checkpoint
    consolidate_checkpoint(ckpt, tmp_path / "out", dtype="bf16", max_shard_size="60KB", progress=False)
    files = os.listdir(tmp_path / "out")
    shards = sorted(f for f in files if f.startswith("model-"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert set(index["weight_map"]) == set(expected) - {"lm_head.weight"}
    loaded = _load(tmp_path / "out")
    assert loaded.dtype == torch.bfloat16
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name].to(torch.bfloat16)), name


def test_trainer_checkpoint_folder_is_accepted(tmp_path):
    """checkpoint-N/ holds the sharded state in a subdirectory and the tokenizer beside it."""
    model = tiny_model("llama", seed=4)
    outer = tmp_path / "checkpoint-7"
    _write_checkpoint(outer / "zero_state", model)
    (outer / "special_tokens_map.json").write_text("{}\n")
    consolidate_checkpoint(outer, tmp_path / "out", dtype="fp16", progress=False)
    files = set(os.listdir(tmp_path / "out"))
    assert {"model.safetensors", "config.json", "special_tokens_map.json", "tokenizer.json"} <= files
    loaded = _load(tmp_path / "out")
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name].to(torch.float16)), name


def test_interrupted_consolidation_leaves_nothing(tied_checkpoint, tmp_path, monkeypatch):
    ckpt, _ = tied_checkpoint
    calls = []

    def failing(path, tensors):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("simulated disk full")
        return pretrained_files.write_safetensors(path, tensors)

    monkeypatch.setattr(consolidate_mod, "write_safetensors", failing)
    with pytest.raises(OSError, match="simulated disk full"):
        consolidate_checkpoint(ckpt, tmp_path / "out", max_shard_size="60KB", progress=False)
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------------------------- errors
def test_missing_and_incomplete_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        read_marker(tmp_path / "nope")
    incomplete = tmp_path / "ckpt"
    _write_checkpoint(incomplete, tiny_model("llama"), marker=False)
    with pytest.raises(IncompleteCheckpointError, match=f"{incomplete}.*{MARKER_NAME} is missing"):
        consolidate_checkpoint(incomplete, tmp_path / "out", progress=False)
    (incomplete / MARKER_NAME).write_text('{"format": "hf_zero.sharded", "form')  # cut off mid-write
    with pytest.raises(IncompleteCheckpointError, match="cannot be read"):
        read_marker(incomplete)
    assert not (tmp_path / "out").exists()


def test_load_checkpoint_errors_name_the_path(tmp_path):
    engine = SimpleNamespace(module=torch.nn.Linear(2, 2))
    with pytest.raises(FileNotFoundError, match=f"checkpoint directory {tmp_path / 'missing'} does not exist"):
        load_checkpoint(engine, tmp_path / "missing")
    (tmp_path / "half").mkdir()
    with pytest.raises(IncompleteCheckpointError, match=str(tmp_path / "half")):
        load_checkpoint(engine, tmp_path / "half")


# ----------------------------------------------------------------------------------------------- cli
def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="hf-zero")
    consolidate_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["consolidate", *argv])
    return args.func(args)


def test_cli(tied_checkpoint, tmp_path, capsys):
    ckpt, expected = tied_checkpoint
    assert _cli(str(ckpt), str(tmp_path / "out"), "--dtype", "bf16", "--no_progress") == 0
    assert "model.safetensors" in capsys.readouterr().out
    assert _load(tmp_path / "out").dtype == torch.bfloat16

    assert _cli(str(ckpt), str(tmp_path / "out")) == 2  # OUT not empty
    assert "exists and is not empty" in capsys.readouterr().err
    assert _cli(str(tmp_path / "missing"), str(tmp_path / "out2")) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "half").mkdir()
    assert _cli(str(tmp_path / "half"), str(tmp_path / "out3")) == 2
    err = capsys.readouterr().err
    assert "hf-zero consolidate: error:" in err and MARKER_NAME in err
    assert not (tmp_path / "out2").exists() and not (tmp_path / "out3").exists()


# ----------------------------------------------------------------------------------------------- export16
def test_export_is_atomic_and_replaces_a_previous_export(tmp_path, monkeypatch):
    """A failed export leaves the previous one complete; a new one replaces its shards."""
    model = tiny_model("llama", seed=5)
    out = tmp_path / "model"
    out.mkdir()
    (out / "training_args.bin").write_bytes(b"x")  # someone else's file in the folder: kept
    export16.save_16bit_model(model, out, dtype=torch.float32, max_shard_size="60KB")
    first = sorted(os.listdir(out))
    assert "model.safetensors.index.json" in first

    calls = []

    class Failing(export16.SafetensorsStreamWriter):  # the disk fills up while the 2nd file is written
        def write(self, name, tensor):
            calls.append(self.path)
            if len(set(calls)) == 2:
                raise OSError("simulated crash")
            super().write(name, tensor)

    monkeypatch.setattr(export16, "SafetensorsStreamWriter", Failing)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with pytest.raises(OSError, match="simulated crash"):
        export16.save_16bit_model(model, out, dtype=torch.bfloat16, max_shard_size="60KB")
    assert sorted(os.listdir(out)) == first
    assert [n for n in os.listdir(tmp_path) if n != "model"] == []  # no temporary directory left
    monkeypatch.undo()

    export16.save_16bit_model(model, out, dtype=torch.bfloat16)  # one file now: old shards go
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors", "training_args.bin"]
    loaded = _load(out)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name].to(torch.bfloat16)), name


def test_gather_without_process_group_keeps_tied_keys_shared():
    model = tiny_model("qwen2_tied")
    full = export16.gather_full_state_dict(model, dtype="bf16")
    assert full["lm_head.weight"] is full["model.embed_tokens.weight"]
    assert full["lm_head.weight"].dtype == torch.bfloat16
    full32 = export16.gather_full_state_dict(model)
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    assert not torch.equal(full32["model.norm.weight"], model.model.norm.weight)  # a copy, not a view
    assert export16.tied_groups(model) == [["model.embed_tokens.weight", "lm_head.weight"]]
