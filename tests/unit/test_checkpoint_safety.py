"""Loading a checkpoint never runs code from it.

Each file hf_zero reads from a checkpoint is replaced by a crafted pickle whose ``__reduce__``
would write a sentinel file, and both readers run on it: ``consolidate_checkpoint`` and resume
(``load_checkpoint`` on an engine, ``ZeroTrainer.train(resume_from_checkpoint=...)``). Each must
either not read the file at all or refuse it with a ``CheckpointError`` naming it, and the sentinel
must never appear. The checkpoints are real ones (an engine of world size 1 in this process).
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

from _cases import Case  # noqa: E402
from _crafted import exec_pickle, exec_torch_file, replace_entry  # noqa: E402
from _models import tiny_model  # noqa: E402

import hf_zero  # noqa: E402
from hf_zero.checkpoint.consolidate import consolidate_checkpoint  # noqa: E402
from hf_zero.checkpoint.sharded import CheckpointError, load_checkpoint, load_rng_state, save_checkpoint  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "assets" / "tiny-qwen2"
REFUSED = "not a checkpoint file hf_zero wrote"


# ----------------------------------------------------------------------------------------------- crafted files
def _tamper(state_dir: Path, kind: str, sentinel: Path) -> Path:
    """Replace the file of ``kind`` in a sharded-state directory; returns the tampered file."""
    if kind == "metadata":
        path = state_dir / ".metadata"
        path.write_bytes(exec_pickle(sentinel))
        return path
    if kind == "bytes_entry":  # a non-tensor entry (lr scheduler state), read on resume only
        return replace_entry(state_dir, "lr_scheduler.last_batch_iteration", exec_torch_file(sentinel))
    if kind == "tensor_entry":  # a model weight, read by both
        return replace_entry(state_dir, "module.model.norm.weight", exec_torch_file(sentinel))
    if kind == "rng":
        path = state_dir / "hf_zero_rng_0.pth"
        path.write_bytes(exec_torch_file(sentinel))
        return path
    raise ValueError(kind)


def _refusal(path: Path) -> str:
    return re.escape(str(path)) + ".*" + re.escape(REFUSED) + ".*refusing to load it"


# ----------------------------------------------------------------------------------------------- engines
def _engine(stage: int = 2, dtype: str = "fp32", lora: bool = False, seed: int = 0):
    model = tiny_model("llama", seed=seed)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    return hf_zero.initialize(model, Case(stage=stage, dtype=dtype, gas=1, model="llama", steps=6).zero_config())


def _train(engine, steps: int = 2) -> None:
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        ids = torch.randint(0, 128, (2, 16), generator=g)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    """A stage-2 checkpoint with optimizer, lr scheduler, loss scaler, counters and RNG states."""
    engine = _engine(stage=2)
    _train(engine)
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    save_checkpoint(engine, path)
    return path


@pytest.fixture
def checkpoint(saved_checkpoint, tmp_path):
    """A copy of the saved checkpoint this test may tamper with."""
    copy = tmp_path / "ckpt"
    shutil.copytree(saved_checkpoint, copy)
    return copy


# ----------------------------------------------------------------------------------------------- engine paths
@pytest.mark.parametrize("kind", ["metadata", "bytes_entry", "tensor_entry", "rng"])
def test_resume_refuses_a_crafted_file(checkpoint, tmp_path, kind):
    sentinel = tmp_path / "ran"
    tampered = _tamper(checkpoint, kind, sentinel)
    engine = _engine(stage=2)
    with pytest.raises(CheckpointError, match=re.compile(_refusal(tampered), re.S)):
        load_checkpoint(engine, checkpoint)
    assert not sentinel.exists()


@pytest.mark.parametrize("kind", ["metadata", "tensor_entry"])
def test_consolidate_refuses_a_crafted_file(checkpoint, tmp_path, kind):
    sentinel = tmp_path / "ran"
    tampered = _tamper(checkpoint, kind, sentinel)
    with pytest.raises(CheckpointError, match=re.compile(_refusal(tampered), re.S)):
        consolidate_checkpoint(checkpoint, tmp_path / "out", progress=False)
    assert not sentinel.exists()
    assert not (tmp_path / "out").exists()


def test_consolidate_command_reports_the_refused_file(checkpoint, tmp_path, capsys):
    """``hf-zero consolidate`` exits 2 with one error line naming the file."""
    import argparse

    from hf_zero.cli import consolidate_cmd

    sentinel = tmp_path / "ran"
    tampered = _tamper(checkpoint, "metadata", sentinel)
    args = argparse.Namespace(checkpoint=str(checkpoint), output_dir=str(tmp_path / "out"), dtype="fp32",
                              max_shard_size="5GB", no_progress=True)
    assert consolidate_cmd.run(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-zero consolidate: error:") and re.search(_refusal(tampered), err)
    assert not sentinel.exists()


@pytest.mark.parametrize("kind", ["bytes_entry", "rng"])
def test_consolidate_never_reads_training_state(checkpoint, tmp_path, kind):
    """Consolidation reads the model tensors only: a crafted optimizer/scheduler entry or RNG file
    is not even opened, and the weights come out."""
    sentinel = tmp_path / "ran"
    _tamper(checkpoint, kind, sentinel)
    written = consolidate_checkpoint(checkpoint, tmp_path / "out", progress=False)
    assert "model.safetensors" in written
    assert not sentinel.exists()


def test_load_rng_state_refuses_a_crafted_file(checkpoint, tmp_path):
    sentinel = tmp_path / "ran"
    tampered = _tamper(checkpoint, "rng", sentinel)
    with pytest.raises(CheckpointError, match=re.compile(_refusal(tampered), re.S)):
        load_rng_state(checkpoint)
    tampered.write_bytes(exec_pickle(sentinel))  # a bare pickle, not a torch.save file
    with pytest.raises(CheckpointError, match=re.compile(_refusal(tampered), re.S)):
        load_rng_state(checkpoint)
    assert not sentinel.exists()


def test_metadata_with_a_bare_path_escape_is_refused(checkpoint, tmp_path):
    """Metadata built only from admitted classes but pointing outside the directory is refused."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    with open(checkpoint / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    index = next(iter(metadata.storage_data))
    info = metadata.storage_data[index]
    metadata.storage_data[index] = _StorageInfo("../" + info.relative_path, info.offset, info.length)
    with open(checkpoint / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(CheckpointError, match=re.compile(_refusal(checkpoint / ".metadata"), re.S)):
        consolidate_checkpoint(checkpoint, tmp_path / "out", progress=False)


# ----------------------------------------------------------------------------------------------- the unpickler
def test_admitted_globals_are_exactly_the_metadata_classes():
    """The allowlist is the DCP metadata classes, torch.Size, the layout lookup, PosixPath and the
    dtypes (values, nothing callable): no module-wide admission such as ``torch.*``."""
    from hf_zero.checkpoint.safe_load import ADMITTED_METADATA_GLOBALS

    metadata = "torch.distributed.checkpoint.metadata."
    expected = {
        metadata + name
        for name in ("Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
                     "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")
    } | {
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        "torch.Size",
        "torch.serialization._get_layout",
        "pathlib.PosixPath",
        "pathlib._local.PosixPath",
    }
    dtypes = {name for name, value in ADMITTED_METADATA_GLOBALS.items() if isinstance(value, torch.dtype)}
    assert {"torch.float32", "torch.bfloat16", "torch.float16", "torch.int64", "torch.bool"} <= dtypes
    assert set(ADMITTED_METADATA_GLOBALS) == expected | dtypes
    assert all(ADMITTED_METADATA_GLOBALS[name] is getattr(torch, name.removeprefix("torch.")) for name in dtypes)


@pytest.mark.parametrize(
    "payload",
    [
        pickle.dumps(os.system),
        pickle.dumps(getattr),
        pickle.dumps(torch.load),
        # An admitted class, then BUILD on the class itself: would overwrite its attributes.
        b"\x80\x04ctorch.distributed.checkpoint.metadata\nMetadata\nN}\x8c\x08__init__K\x01s\x86b.",
        # A dotted name reaching through an admitted module.
        b"\x80\x04ctorch.distributed.checkpoint.metadata\nMetadata.__init__\n.",
    ],
    ids=["os.system", "getattr", "torch.load", "build-on-class", "dotted-name"],
)
def test_unpickler_refuses_anything_else(tmp_path, payload):
    from hf_zero.checkpoint.safe_load import read_metadata

    (tmp_path / ".metadata").write_bytes(payload)
    with pytest.raises(CheckpointError, match=re.compile(_refusal(tmp_path / ".metadata"), re.S)):
        read_metadata(tmp_path)
    from torch.distributed.checkpoint.metadata import Metadata

    assert "__init__" not in vars(Metadata) or callable(Metadata.__init__)


# ----------------------------------------------------------------------------------------------- still loads
@pytest.mark.parametrize(
    "stage,dtype,lora",
    [(0, "fp32", False), (1, "fp32", False), (2, "fp32", False), (3, "fp32", False), (2, "fp16", False), (3, "fp32", True)],
    ids=["stage0", "stage1", "stage2", "stage3", "stage2-fp16", "stage3-lora"],
)
def test_real_checkpoints_load_through_the_safe_reader(tmp_path, monkeypatch, stage, dtype, lora):
    """Model, optimizer, scheduler, loss scaler and counters come back; DCP's own unrestricted
    reads (pickle.load of the metadata, torch.load(weights_only=False) of entries) are never used."""
    import torch.distributed.checkpoint.default_planner as dcp_planner
    import torch.distributed.checkpoint.filesystem as dcp_fs

    engine = _engine(stage=stage, dtype=dtype, lora=lora)
    _train(engine)
    save_checkpoint(engine, tmp_path / "ckpt")
    expected = {k: v.clone() for k, v in engine.state_dict()["module"].items()}

    def unsafe(*args, **kwargs):
        raise AssertionError("an unrestricted unpickler was used")

    monkeypatch.setattr(dcp_fs.pickle, "load", unsafe)
    monkeypatch.setattr(dcp_planner.DefaultLoadPlanner, "load_bytes", unsafe)
    fresh = _engine(stage=stage, dtype=dtype, lora=lora, seed=1)
    load_checkpoint(fresh, tmp_path / "ckpt")
    assert fresh.global_steps == engine.global_steps == 2
    assert fresh.get_lr() == engine.get_lr()
    assert fresh.loss_scale == engine.loss_scale
    loaded = fresh.state_dict()
    for name, tensor in expected.items():
        torch.testing.assert_close(loaded["module"][name], tensor, rtol=0, atol=0, msg=name)
    saved_opt, loaded_opt = engine.state_dict()["optimizer"], loaded["optimizer"]
    for name, values in saved_opt["state"].items():
        for key, value in values.items():
            torch.testing.assert_close(loaded_opt["state"][name][key], value, rtol=0, atol=0, msg=f"{name}.{key}")
    consolidate_checkpoint(tmp_path / "ckpt", tmp_path / "out", progress=False)
    assert os.listdir(tmp_path / "out")
    monkeypatch.undo()
    _train(fresh, 1)  # and training goes on


# ----------------------------------------------------------------------------------------------- Trainer
def _trainer(output_dir: Path, max_steps: int):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from hf_zero import ZeroTrainer, ZeroTrainingArguments

    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, 500, (16, 16), generator=g)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = ZeroTrainingArguments(
        output_dir=str(output_dir), zero_config={"zero_optimization": {"stage": 2}}, per_device_train_batch_size=4,
        max_steps=max_steps, logging_steps=1, report_to="none", save_strategy="steps", save_steps=2,
        learning_rate=5e-3, seed=3,
    )
    return ZeroTrainer(model=AutoModelForCausalLM.from_pretrained(TINY), args=args, train_dataset=data)


