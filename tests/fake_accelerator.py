"""A fake accelerator for the CPU suite: the GPU's control flow with its hazards made visible.

Installed through ``hf_zero.distributed.device.use_runtime`` (see :func:`fake_accelerator`), it
behaves like a CUDA runtime whose device memory is ordinary CPU memory:

* **One stream per device; copies land as late as allowed.** An asynchronous copy (host side
  pinned) first poisons its destination (NaN, or -1 for integers) and is queued on the stream of
  the device its data lives on. Queued copies run, in order, only when something waits for them
  (an event recorded on *that* device's stream after them, a synchronize of that device, or a
  blocking copy), reading their source *then*, as a DMA engine does. Code that reads the
  destination before waiting, or waits on another device's stream, sees poison.
* **Devices.** Every tensor of this process lives on its own device: the index the main thread
  selected (``select_device``, as each rank of a real run uses one GPU), which the fake's tensors
  report as ``torch.device("cpu")``. The current device is per thread and starts at 0 in every
  thread; any index other than the process's own is ``torch.device("cpu", index)``, a device
  holding none of this process's data. An event recorded on the current device of a worker thread
  that never selected the rank's device (review F3: rank 1's copy-back thread waiting on device 0)
  therefore orders nothing, and the copy it was meant to wait for is still poison.
* **A caching allocator that reuses freed blocks.** A device-to-host copy issued on a side stream
  (inside a ``torch.cpu.stream(...)`` block, which is where FSDP2 runs its gradient hooks: on its
  all-reduce stream, reading the reduce-scatter output it allocated on its reduce-scatter stream)
  reads a block allocated on another stream. If that block has been freed by the time the copy
  runs (no tensor but the copy's own reference holds its storage), the allocator has handed it
  out again to the next allocation on its stream, as CUDA's caching allocator does (review F6):
  the copy lands poison (counted in ``reused``) unless ``record_stream`` was called on the block
  while the copy was queued. A copy on the default stream from a freed block reads right: the
  block's next user is ordered after it on the same stream.
* **Pinned storage cannot be resized,** as ``cudaHostAlloc``'s cannot: pinned buffers and
  ``Tensor.pin_memory()`` copies (patched while installed, so FSDP2's ``CPUOffloadPolicy`` pins
  through it too) are ``frombuffer`` tensors.
* **Every event, wait and synchronize is logged** with the device it targets (``events``).

"Host memory" is what the runtime pinned; every other tensor counts as accelerator memory (the
model's parameters and gradients). Collectives stay on gloo.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from hf_zero.distributed import device as accel


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(-1)


@dataclass
class FakeEvent:
    device: torch.device  # as recorded
    index: int  # the device whose stream it is on
    seq: int  # the copies queued on that stream before it


@dataclass(eq=False)
class _Copy:
    """An asynchronous copy queued on a stream."""

    dst: torch.Tensor
    src: torch.Tensor  # a device source: an alias of its storage (no autograd link to keep it alive)
    block: int | None  # a device source's storage address (the caching allocator's block)
    protected: bool = False  # record_stream was called on the block while the copy was queued


@dataclass
class _Stream:
    queue: list[_Copy] = field(default_factory=list)
    issued: int = 0
    landed: int = 0


def _storage_users(t: torch.Tensor) -> int:
    """Tensors holding ``t``'s storage (the temporary storage object of the query left out)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1


