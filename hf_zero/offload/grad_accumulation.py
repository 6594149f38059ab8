"""Gradient accumulation into host fp32 buffers without stalling the backward (review F11).

With optimizer offload every micro-step's gradient shard goes to the host as backward produces it.
The first micro-step of a window copies it straight into the parameter's host gradient buffer, an
asynchronous DMA from pinned memory. From the second micro-step on the buffer already holds values
and the new gradient has to be *added*: done naively that is a blocking device-to-host copy and a
CPU add inside the backward, for every parameter, on every micro-step but the first, which stalls
the accelerator (DeepSpeed's ZeRO-Offload has the same cost unless its accumulation is overlapped).

:class:`StagedAccumulation` instead copies the gradient asynchronously into one of two pinned
staging blocks (each the size of the largest gradient shard) and hands the add to a worker thread,
which waits for that copy's event only and frees the block when the add is done. The backward
blocks only when both blocks are still busy. Readers of the host gradients (norm, clipping,
unscale, the step) call :meth:`StagedAccumulation.drain` first.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
from collections.abc import Callable

import torch

from hf_zero.distributed import device as accel
from hf_zero.offload.pinned import HostArena, planned_pinned_bytes, pinning_fits

STAGING_BLOCKS = 2
"""One block receives the next gradient while the worker adds the previous one."""


class StagedAccumulation:
    """Adds device gradients into host fp32 buffers through pinned staging blocks and a worker.

    ``before_add`` runs on the worker before each add; the optimizer passes its wait for the
    first micro-step's copies, so an add never lands on a host gradient whose first copy is still
    in flight (those copies may have been issued on another stream, e.g. from DDP's comm hook).

    Built lazily (:meth:`usable` allocates on first use): runs without accumulation pin nothing.
    Where the blocks cannot be pinned (no accelerator, pinning off, or over the host's headroom:
    :func:`~hf_zero.offload.pinned.pinning_fits` warns), :meth:`usable` is false and the caller
    adds synchronously, as a pageable copy is synchronous anyway.

    >>> acc = StagedAccumulation(largest_numel=4, pin=False, setting="offload_optimizer.pin_memory")
    >>> acc.usable()
    False
    """

    def __init__(self, largest_numel: int, *, pin: bool, setting: str,
                 before_add: Callable[[], None] | None = None):
        self._largest = int(largest_numel)
        self._pin = pin
        self._setting = setting
        self._before_add = before_add or (lambda: None)
        self._arena: HostArena | None = None
        self._decided = False
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self._worker: cf.ThreadPoolExecutor | None = None
        self._pending: list[cf.Future] = []
        self.staged = 0
        """Gradients added through the staging blocks so far (tests and diagnostics)."""

    def usable(self) -> bool:
        """Whether staged accumulation is on: pinned blocks exist (allocated on the first call)."""
        if not self._decided:
            self._decided = True
            if self._pin and self._largest > 0 and accel.pin_available():
                sizes = [4 * self._largest] * STAGING_BLOCKS
                if pinning_fits(planned_pinned_bytes(sizes), self._setting):
                    self._arena = HostArena([self._largest] * STAGING_BLOCKS, torch.float32, pin=True,
                                            setting=self._setting)
                    for block in self._arena.views:
                        self._free.put(block)
                    self._worker = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_zero-accumulate",
                                                         initializer=accel.thread_initializer())  # rank's device
        return self._worker is not None

    def add(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst += src`` (``dst`` a host fp32 buffer, ``src`` on the accelerator), without waiting
        for the copy here. Call :meth:`usable` first."""
        assert self._worker is not None, "StagedAccumulation.add before usable()"
        # An add's error is not raised here, inside the backward of one rank (the others would wait
        # in the next reduce-scatter): drain() raises it where the readers of the gradients are.
        n = src.numel()
        block = self._free.get()  # waits only while both blocks are still being added
        view = block[:n]
        copies = accel.PendingCopies()  # this copy's own event: the worker waits for nothing else
        copies.copy(view, src.reshape(-1))
        # The source is a slice of FSDP2's reduce-scatter output, allocated on another stream: the
        # allocator must not hand its block out again before this copy has run, whenever the
        # output itself is dropped (review F6; seen on torch 2.9.1 under the fake accelerator).
        accel.record_stream(src)
        self._pending.append(self._worker.submit(self._add, copies, dst, view, block))
        self.staged += 1

    def _add(self, copies: accel.PendingCopies, dst: torch.Tensor, view: torch.Tensor, block: torch.Tensor) -> None:
        try:
            self._before_add()
            copies.wait()
            dst.add_(view)
        finally:
            self._free.put(block)

    def drain(self) -> None:
        """Block until every add issued so far is in its host buffer (re-raises an add's error)."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        """Let what is in flight finish and stop the worker (idempotent; raises nothing: an add's
        error has been raised by :meth:`drain` already, or the run is being torn down)."""
        worker, self._worker = self._worker, None
        pending, self._pending = self._pending, []
        if worker is not None:
            cf.wait(pending)
            worker.shutdown(wait=True)
