"""The accelerator runtime behind one small interface: the only module that calls ``torch.cuda``.

Everything else in hf_zero asks this module for the device of a rank, pinned host memory, copies
between host and device, events, stream bookkeeping and RNG state. Two rules make the GPU's
control flow run on CPU too:

* **Decide by where the data lives.** Whether a copy may be asynchronous, and whether someone must
  wait for it, follows from the source and destination tensors (one of them on an accelerator, the
  host side pinned), never from ``torch.cuda.is_available()`` or the process group's backend.
* **Wait on what you started.** Asynchronous copies are issued through a :class:`PendingCopies`,
  which records an event on the stream that ran each copy (the current stream of the accelerator
  side, e.g. FSDP2's all-reduce stream inside a gradient hook) and waits for exactly those events,
  on the right device, from any thread -- no device-wide ``synchronize()``.

The runtime is replaceable (:func:`use_runtime`): the test suite installs a fake accelerator whose
copies land later on a thread, with the destination poisoned until their event completes, whose
pinned storage cannot be resized, and which records the device every wait targets. Code that
reads host data before waiting, or waits on the wrong device, fails on CPU.

Example::

    >>> from hf_zero.distributed import device
    >>> copies = device.PendingCopies()
    >>> host = device.pinned_empty(4, torch.float32)   # pageable when no accelerator
    >>> copies.copy(host, torch.ones(4))               # async when the source is on a GPU
    >>> copies.wait()                                  # host values are valid from here on
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "CudaRuntime",
    "PendingCopies",
    "accelerator_available",
    "bf16_supported",
    "current_device",
    "default_backend",
    "device_count",
    "device_name",
    "device_properties",
    "empty_cache",
    "get_rng_state",
    "is_accelerator",
    "max_memory_allocated",
    "memory_stats",
    "native_pinning",
    "nccl_version",
    "pin",
    "pin_available",
    "pinned_empty",
    "record_stream",
    "reset_peak_memory_stats",
    "runtime",
    "select_device",
    "set_rng_state",
    "synchronize",
    "thread_initializer",
    "use_runtime",
]


class CudaRuntime:
    """The real runtime: CUDA through ``torch.cuda`` / ``torch.Stream`` / ``torch.Event``.

    A runtime answers the questions below; :func:`use_runtime` swaps it (tests do). Methods take
    devices and tensors, never ask the process group.
    """

    type = "cuda"
    backend = "nccl"

    def available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count() if self.available() else 0

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def current_index(self) -> int:
        return torch.cuda.current_device()

    def device(self, index: int) -> torch.device:
        return torch.device("cuda", index)

    def native_pinning(self) -> bool:
        return self.available()

    def is_accelerator(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def on_accelerator(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda"

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.is_pinned()

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory()

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        dst.copy_(src, non_blocking=non_blocking)

    def record_event(self, device: torch.device) -> Any:
        # The copy ran on the current stream of the accelerator side (a ``with stream:`` block
        # such as FSDP2's all-reduce stream counts): the event marks its end on that stream.
        return torch.cuda.current_stream(device).record_event()

    def wait_event(self, event: Any) -> None:
        event.synchronize()

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def record_stream(self, t: torch.Tensor) -> None:
        t.record_stream(torch.cuda.current_stream(t.device))

    def get_rng_state(self) -> torch.Tensor | None:
        if self.available() and torch.cuda.is_initialized():
            return torch.cuda.get_rng_state()
        return None

    def set_rng_state(self, state: torch.Tensor) -> None:
        if self.available():
            torch.cuda.set_rng_state(state)

    def device_name(self, index: int) -> str:
        return torch.cuda.get_device_name(index)

    def bf16_supported(self, index: int | None = None) -> bool:
        if index is None:
            return torch.cuda.is_bf16_supported(including_emulation=False)
        with torch.cuda.device(index):  # is_bf16_supported asks about the current device
            return torch.cuda.is_bf16_supported(including_emulation=False)

    def device_properties(self, index: int) -> Any:
        return torch.cuda.get_device_properties(index)

    def nccl_version(self) -> str:
        return ".".join(map(str, torch.cuda.nccl.version()))

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated()

    def memory_stats(self) -> dict[str, int]:
        return {"allocated": torch.cuda.memory_allocated(), "max_allocated": torch.cuda.max_memory_allocated(),
                "reserved": torch.cuda.memory_reserved(), "max_reserved": torch.cuda.max_memory_reserved()}

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def can_access_peer(self, i: int, j: int) -> bool:
        return torch.cuda.can_device_access_peer(i, j)


_runtime: Any = CudaRuntime()
_runtime_lock = threading.Lock()


def runtime() -> Any:
    """The runtime in use (:class:`CudaRuntime` unless a test installed another)."""
    return _runtime


@contextlib.contextmanager
def use_runtime(rt: Any) -> Iterator[Any]:
    """Install ``rt`` as the runtime for the duration of the block (tests' fake accelerator)."""
    global _runtime
    with _runtime_lock:
        old, _runtime = _runtime, rt
    try:
        yield rt
    finally:
        with _runtime_lock:
            _runtime = old


# ------------------------------------------------------------------------------- devices
def accelerator_available() -> bool:
    """Whether this process sees an accelerator."""
    return _runtime.available()


def device_count() -> int:
    """Number of visible accelerators (0 without one)."""
    return _runtime.device_count()


def is_accelerator(device: torch.device | torch.Tensor) -> bool:
    """Whether a tensor (or a device) is accelerator memory, not host memory."""
    if isinstance(device, torch.Tensor):
        return _runtime.on_accelerator(device)
    return _runtime.is_accelerator(torch.device(device))


def select_device(local_rank: int) -> torch.device:
    """Make accelerator ``local_rank`` this process's current device and return it (CPU without one).

    Raises:
        RuntimeError: ``local_rank`` is beyond the visible accelerators: two ranks would share one
            GPU, which NCCL refuses later with "Duplicate GPU detected".
    """
    if not _runtime.available():
        return torch.device("cpu")
    count = _runtime.device_count()
    if local_rank >= count:
        raise RuntimeError(
            f"LOCAL_RANK {local_rank} but only {count} GPU(s) are visible to this process: launch at most "
            f"{count} process(es) per node (--nproc_per_node {count}), or check CUDA_VISIBLE_DEVICES"
        )
    _runtime.set_device(local_rank)
    return _runtime.device(_runtime.current_index())


def current_device() -> torch.device:
    """This thread's current accelerator device (CPU without one)."""
    if not _runtime.available():
        return torch.device("cpu")
    return _runtime.device(_runtime.current_index())


def thread_initializer() -> Callable[[], None]:
    """What a worker thread hf_zero starts runs first (``ThreadPoolExecutor(initializer=...)``):
    make the current accelerator device of the thread calling this (the rank's) current there too.

    A new thread starts on device 0 whatever its process selected, so its first runtime call (an
    event wait, a copy) would create a context on GPU 0 from every rank (review N4). Call it on
    the thread that creates the pool. Without an accelerator it returns a function doing nothing.
    """
    if not _runtime.available():
        return _nothing
    return functools.partial(_set_device, _runtime.current_index())


def _set_device(index: int) -> None:
    _runtime.set_device(index)


def _nothing() -> None:
    return None


def default_backend() -> str:
    """The process-group backend for this runtime: NCCL with CUDA, gloo without an accelerator."""
    return _runtime.backend if _runtime.available() else "gloo"


def synchronize(device: torch.device) -> None:
    """Wait for all work queued on accelerator ``device`` (nothing to do for host memory). Prefer
    :class:`PendingCopies` in hot paths: it waits for one's own copies only."""
    if _runtime.is_accelerator(torch.device(device)):
        _runtime.synchronize(torch.device(device))


def record_event(device: torch.device) -> Any:
    """An event marking the end of the work queued so far on ``device``'s current stream, or
    None for host memory (nothing queued). Pass it to :func:`wait_event`."""
    device = torch.device(device)
    return _runtime.record_event(device) if _runtime.is_accelerator(device) else None


def wait_event(event: Any) -> None:
    """Block until ``event`` (from :func:`record_event`; None: nothing to wait for) has passed."""
    if event is not None:
        _runtime.wait_event(event)


def record_stream(t: torch.Tensor) -> None:
    """Tell the caching allocator that work queued on the current stream still reads ``t``, so its
    block is not handed out again before that work has run (no-op for host memory)."""
    if is_accelerator(t):
        _runtime.record_stream(t)


# ------------------------------------------------------------------------------- pinning
def pin_available() -> bool:
    """Whether page-locked host memory means anything here (an accelerator is present)."""
    return _runtime.available()


def native_pinning() -> bool:
    """Whether torch's own ``Tensor.pin_memory()`` works here: code we do not own (FSDP2's
    ``CPUOffloadPolicy``) pins through it, not through :func:`pin`."""
    return _runtime.native_pinning()


def pin(t: torch.Tensor) -> torch.Tensor:
    """A page-locked copy of host tensor ``t`` (``t`` itself without an accelerator).

    Pinned storage cannot be resized: code that frees host storage by ``resize_(0)`` must keep
    such tensors pageable."""
    return _runtime.pin(t) if _runtime.available() else t


def pinned_empty(nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialised host buffer of ``nbytes`` bytes viewed as ``dtype``: pinned with an
    accelerator, pageable without one."""
    if _runtime.available():
        raw = _runtime.pinned_empty(nbytes)
    else:
        raw = torch.empty(nbytes, dtype=torch.uint8)
    return raw.view(dtype) if dtype != torch.uint8 else raw


# ------------------------------------------------------------------------------- copies
class PendingCopies:
    """Host<->accelerator copies issued asynchronously, and the one wait that makes them safe.

    ``copy(dst, src)`` is asynchronous exactly when one side is accelerator memory and the host
    side is pinned (otherwise the copy engine must stage it and the copy is synchronous anyway);
    it then records an event on the accelerator side's current stream. ``wait()`` blocks until
    every copy issued so far has landed, whichever thread or device issued it. Thread-safe.
    """

    def __init__(self) -> None:
        self._events: list[Any] = []
        self._lock = threading.Lock()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)``, asynchronous where the data's placement allows; see the class doc."""
        rt = _runtime
        src_acc, dst_acc = rt.on_accelerator(src), rt.on_accelerator(dst)
        if src_acc == dst_acc:
            rt.copy(dst, src, non_blocking=False)
            return
        host = dst if src_acc else src
        non_blocking = rt.is_pinned(host)
        rt.copy(dst, src, non_blocking=non_blocking)
        if non_blocking:
            event = rt.record_event(src.device if src_acc else dst.device)
            with self._lock:
                self._events.append(event)

    @property
    def pending(self) -> int:
        """Copies issued and not yet waited for."""
        with self._lock:
            return len(self._events)

    def wait(self) -> None:
        """Block until every copy issued so far has landed."""
        with self._lock:
            events, self._events = self._events, []
        for event in events:
            _runtime.wait_event(event)


# ------------------------------------------------------------------------------- RNG
def get_rng_state() -> torch.Tensor | None:
    """The current accelerator's RNG state, or None when there is none (or it was never used)."""
    return _runtime.get_rng_state() if _runtime.available() else None


def set_rng_state(state: torch.Tensor) -> None:
    """Restore the current accelerator's RNG state (ignored without an accelerator)."""
    if _runtime.available():
        _runtime.set_rng_state(state)


def device_name(index: int) -> str:
    """Marketing name of accelerator ``index``."""
    return _runtime.device_name(index)


def can_access_peer(i: int, j: int) -> bool:
    """Whether the driver reports peer access from accelerator ``i`` to ``j`` (it may be wrong:
    only a live collective settles it, see ``hf-zero doctor``)."""
    return _runtime.can_access_peer(i, j)


def bf16_supported(index: int | None = None) -> bool:
    """Whether accelerator ``index`` (default: the current one) computes in bf16 natively, not
    emulated; False without an accelerator."""
    return _runtime.available() and _runtime.bf16_supported(index)


def device_properties(index: int) -> Any:
    """Name, ``total_memory``, ``major``/``minor`` compute capability of accelerator ``index``."""
    return _runtime.device_properties(index)


def nccl_version() -> str:
    """The NCCL version torch was built with, e.g. ``"2.28.9"``."""
    return _runtime.nccl_version()


def max_memory_allocated() -> int | None:
    """Peak bytes the caching allocator handed out on the current accelerator (None without one)."""
    return _runtime.max_memory_allocated() if _runtime.available() else None


def memory_stats() -> dict[str, int] | None:
    """Bytes of the caching allocator on the current accelerator: ``allocated``, ``max_allocated``,
    ``reserved``, ``max_reserved`` (None without one). For scripts' memory reports (the DeepSpeed API)."""
    return _runtime.memory_stats() if _runtime.available() else None


def reset_peak_memory_stats() -> None:
    """Restart the peak counters of the current accelerator (nothing without one)."""
    if _runtime.available():
        _runtime.reset_peak_memory_stats()


def empty_cache() -> None:
    """Give the caching allocator's unused blocks back to the driver (nothing without an accelerator)."""
    if _runtime.available():
        _runtime.empty_cache()
