"""Write a safetensors file one tensor at a time, so the writer never holds more than one tensor.

``safetensors.torch.save_file`` takes the whole dict and serialises it in memory (about twice the
file size at its peak); safetensors has no incremental writer. The format makes one easy: an
8-byte little-endian header length, a JSON header with every tensor's dtype, shape and byte range,
then the raw bytes. The header only needs shapes and dtypes, which are known before any tensor is
gathered, so it is written first and each tensor's bytes are appended as it arrives.

The files load with ``safetensors.safe_open`` / ``load_file`` and ``from_pretrained`` like those
``save_file`` writes (same header fields, header padded to 8 bytes, ``__metadata__`` kept).

Example::

    with SafetensorsStreamWriter(path, {"w": ((4, 4), torch.bfloat16)}, metadata={"format": "pt"}) as w:
        w.write("w", gathered_tensor)
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any

import torch

__all__ = ["SafetensorsStreamWriter", "SAFETENSORS_DTYPES"]

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        SAFETENSORS_DTYPES[getattr(torch, _name)] = _code


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


class SafetensorsStreamWriter:
    """A safetensors file whose tensors are announced up front and written one by one, in order.

    Args:
        path: the file to write (created or truncated).
        entries: ``{name: (shape, dtype)}`` in the order the tensors will be written.
        metadata: the ``__metadata__`` strings (transformers writes ``{"format": "pt"}``).

    Raises:
        ValueError: a dtype safetensors has no code for, a tensor written out of order or with
            another shape/dtype than announced, or :meth:`close` before every tensor was written.
    """

    def __init__(self, path: str, entries: dict[str, tuple[tuple[int, ...], torch.dtype]], *, metadata: dict[str, str] | None = None):
        self.path = path
        self._order = list(entries)
        self._entries = {name: (tuple(int(d) for d in shape), dtype) for name, (shape, dtype) in entries.items()}
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        for name in self._order:
            shape, dtype = self._entries[name]
            if dtype not in SAFETENSORS_DTYPES:
                raise ValueError(f"{path}: tensor {name!r} has dtype {dtype}, which safetensors cannot store")
            end = offset + _nbytes(shape, dtype)
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
            offset = end
        encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as save_file pads it
        self._next = 0
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(encoded)))
        self._file.write(encoded)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor``'s bytes; it must be the next announced one, with its shape and dtype."""
        if self._next >= len(self._order) or self._order[self._next] != name:
            expected = self._order[self._next] if self._next < len(self._order) else "nothing more"
            raise ValueError(f"{self.path}: wrote {name!r}, expected {expected!r}")
        shape, dtype = self._entries[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(
                f"{self.path}: {name!r} is {tuple(tensor.shape)} {tensor.dtype}, announced as {shape} {dtype}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        if data.numel():
            self._file.write(data.view(torch.uint8).numpy().data)  # the tensor's memory, no copy
        self._next += 1

    def close(self) -> None:
        """Flush the file to disk; raises if announced tensors were not written."""
        if self._file.closed:
            return
        try:
            if self._next != len(self._order):
                raise ValueError(f"{self.path}: closed after {self._next} of {len(self._order)} tensors")
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()

    def abort(self) -> None:
        """Close without checks (the caller removes the partial file)."""
        self._file.close()

    def __enter__(self) -> SafetensorsStreamWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