@pytest.fixture(scope="module")
def trainer_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer") / "out"
    _trainer(out, max_steps=2).train()
    assert (out / "checkpoint-2" / "training_args.bin").exists()
    return out / "checkpoint-2"


@pytest.mark.parametrize("kind", ["metadata", "bytes_entry", "rng"])
def test_trainer_resume_refuses_a_crafted_file(trainer_checkpoint, tmp_path, kind):
    ckpt = tmp_path / "out" / "checkpoint-2"
    shutil.copytree(trainer_checkpoint, ckpt)
    sentinel = tmp_path / "ran"
    if kind == "bytes_entry":
        # The Trainer's LambdaLR state (``last_epoch``), not hf_zero's scheduler.
        tampered = replace_entry(ckpt / "zero_state", "lr_scheduler.last_epoch", exec_torch_file(sentinel))
    else:
        tampered = _tamper(ckpt / "zero_state", kind, sentinel)
    trainer = _trainer(tmp_path / "out", max_steps=4)
    with pytest.raises(CheckpointError, match=re.compile(_refusal(tampered), re.S)):
        trainer.train(resume_from_checkpoint=str(ckpt))
    assert not sentinel.exists()


def test_trainer_resume_never_unpickles_trainer_files(trainer_checkpoint, tmp_path):
    """``training_args.bin`` (and the plain Trainer's optimizer/scheduler/scaler/RNG files, were
    someone to add them) are not read by a ZeroTrainer resume: crafted ones run nothing and the
    resume succeeds."""
    ckpt = tmp_path / "out" / "checkpoint-2"
    shutil.copytree(trainer_checkpoint, ckpt)
    sentinel = tmp_path / "ran"
    for name in ("training_args.bin", "optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state.pth"):
        (ckpt / name).write_bytes(exec_torch_file(sentinel))
    trainer = _trainer(tmp_path / "out", max_steps=4)
    trainer.train(resume_from_checkpoint=str(ckpt))
    assert trainer.state.global_step == 4
    assert not sentinel.exists()
