"""Read a checkpoint's pickled files without running code from them.

torch.distributed.checkpoint (DCP) reads ``.metadata`` with ``pickle.load``, and its
``DefaultLoadPlanner`` reads every non-tensor entry of a ``.distcp`` file (param groups, lr
scheduler state, loss scaler, counters) with ``torch.load(weights_only=False)``. Either runs
whatever code a crafted checkpoint holds. hf_zero reads every checkpoint through this module:

* ``.metadata``: :class:`MetadataUnpickler` admits only the classes DCP metadata is made of
  (:data:`ADMITTED_METADATA_GLOBALS`), builds only their instances, and the result must have the
  structure DCP writes (every data file a ``.distcp`` name inside the directory, no stream
  transforms: hf_zero writes none).
* ``.distcp`` entries: tensors (DCP's own reader) and non-tensor values (:class:`SafeLoadPlanner`)
  with ``torch.load(weights_only=True)``. hf_zero's non-tensor entries are ints, floats, bools,
  strings, ``None``, lists and tuples, which need no admitted global at all.
* ``torch.save`` files (the RNG states): :func:`load_torch_file`, ``weights_only=True``.

A file that fails any of these is refused with a ``CheckpointError`` naming it, before anything
from it is used.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pathlib
import pickle
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
    _MEM_FORMAT_ENCODING,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from hf_zero.checkpoint.errors import CheckpointError, IncompleteCheckpointError, refused_file

__all__ = [
    "ADMITTED_METADATA_GLOBALS",
    "MetadataUnpickler",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "read_metadata",
    "load_state_dict",
    "load_torch_file",
]

METADATA_NAME = ".metadata"

# The classes DCP metadata instances are made of; the unpickler builds (BUILD) only these.
_METADATA_CLASSES: dict[str, type] = {
    "torch.distributed.checkpoint.metadata.Metadata": Metadata,
    "torch.distributed.checkpoint.metadata.MetadataIndex": MetadataIndex,
    "torch.distributed.checkpoint.metadata.StorageMeta": StorageMeta,
    "torch.distributed.checkpoint.metadata.TensorStorageMetadata": TensorStorageMetadata,
    "torch.distributed.checkpoint.metadata.BytesStorageMetadata": BytesStorageMetadata,
    "torch.distributed.checkpoint.metadata.ChunkStorageMetadata": ChunkStorageMetadata,
    "torch.distributed.checkpoint.metadata.TensorProperties": TensorProperties,
    "torch.distributed.checkpoint.filesystem._StorageInfo": _StorageInfo,
}

ADMITTED_METADATA_GLOBALS: Mapping[str, Any] = {
    **_METADATA_CLASSES,
    # TensorProperties pickles its memory format as this enum (called with its value).
    "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING": _MEM_FORMAT_ENCODING,
    # Tensor sizes and chunk offsets (called with a tuple of ints).
    "torch.Size": torch.Size,
    # How torch pickles a layout (torch.strided): a lookup of torch's layouts by name.
    "torch.serialization._get_layout": torch.serialization._get_layout,
    # StorageMeta.checkpoint_id: the directory DCP saved to. Python 3.13 pickles the class from
    # the module that defines it there; either name gives this Python's class.
    "pathlib.PosixPath": pathlib.PosixPath,
    "pathlib._local.PosixPath": pathlib.PosixPath,
    # TensorProperties.dtype: every torch dtype, by its own name (values, nothing callable).
    **{str(value): value for value in vars(torch).values() if isinstance(value, torch.dtype)},
}


# ----------------------------------------------------------------------------------------------- metadata
class MetadataUnpickler(pickle._Unpickler):
    """Unpickle DCP metadata, admitting only :data:`ADMITTED_METADATA_GLOBALS`.

    The pure-Python unpickler, because its opcodes can be restricted: ``BUILD`` (which sets an
    object's state) must act on an instance of one of the metadata classes. The C unpickler would
    also let a pickle set attributes on an admitted *class* (``GLOBAL Metadata; BUILD``), changing
    it for the rest of the process.
    """

    def find_class(self, module: str, name: str) -> Any:
        # Exact names only: a dotted name ("Metadata.__init__") would reach through an admitted
        # object to anything it references.
        qualified = f"{module}.{name}"
        if qualified not in ADMITTED_METADATA_GLOBALS:
            raise pickle.UnpicklingError(f"it asks for {qualified}, which DCP metadata never holds")
        return ADMITTED_METADATA_GLOBALS[qualified]

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it holds a persistent id, which DCP metadata never does")

    def _load_build(self) -> None:
        target = self.stack[-2]  # the object under its state (BUILD pops the state, then sets it)
        if type(target) not in _METADATA_CLASSES.values():
            raise pickle.UnpicklingError(f"it sets the state of {target!r}, which DCP metadata never does")
        pickle._Unpickler.load_build(self)

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.BUILD[0]] = _load_build


def read_metadata(checkpoint_dir: str | os.PathLike) -> Metadata:
    """The DCP metadata of ``checkpoint_dir``, read with :class:`MetadataUnpickler` and checked.

    Raises:
        CheckpointError: the file holds anything but DCP metadata of the form hf_zero writes
            (nothing in it has run).
        IncompleteCheckpointError: there is no metadata file.
        OSError: it cannot be read.
    """
    path = os.path.join(os.fspath(checkpoint_dir), METADATA_NAME)
    if not os.path.isfile(path):
        raise IncompleteCheckpointError(f"{path} is missing: the checkpoint is incomplete; resume from another one")
    with open(path, "rb") as f:
        try:
            metadata = MetadataUnpickler(f).load()
        except pickle.UnpicklingError as exc:
            raise refused_file(path, str(exc)) from exc
        except Exception as exc:  # truncated or garbled: EOFError, ValueError, TypeError, ...
            raise refused_file(path, f"it cannot be unpickled as DCP metadata: {type(exc).__name__}: {exc}") from exc
    problem = _metadata_problem(metadata)
    if problem is not None:
        raise refused_file(path, problem)
    return metadata


def _metadata_problem(metadata: Any) -> str | None:
    """What about ``metadata`` DCP's own save would never write, or None."""
    if not isinstance(metadata, Metadata):
        return f"it holds a {type(metadata).__name__}, not DCP metadata"
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        return "its entry tables are not dicts"
    for fqn, entry in metadata.state_dict_metadata.items():
        if not isinstance(fqn, str) or not isinstance(entry, (TensorStorageMetadata, BytesStorageMetadata)):
            return f"entry {fqn!r} is a {type(entry).__name__}"
        if isinstance(entry, TensorStorageMetadata) and not (
            isinstance(entry.properties, TensorProperties)
            and isinstance(entry.properties.dtype, torch.dtype)
            and isinstance(entry.size, torch.Size)
            and isinstance(entry.chunks, list)
            and all(isinstance(c, ChunkStorageMetadata) for c in entry.chunks)
        ):
            return f"tensor entry {fqn!r} is malformed"
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            return f"storage entry {index!r} is malformed"
        name = info.relative_path
        # Data files are DCP's "__<rank>_<i>.distcp" in the checkpoint directory itself: a path
        # elsewhere would read a file the checkpoint does not own.
        if not isinstance(name, str) or name != os.path.basename(name) or "\\" in name or not name.endswith(".distcp"):
            return f"entry {index.fqn!r} points at {name!r}, outside the checkpoint directory"
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (info.offset, info.length)):
            return f"entry {index.fqn!r} has offset {info.offset!r} and length {info.length!r}"
        if getattr(info, "transform_descriptors", None):
            # Stream transforms (compression) are decoded by registered extensions; hf_zero writes none.
            return f"entry {index.fqn!r} asks for stream transforms {info.transform_descriptors!r}"
    return None


