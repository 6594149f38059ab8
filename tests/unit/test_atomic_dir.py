"""Replacing a checkpoint directory never leaves its path without a complete checkpoint."""

from __future__ import annotations

import os

import pytest

from hf_zero.checkpoint import atomic_dir
from hf_zero.checkpoint.atomic_dir import recover_replaced, replace_directory


def _make(path, content):
    path.mkdir()
    (path / "f.txt").write_text(content)


class Killed(BaseException):
    """Stands for the process dying: no except clause of the code under test catches it."""


@pytest.mark.parametrize("swap", [True, False], ids=["exchange", "move-aside"])
def test_replace_puts_the_new_directory_in_place(tmp_path, monkeypatch, swap):
    if not swap:
        monkeypatch.setattr(atomic_dir, "_exchange", lambda a, b: False)
    _make(tmp_path / "ckpt", "old")
    _make(tmp_path / "ckpt.incomplete", "new")
    replace_directory(str(tmp_path / "ckpt.incomplete"), str(tmp_path / "ckpt"))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert (tmp_path / "ckpt" / "f.txt").read_text() == "new"
    _make(tmp_path / "fresh.incomplete", "x")  # no directory there yet: a plain rename
    replace_directory(str(tmp_path / "fresh.incomplete"), str(tmp_path / "fresh"))
    assert (tmp_path / "fresh" / "f.txt").read_text() == "x"


def test_exchange_is_used_where_the_filesystem_has_it(tmp_path):
    _make(tmp_path / "a", "a")
    _make(tmp_path / "b", "b")
    if not atomic_dir._exchange(str(tmp_path / "a"), str(tmp_path / "b")):
        pytest.skip("this filesystem has no renameat2(RENAME_EXCHANGE)")
    assert (tmp_path / "a" / "f.txt").read_text() == "b" and (tmp_path / "b" / "f.txt").read_text() == "a"


def test_a_kill_between_the_renames_is_recovered(tmp_path, monkeypatch):
    """Without an atomic swap: killed after the old one moved aside, before the new one is in."""
    monkeypatch.setattr(atomic_dir, "_exchange", lambda a, b: False)
    _make(tmp_path / "ckpt", "old")
    _make(tmp_path / "ckpt.incomplete", "new")
    real_replace = os.replace
    calls = []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise Killed
        real_replace(src, dst)

    monkeypatch.setattr(atomic_dir.os, "replace", replace)
    with pytest.raises(Killed):
        replace_directory(str(tmp_path / "ckpt.incomplete"), str(tmp_path / "ckpt"))
    monkeypatch.setattr(atomic_dir.os, "replace", real_replace)
    assert not (tmp_path / "ckpt").exists()
    [aside] = [n for n in os.listdir(tmp_path) if n.startswith("ckpt.old-")]
    assert recover_replaced(str(tmp_path)) == [str(tmp_path / "ckpt")]
    assert (tmp_path / "ckpt" / "f.txt").read_text() == "old"
    assert not (tmp_path / aside).exists()


def test_recover_removes_an_aside_whose_replacement_arrived(tmp_path):
    _make(tmp_path / "ckpt", "new")
    _make(tmp_path / "ckpt.old-0123456789ab", "old")
    _make(tmp_path / "ckpt.old-notmine", "kept")  # not our name pattern: left alone
    assert recover_replaced(str(tmp_path)) == []
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ckpt.old-notmine"]
    assert (tmp_path / "ckpt" / "f.txt").read_text() == "new"


def test_sharded_save_over_an_existing_checkpoint_keeps_other_files(tmp_path, monkeypatch):
    """save_checkpoint to a directory that exists (same step again, the Trainer's files in it):
    the other files stay, and a kill mid-swap leaves the previous checkpoint recoverable."""
    import torch

    import hf_zero
    from hf_zero.checkpoint.sharded import load_checkpoint, read_marker, save_checkpoint

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    engine = hf_zero.initialize(model=model, config={"zero_optimization": {"stage": 0}, "train_micro_batch_size_per_gpu": 1,
                                                     "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    ckpt = tmp_path / "ckpt"
    save_checkpoint(engine, ckpt)
    (ckpt / "notes.txt").write_text("the user's")
    (ckpt / "sub").mkdir()
    (ckpt / "sub" / "x.json").write_text("{}")
    first_steps = read_marker(ckpt)["global_steps"]
    engine(torch.ones(1, 4)).sum().backward()
    engine.step()
    save_checkpoint(engine, ckpt)
    assert (ckpt / "notes.txt").read_text() == "the user's" and (ckpt / "sub" / "x.json").exists()
    assert read_marker(ckpt)["global_steps"] == first_steps + 1
    assert not [n for n in os.listdir(tmp_path) if n != "ckpt"]

    monkeypatch.setattr(atomic_dir, "_exchange", lambda a, b: False)
    real_replace = os.replace

    def replace(src, dst):
        if os.fspath(dst) == str(ckpt):  # the old one is aside, the new one about to move in
            raise Killed
        real_replace(src, dst)

    monkeypatch.setattr(atomic_dir.os, "replace", replace)
    engine(torch.ones(1, 4)).sum().backward()
    engine.step()
    with pytest.raises(Killed):
        save_checkpoint(engine, ckpt)
    monkeypatch.setattr(atomic_dir.os, "replace", real_replace)
    assert not ckpt.exists()
    assert recover_replaced(str(tmp_path)) == [str(ckpt)]
    assert read_marker(ckpt)["global_steps"] == first_steps + 1  # the previous one, complete
    load_checkpoint(engine, ckpt)
    engine.close()