@dataclass
class FakeAccelerator:
    """See the module docstring."""

    count: int = 2
    type: str = "cpu"  # the devices tensors really live on
    backend: str = "gloo"
    events: list[tuple[str, torch.device]] = field(default_factory=list)  # ("record"/"wait"/"sync", device)
    async_copies: int = 0
    reused: int = 0  # device-to-host copies that read a block the allocator had handed out again
    _home: int = 0  # the device this process's tensors live on (selected on the main thread)
    _pinned: set[int] = field(default_factory=set)
    _local: threading.local = field(default_factory=threading.local)
    _streams: dict[int, _Stream] = field(default_factory=dict)
    _owners: dict[int, int] = field(default_factory=dict)  # block -> queued copies reading it
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _default_stream: object = field(default_factory=torch.cpu.current_stream)  # outside any stream block

    # --- devices
    def available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.count

    def set_device(self, index: int) -> None:
        self._local.index = index
        if threading.current_thread() is threading.main_thread():
            self._home = index  # select_device: where this process's tensors live

    def current_index(self) -> int:
        return getattr(self._local, "index", 0)

    def device(self, index: int) -> torch.device:
        # The process's own device is what its tensors report; another index holds none of them.
        return torch.device("cpu") if index == self._home else torch.device("cpu", index)

    def _index(self, device: torch.device) -> int:
        device = torch.device(device)
        return self._home if device.index is None else device.index

    def is_accelerator(self, device: torch.device) -> bool:
        return False  # a device object cannot tell; tensors can (on_accelerator)

    def on_accelerator(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and not self.is_pinned(t)

    def native_pinning(self) -> bool:
        return True

    # --- pinning
    def _register(self, t: torch.Tensor) -> torch.Tensor:
        with self._lock:
            self._pinned.add(t.untyped_storage().data_ptr())
        return t

    def is_pinned(self, t: torch.Tensor) -> bool:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.untyped_storage().data_ptr() in self._pinned

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        buf = bytearray(max(nbytes, 1))
        return self._register(torch.frombuffer(buf, dtype=torch.uint8)[:nbytes])

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        raw = self.pinned_empty(t.numel() * t.element_size())
        out = raw.view(t.dtype).view(t.shape) if t.numel() else torch.empty_like(t)
        if t.numel():
            out.copy_(t)
        return out

    # --- copies, events, streams
    def _stream(self, index: int) -> _Stream:
        return self._streams.setdefault(index, _Stream())

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        if not non_blocking:
            self._land(self._home)  # a blocking copy runs after what its device's stream holds
            dst.copy_(src)
            return
        _poison(dst)
        block = None
        if self.on_accelerator(src) and torch.cpu.current_stream() is not self._default_stream:
            # Hold the storage only, not src (a view keeps its base alive): whether anyone else
            # still holds the block is then visible when the copy runs.
            block = src.untyped_storage().data_ptr()
            src = torch.empty(0, dtype=src.dtype).set_(src.untyped_storage(), src.storage_offset(), src.size(),
                                                       src.stride())
        with self._lock:
            self.async_copies += 1
            stream = self._stream(self._home)  # a copy runs on the stream of its data's device
            stream.queue.append(_Copy(dst, src, block))
            stream.issued += 1
            if block is not None:
                self._owners[block] = self._owners.get(block, 0) + 1

    def _run(self, op: _Copy) -> None:
        if op.block is not None:
            freed = _storage_users(op.src) <= self._owners[op.block]
            self._owners[op.block] -= 1
            if not self._owners[op.block]:
                del self._owners[op.block]
            if freed and not op.protected:
                self.reused += 1  # the block holds someone else's data by now
                return  # the destination stays poisoned
        op.dst.copy_(op.src)

    def _land(self, index: int, upto: int | None = None) -> None:
        """Run the copies queued on device ``index``'s stream (the first ``upto`` of them)."""
        with self._lock:
            stream = self._streams.get(index)
            while stream is not None and stream.queue and (upto is None or stream.landed < upto):
                stream.landed += 1
                self._run(stream.queue.pop(0))

    def record_event(self, device: torch.device) -> FakeEvent:
        self.events.append(("record", torch.device(device)))
        index = self._index(device)
        with self._lock:
            return FakeEvent(torch.device(device), index, self._stream(index).issued)

    def wait_event(self, event: FakeEvent) -> None:
        self.events.append(("wait", event.device))
        self._land(event.index, event.seq)

    def flush(self) -> None:
        with self._lock:
            for index in list(self._streams):
                self._land(index)

    def synchronize(self, device: torch.device) -> None:
        self.events.append(("sync", torch.device(device)))
        self._land(self._index(device))

    def record_stream(self, t: torch.Tensor) -> None:
        self.events.append(("record_stream", t.device))
        if not self.on_accelerator(t):
            return
        block = t.untyped_storage().data_ptr()
        with self._lock:  # the allocator keeps the block until the work queued now has run
            for stream in self._streams.values():
                for op in stream.queue:
                    if op.block == block:
                        op.protected = True

    def get_rng_state(self) -> torch.Tensor | None:
        return None

    def set_rng_state(self, state: torch.Tensor) -> None:
        return None

    def device_name(self, index: int) -> str:
        return f"Fake accelerator {index}"

    def can_access_peer(self, i: int, j: int) -> bool:
        return True


class NoAccelerator(accel.CudaRuntime):
    """The real runtime with no device visible: a plain CPU reference run on a GPU machine too."""

    def available(self) -> bool:
        return False


@contextlib.contextmanager
def fake_accelerator(**kwargs) -> Iterator[FakeAccelerator]:
    """Install a :class:`FakeAccelerator` (and route ``Tensor.pin_memory``/``is_pinned`` to it)."""
    fake = FakeAccelerator(**kwargs)
    real_pin, real_is_pinned = torch.Tensor.pin_memory, torch.Tensor.is_pinned
    torch.Tensor.pin_memory = lambda self, *a, **k: fake.pin(self)  # type: ignore[method-assign]
    torch.Tensor.is_pinned = lambda self, *a, **k: fake.is_pinned(self)  # type: ignore[method-assign]
    try:
        with accel.use_runtime(fake):
            yield fake
            fake.flush()
    finally:
        torch.Tensor.pin_memory, torch.Tensor.is_pinned = real_pin, real_is_pinned  # type: ignore[method-assign]


FAKE_ENV = "HF_ZERO_FAKE_ACCELERATOR"
_installed: contextlib.ExitStack | None = None


def install_from_env() -> FakeAccelerator | None:
    """For multi-rank test workers: install a :class:`FakeAccelerator` for the rest of the process
    when ``HF_ZERO_FAKE_ACCELERATOR=1`` (each rank gets its own; collectives stay on gloo). Call
    before the process group is created. Returns the fake, or None when the variable is not set."""
    import atexit
    import os

    global _installed
    if os.environ.get(FAKE_ENV) != "1" or _installed is not None:
        return None
    _installed = contextlib.ExitStack()
    fake = _installed.enter_context(fake_accelerator())
    atexit.register(_installed.close)
    return fake