# ----------------------------------------------------------------------------------------------- data
class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor entries with ``torch.load(weights_only=True)``
    (DCP's reads them with ``weights_only=False``, which runs any pickled code)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Unpickle one non-tensor entry with ``weights_only=True`` and put it in the state dict."""
        from torch.distributed.checkpoint._traverse import set_element

        # Explicit weights_only=True also wins over TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD.
        obj = torch.load(value, weights_only=True)
        # Where DefaultLoadPlanner.load_bytes puts it.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that runs nothing from the checkpoint.

    The metadata comes from :func:`read_metadata` (read once, then reused, so a caller can read it
    first and get a refusal outside DCP's collectives). Data is read file by file, and any
    failure to unpickle an entry of a file raises a ``CheckpointError`` naming that file. It only
    works with :class:`SafeLoadPlanner`, which reads the non-tensor entries safely.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self._metadata: Metadata | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Forget the metadata when the reader is pointed at another checkpoint."""
        super().reset(checkpoint_id)
        if checkpoint_id:
            self._metadata = None

    # No ``**kwargs``: DCP then never falls back to per-rank ``__<rank>.metadata`` files, which
    # hf_zero does not write, when the global metadata is refused.
    def read_metadata(self) -> Metadata:  # type: ignore[override]
        """The checked metadata of this checkpoint (see :func:`read_metadata`)."""
        if self._metadata is None:
            metadata = read_metadata(self.path)
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id  # as FileSystemReader does
            self._metadata = metadata
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the plan's entries one ``.distcp`` file at a time, refusing a file that holds
        anything ``weights_only`` does not admit."""
        if not isinstance(planner, SafeLoadPlanner):
            # Another planner's load_bytes may unpickle without restriction.
            raise TypeError(f"SafeFileSystemReader reads only with a SafeLoadPlanner, not {type(planner).__name__}")
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except (OSError, MemoryError):  # the disk or the host, not the file's content
                raise
            except Exception as exc:  # UnpicklingError from weights_only, a garbled zip, a size mismatch
                raise refused_file(os.path.join(self.path, name), _reason(exc)) from exc
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _reason(exc: BaseException) -> str:
    """The useful line of an error: torch's weights_only message is a page of advice around it."""
    text = str(exc)
    found = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\.\s|\n|$)", text)
    if found:
        return f"torch.load(weights_only=True) refuses its pickle: {found.group(1).strip()}"
    return f"{type(exc).__name__}: {text.strip().splitlines()[0] if text.strip() else ''}"[:300]


def load_state_dict(state_dict: dict[str, Any], reader: SafeFileSystemReader, *, no_dist: bool = False) -> None:
    """``dcp.load(state_dict)`` from ``reader``'s checkpoint, in place, running nothing from it.

    Every rank of the group must call it (unless ``no_dist``). A refused file raises the same
    ``CheckpointError`` on every rank (DCP gathers the failures of all ranks).

    Raises:
        CheckpointError: a file of the checkpoint is refused (it names the file).
        torch.distributed.checkpoint.api.CheckpointException: any other failure, as DCP raises it.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as exc:
        refused = [failure[0] for _, failure in sorted(exc.failures.items()) if isinstance(failure[0], CheckpointError)]
        if refused:
            raise refused[0] from exc
        raise


# ----------------------------------------------------------------------------------------------- torch.save files
def load_torch_file(path: str | os.PathLike) -> Any:
    """A ``torch.save`` file read with ``torch.load(weights_only=True)``.

    Raises:
        CheckpointError: it holds anything ``weights_only`` does not admit, or is not a torch.save
            file (nothing in it has run).
        OSError: it cannot be read.
    """
    try:
        return torch.load(path, weights_only=True)
    except (OSError, MemoryError):
        raise
    except Exception as exc:
        raise refused_file(path, _reason(exc)) from exc
