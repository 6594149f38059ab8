"""A fake accelerator for the CPU suite: the GPU's control flow with its hazards made visible.

Installed through ``hf_zero.distributed.device.use_runtime`` (see :func:`fake_accelerator`), it
behaves like a CUDA runtime whose device memory is ordinary CPU memory:

* **Copies land later.** An asynchronous copy (host side pinned) first poisons its destination
  (NaN, or -1 for integers) and is carried out on a single "stream" thread after a delay, reading
  its source *then*, as a DMA engine does. Its event completes when it has landed. Code that reads
  the destination before waiting sees poison.
* **Pinned storage cannot be resized,** as ``cudaHostAlloc``'s cannot: pinned buffers and
  ``Tensor.pin_memory()`` copies (patched while installed, so FSDP2's ``CPUOffloadPolicy`` pins
  through it too) are ``frombuffer`` tensors.
* **A per-thread current device,** starting at 0 in every thread; every event and wait records the
  device it targets, so a worker thread waiting on device 0 for a copy to device 1 shows.

"Host memory" is what the runtime pinned; every other tensor counts as accelerator memory (the
model's parameters and gradients). Collectives stay on gloo.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
import time
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
    future: cf.Future | None
    device: torch.device


@dataclass
class FakeAccelerator:
    """See the module docstring. ``delay_s``: how long each asynchronous copy stays in flight."""

    delay_s: float = 0.002
    count: int = 2
    type: str = "cpu"  # the devices tensors really live on
    backend: str = "gloo"
    events: list[tuple[str, torch.device]] = field(default_factory=list)  # ("record"/"wait", device)
    async_copies: int = 0
    _pinned: set[int] = field(default_factory=set)
    _local: threading.local = field(default_factory=threading.local)
    _stream: cf.ThreadPoolExecutor = field(default_factory=lambda: cf.ThreadPoolExecutor(1, thread_name_prefix="fake-stream"))
    _last: cf.Future | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # --- devices
    def available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.count

    def set_device(self, index: int) -> None:
        self._local.index = index

    def current_index(self) -> int:
        return getattr(self._local, "index", 0)

    def device(self, index: int) -> torch.device:
        return torch.device("cpu")

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
    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        if not non_blocking:
            self.flush()  # a blocking copy is ordered after the queued ones
            dst.copy_(src)
            return
        _poison(dst)

        def land() -> None:
            time.sleep(self.delay_s)
            dst.copy_(src)

        with self._lock:
            self.async_copies += 1
            self._last = self._stream.submit(land)

    def record_event(self, device: torch.device) -> FakeEvent:
        self.events.append(("record", torch.device(device)))
        with self._lock:
            return FakeEvent(self._last, torch.device(device))

    def wait_event(self, event: FakeEvent) -> None:
        self.events.append(("wait", event.device))
        if event.future is not None:
            event.future.result()

    def flush(self) -> None:
        with self._lock:
            last = self._last
        if last is not None:
            last.result()

    def synchronize(self, device: torch.device) -> None:
        self.events.append(("sync", torch.device(device)))
        self.flush()

    def record_stream(self, t: torch.Tensor) -> None:
        self.events.append(("record_stream", t.device))

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
        fake._stream.shutdown(wait=True)


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
