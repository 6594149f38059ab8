"""Crafted checkpoint files: pickles that would run code when loaded, for the safety tests.

Each payload's ``__reduce__`` writes a sentinel file when unpickled, so a test proves that nothing
ran by checking that the sentinel does not exist.
"""

from __future__ import annotations

import builtins
import io
import os
import pickle
from pathlib import Path

import torch


class ExecOnUnpickle:
    """Unpickling this runs ``open(sentinel, "w").write(...)``: the proof that code ran."""

    def __init__(self, sentinel: str | os.PathLike):
        self.sentinel = os.fspath(sentinel)

    def __reduce__(self):
        return (builtins.exec, (f"open({self.sentinel!r}, 'w').write('code from the checkpoint ran')",))


def exec_pickle(sentinel: str | os.PathLike) -> bytes:
    """A bare pickle that runs code (what a crafted ``.metadata`` holds)."""
    return pickle.dumps(ExecOnUnpickle(sentinel))


def exec_torch_file(sentinel: str | os.PathLike) -> bytes:
    """A well-formed ``torch.save`` file whose pickle runs code (what DCP stores per entry, and
    what an RNG file is)."""
    buffer = io.BytesIO()
    torch.save(ExecOnUnpickle(sentinel), buffer)
    return buffer.getvalue()


def replace_entry(state_dir: str | os.PathLike, fqn: str, payload: bytes) -> Path:
    """Point the DCP entry ``fqn`` at ``payload`` appended to its ``.distcp`` file.

    The metadata stays a legitimate one (only the entry's offset and length change), so the
    crafted entry is what a reader meets. Returns the ``.distcp`` path.
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    state_dir = Path(state_dir)
    with open(state_dir / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the test's own file, before tampering
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    info = metadata.storage_data[index]
    data_file = state_dir / info.relative_path
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(payload)
    metadata.storage_data[index] = _StorageInfo(info.relative_path, offset, len(payload))
    with open(state_dir / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return data_file
