"""File-backed swap space for offloaded state, in pure Python (no libaio, no compiled ops).

Layout: every rank swaps into its own folder ``<nvme_path>/hf_zero-<run id>/rank<r>/`` (mode 0700,
as is the run folder: swapped optimizer state is the user's data); the run id (time + random
suffix) is made by rank 0 and shared, so concurrent runs never share files and a run's ranks sit
side by side. The owning process holds a lock in its folder for its whole life
(``offload/swap_ownership.py``), which is how a later run tells a crashed run's folder from a live
one. Each *record* (one optimizer sub-group, one parameter unit) is one
file of fixed size, preallocated at start-up so that a disk too small for the run fails before
training rather than in the middle of it.

I/O is done by a pool of ``aio.thread_count`` threads with ``os.preadv``/``os.pwritev`` (they
release the GIL, so threads overlap I/O with the optimizer's compute). DeepSpeed's ``aio`` section
maps onto it as follows:

==================  ===========================================================================
``block_size``      bytes per I/O request; a record is read/written in blocks of this size
``queue_depth``     blocks submitted in one ``preadv``/``pwritev`` call (a vector of requests)
``single_submit``   true: one block per system call instead of ``queue_depth`` blocks
``thread_count``    I/O threads; one record's blocks are split into this many ranges in parallel
``overlap_events``  true: reads ahead / writes behind run while the caller computes; false:
                    every swap completes before the call that started it returns
==================  ===========================================================================

Files are opened with ``O_DIRECT`` where the file system allows it (page-aligned buffers,
offsets and lengths), so swapped state does not also sit in the page cache, which would defeat the
point of moving it out of host memory; elsewhere (tmpfs, some network file systems) buffered I/O is
used and a message says so once.

Files are opened for every request rather than kept open: a swap file deleted or truncated under a
running job then fails the next request with an error naming it, instead of the job silently
reading an unlinked inode. The folder is removed when the owner closes it, at interpreter exit,
and on SIGTERM (what ``torchrun`` sends the surviving ranks when one fails).
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import ctypes
import errno
import logging
import os
import shutil
import signal
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from hf_zero.config.schema import AioConfig
from hf_zero.distributed import device as accel
from hf_zero.offload.base import OffloadError, alloc_host
from hf_zero.offload.pinned import pinning_fits, pow2_ceil
from hf_zero.offload.swap_ownership import OWNER_FILE, claim, release, take_if_abandoned

__all__ = [
    "ALIGN",
    "BufferPool",
    "IOHandle",
    "OWNER_FILE",
    "RUN_PREFIX",
    "SwapDir",
    "SwapSpace",
    "new_run_id",
    "remove_stale_dirs",
    "round_up",
]

logger = logging.getLogger("hf_zero")

ALIGN = 4096
"""Alignment of buffers, file offsets and lengths: what ``O_DIRECT`` needs on 4K-sector disks."""
RUN_PREFIX = "hf_zero-"

# System calls the I/O threads use, looked up through the module at call time so that tests can
# replace them (a writer that fails with ENOSPC, a reader that sees a truncated file).
_preadv = os.preadv
_pwritev = os.pwritev
_open = os.open


def _memoryview(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory, for ``preadv``/``pwritev``.

    Not ``t.numpy()``: exporting to numpy marks the storage non-resizable for good, and parameter
    swapping frees shard storage by resizing it to 0 bytes.
    """
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("swap I/O needs a contiguous CPU tensor")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def round_up(n: int, multiple: int = ALIGN) -> int:
    return (n + multiple - 1) // multiple * multiple


def new_run_id() -> str:
    """A folder name no other run (on this or another host) will pick: time plus a random suffix."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:10]}"


# ----------------------------------------------------------------------------------------------- folder
_LIVE_DIRS: weakref.WeakSet[SwapDir] = weakref.WeakSet()
_HOOKS_INSTALLED = False
_HOOK_LOCK = threading.Lock()


def _cleanup_live_dirs() -> None:
    for swap_dir in list(_LIVE_DIRS):
        swap_dir.close()


def _on_sigterm(signum, frame) -> None:
    # torchrun stops the surviving ranks with SIGTERM when one fails; Python's default action skips
    # atexit, so remove the swap folders, then die of the same signal as before.
    _cleanup_live_dirs()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_exit_hooks() -> None:
    global _HOOKS_INSTALLED
    with _HOOK_LOCK:
        if _HOOKS_INSTALLED:
            return
        _HOOKS_INSTALLED = True
        atexit.register(_cleanup_live_dirs)
        # Only take over SIGTERM when nobody else handles it (a framework's handler stays in place).
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)


def remove_stale_dirs(nvme_path: str) -> list[str]:
    """Remove run folders under ``nvme_path`` whose every rank folder lost its owner (a run killed
    with SIGKILL cannot clean up after itself). A rank folder has lost its owner when its lock can
    be taken (``offload/swap_ownership.py``), whatever its recorded pid looks like from here.
    Folders of live processes (in any PID namespace), of other hosts, and folders being made are
    never touched. Returns the removed paths."""
    removed = []
    host = socket.gethostname()
    try:
        names = os.listdir(nvme_path)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(RUN_PREFIX):
            continue
        run = os.path.join(nvme_path, name)
        held: list[int] = []  # the locks of abandoned rank folders, kept until the run is removed
        try:
            try:
                rank_dirs = os.listdir(run)
            except OSError:
                continue
            abandoned = bool(rank_dirs)
            for rank_dir in rank_dirs:
                gone, fd = take_if_abandoned(os.path.join(run, rank_dir), host)
                if fd is not None:
                    held.append(fd)
                if not gone:
                    abandoned = False
                    break
            if abandoned:
                shutil.rmtree(run, ignore_errors=True)
                removed.append(run)
        finally:
            for fd in held:
                release(fd)
    return removed


def _remove_swap_dir(path: str, run_dir: str, lock_fd: int | None) -> None:
    # Removed while still locked, so no other run takes the folder for abandoned half-way.
    shutil.rmtree(path, ignore_errors=True)
    try:
        os.rmdir(run_dir)  # succeeds for the run's last rank only
    except OSError:
        pass
    release(lock_fd)


class SwapDir:
    """This rank's swap folder ``<nvme_path>/hf_zero-<run_id>/rank<rank>/``.

    Args:
        nvme_path: the config's folder; it must exist and be writable.
        run_id: shared by the run's ranks (:func:`new_run_id` on rank 0, broadcast).
        rank: this rank.
        setting: the config key of ``nvme_path``, for messages.

    Raises:
        OffloadError: ``nvme_path`` is missing, not a folder, or not writable.
    """

    def __init__(self, nvme_path: str, run_id: str, rank: int, setting: str):
        self.setting = setting
        self.nvme_path = os.path.abspath(os.path.expanduser(nvme_path))
        if not os.path.exists(self.nvme_path):
            raise OffloadError(
                f"{setting}={nvme_path!r} does not exist; create the folder (on a fast local disk) or fix the path"
            )
        if not os.path.isdir(self.nvme_path):
            raise OffloadError(f"{setting}={nvme_path!r} is not a folder")
        remove_stale_dirs(self.nvme_path)
        self.run_dir = os.path.join(self.nvme_path, RUN_PREFIX + run_id)
        self.path = os.path.join(self.run_dir, f"rank{rank}")
        lock_fd = None
        try:
            made_run_dir = not os.path.isdir(self.run_dir)
            os.makedirs(self.run_dir, mode=0o700, exist_ok=True)  # the run's other ranks may have made it
            if made_run_dir:
                os.chmod(self.run_dir, 0o700)  # whatever the umask
            os.mkdir(self.path, 0o700)
            os.chmod(self.path, 0o700)
            lock_fd = claim(self.path, rank)
        except FileExistsError as exc:
            raise OffloadError(f"swap folder {self.path} already exists: another run uses the same run id") from exc
        except OSError as exc:
            if os.path.isdir(self.path):  # made but never owned: no one else would remove it
                _remove_swap_dir(self.path, self.run_dir, None)
            raise OffloadError(
                f"{setting}={nvme_path!r} is not writable: creating {self.path} failed ({exc.strerror or exc}); "
                "point it at a folder this user can write"
            ) from exc
        self._closed = False
        self._lock = threading.Lock()
        # Removed on close(), at interpreter exit, when garbage-collected unclosed, and on SIGTERM;
        # the lock goes with it. Until then, holding it tells other runs this folder is alive.
        self._finalizer = weakref.finalize(self, _remove_swap_dir, self.path, self.run_dir, lock_fd)
        _LIVE_DIRS.add(self)
        _install_exit_hooks()

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Remove this rank's folder, and the run folder once every rank's is gone (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer()
        _LIVE_DIRS.discard(self)


# ----------------------------------------------------------------------------------------------- buffers
class BufferPool:
    """``count`` page-aligned host buffers of ``nbytes`` each, handed out one at a time.

    The pool bounds the host memory NVMe offload uses: one buffer for the sub-group being
    stepped, one being read ahead, the rest draining writes. :meth:`acquire` blocks until a buffer
    comes back (writes always finish, so this cannot deadlock while I/O threads run).
    """

    def __init__(self, count: int, nbytes: int, *, pin: bool, setting: str):
        if count < 1:
            raise OffloadError(f"{setting}: buffer_count must be at least 1, got {count}")
        self.nbytes = round_up(max(nbytes, 1))
        self._free: list[torch.Tensor] = []
        self._cond = threading.Condition()
        if pin and accel.pin_available():  # each buffer one rounded allocation (+ALIGN to align it)
            pin = pinning_fits(count * pow2_ceil(self.nbytes + ALIGN), setting)
        self.buffers = [alloc_host(self.nbytes, torch.uint8, pin=pin, setting=setting, align=ALIGN) for _ in range(count)]
        self._free = list(self.buffers)

    @property
    def count(self) -> int:
        return len(self.buffers)

    @property
    def total_bytes(self) -> int:
        return self.count * self.nbytes

    def acquire(self, timeout: float | None = None) -> torch.Tensor:
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free), timeout=timeout):
                raise OffloadError(f"no swap buffer came back within {timeout} s (an I/O thread is stuck)")
            return self._free.pop()

    def release(self, buf: torch.Tensor) -> None:
        with self._cond:
            if any(b is buf for b in self._free):
                return
            self._free.append(buf)
            self._cond.notify()

    def available(self) -> int:
        with self._cond:
            return len(self._free)


# ----------------------------------------------------------------------------------------------- I/O
class IOHandle:
    """One read or write of a record, possibly split over several threads."""

    def __init__(self, futures: list[cf.Future], describe: Callable[[BaseException], OffloadError]):
        self._futures = futures
        self._describe = describe
        self._error: OffloadError | None = None
        self._waited = False

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> None:
        """Block until the I/O is complete.

        Raises:
            OffloadError: the I/O failed; the message names the file and what to do.
        """
        if self._waited:
            if self._error is not None:
                raise self._error
            return
        error = None
        for f in self._futures:
            try:
                f.result()
            except BaseException as exc:  # noqa: BLE001 -- translated into a clear OffloadError below
                error = error or exc
        self._waited = True
        if error is not None:
            self._error = error if isinstance(error, OffloadError) else self._describe(error)
            raise self._error from error

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` (on an I/O thread, or now) once every part has finished, success or not."""
        remaining = [len(self._futures)]
        lock = threading.Lock()

        def one_done(_f: cf.Future) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                fn()

        if not self._futures:
            fn()
        for f in self._futures:
            f.add_done_callback(one_done)


class _Completed(cf.Future):
    def __init__(self):
        super().__init__()
        self.set_result(None)


@dataclass(frozen=True)
class _Record:
    path: str
    nbytes: int


class SwapSpace:
    """Named fixed-size records in a :class:`SwapDir`, read and written by background threads.

    Args:
        swap_dir: the folder the record files go in.
        aio: the config's ``aio`` section (see the module docstring for what each field does).
        setting: config key for messages (``zero_optimization.offload_optimizer.nvme_path``).
        direct: try ``O_DIRECT`` (falls back to buffered I/O where the file system refuses it).
        owns_dir: :meth:`close` also removes the folder (when no other space shares it).
    """

    def __init__(self, swap_dir: SwapDir, aio: AioConfig, setting: str, *, direct: bool = True, owns_dir: bool = False):
        self.dir = swap_dir
        self.owns_dir = owns_dir
        self.setting = setting
        self.block = round_up(max(int(aio.block_size), ALIGN))
        self.queue_depth = max(1, int(aio.queue_depth))
        self.single_submit = bool(aio.single_submit)
        self.overlap = bool(aio.overlap_events)
        self.threads = max(1, int(aio.thread_count))
        self.direct = direct and hasattr(os, "O_DIRECT")
        self._records: dict[str, _Record] = {}
        self._pool = cf.ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="hf_zero-swap",
                                           initializer=accel.thread_initializer())  # on the rank's device (N4)
        self._closed = False
        self.bytes_read = 0
        self.bytes_written = 0

    # ------------------------------------------------------------------ records
    def create(self, name: str, nbytes: int) -> None:
        """Create (and preallocate) the record file ``name`` of ``nbytes`` (rounded up to 4 KiB).

        Raises:
            OffloadError: the file cannot be created or the disk has no room for it.
        """
        path = self.dir.file(name)
        size = round_up(nbytes)
        try:
            fd = _open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                if hasattr(os, "posix_fallocate"):
                    try:
                        os.posix_fallocate(fd, 0, size)
                    except OSError as exc:
                        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                            raise
                        os.ftruncate(fd, size)
                else:  # pragma: no cover - every Linux has it
                    os.ftruncate(fd, size)
            finally:
                os.close(fd)
        except OSError as exc:
            raise self._os_error(exc, path, "creating") from exc
        self._records[name] = _Record(path, size)

    def check_free_space(self, needed: int) -> None:
        """Fail early, with sizes, when the disk under the folder cannot hold ``needed`` more bytes."""
        free = shutil.disk_usage(self.dir.path).free
        if needed > free:
            raise OffloadError(
                f"{self.setting}={self.dir.nvme_path!r}: the swap files of this rank need {needed / 2**30:.2f} GiB "
                f"but the disk has {free / 2**30:.2f} GiB free; free space or use a larger disk"
            )

    def size(self, name: str) -> int:
        return self._records[name].nbytes

    def path(self, name: str) -> str:
        return self._records[name].path

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self._records.values())

    def names(self) -> list[str]:
        return list(self._records)

    # ------------------------------------------------------------------ I/O
    def read(self, name: str, buf: torch.Tensor, nbytes: int | None = None, *, offset: int = 0) -> IOHandle:
        """Start reading ``nbytes`` of record ``name`` from byte ``offset`` into ``buf`` (a
        contiguous CPU tensor; page-aligned, with aligned ``offset``/``nbytes``, for direct I/O)."""
        return self._submit("read", name, buf, nbytes, offset)

    def write(self, name: str, buf: torch.Tensor, nbytes: int | None = None, *, offset: int = 0) -> IOHandle:
        """Start writing ``nbytes`` of ``buf`` into record ``name`` at byte ``offset``."""
        return self._submit("write", name, buf, nbytes, offset)

    def _submit(self, op: str, name: str, buf: torch.Tensor, nbytes: int | None, offset: int) -> IOHandle:
        if self._closed:
            raise OffloadError(f"swap space {self.dir.path} is closed")
        rec = self._records[name]
        raw = buf.view(torch.uint8).reshape(-1) if buf.dtype != torch.uint8 else buf.reshape(-1)
        if nbytes is None:
            nbytes = min(rec.nbytes - offset, raw.numel())
        elif self.direct:
            nbytes = round_up(nbytes)
        if offset + nbytes > rec.nbytes or nbytes > raw.numel():
            raise OffloadError(
                f"{op} of {nbytes} bytes at {offset} does not fit record {rec.path} ({rec.nbytes} bytes) "
                f"or the buffer ({raw.numel()} bytes)"
            )
        view = _memoryview(raw)
        # One range per thread, block-aligned, so a single record uses every I/O thread.
        blocks = (nbytes + self.block - 1) // self.block
        per = max(1, (blocks + self.threads - 1) // self.threads) * self.block
        ranges = [(start, min(per, nbytes - start)) for start in range(0, nbytes, per)]
        futures = [
            self._pool.submit(self._io_range, op, rec.path, view, start, length, offset) for start, length in ranges
        ]
        if op == "read":
            self.bytes_read += nbytes
        else:
            self.bytes_written += nbytes
        doing = "reading" if op == "read" else "writing"
        handle = IOHandle(futures or [_Completed()], lambda exc: self._os_error(exc, rec.path, doing))
        handle.keep_alive = raw  # the I/O threads write through a raw pointer into this memory
        if not self.overlap:
            handle.wait()  # aio.overlap_events=false: no I/O runs behind the caller's back
        return handle

    def _io_range(self, op: str, path: str, view: memoryview, start: int, length: int, base: int) -> None:
        """``length`` bytes between ``view[start:]`` and the file at ``base + start``."""
        flags = os.O_RDONLY if op == "read" else os.O_WRONLY
        direct = self.direct and base % ALIGN == 0
        try:
            fd = _open(path, flags | (os.O_DIRECT if direct else 0))
        except OSError as exc:
            if direct and exc.errno == errno.EINVAL:
                self._no_direct(path)
                direct = False
                fd = _open(path, flags)
            else:
                raise
        try:
            if op == "read":
                size = os.fstat(fd).st_size
                if size < base + start + length:
                    raise OffloadError(
                        f"swap file {path} is truncated: {size} bytes, expected at least {base + start + length}; "
                        f"something changed it under the running job (another process using {self.dir.nvme_path}?)"
                    )
            call = _preadv if op == "read" else _pwritev
            done = 0
            while done < length:
                pos = start + done
                end = start + length
                if self.single_submit:
                    parts = [view[pos : min(pos + self.block, end)]]
                else:
                    stop = min(pos + self.block * self.queue_depth, end)
                    parts = [view[p : min(p + self.block, stop)] for p in range(pos, stop, self.block)]
                try:
                    n = call(fd, parts, base + pos)
                except OSError as exc:
                    if direct and exc.errno == errno.EINVAL:
                        # The file system accepted O_DIRECT at open but not this request: go buffered.
                        os.close(fd)
                        self._no_direct(path)
                        direct = False
                        fd = _open(path, flags)
                        continue
                    raise
                if n <= 0:
                    raise OffloadError(
                        f"swap file {path} ended at byte {base + pos} while {'reading' if op == 'read' else 'writing'}: "
                        "it was truncated under the running job"
                    )
                done += n
        finally:
            os.close(fd)

    def _no_direct(self, path: str) -> None:
        if self.direct:
            self.direct = False
            logger.info("hf_zero: %s does not support O_DIRECT; swapping with buffered I/O", os.path.dirname(path))

    def _os_error(self, exc: BaseException, path: str, doing: str) -> OffloadError:
        if isinstance(exc, OffloadError):
            return exc
        code = getattr(exc, "errno", None)
        if code == errno.ENOSPC:
            return OffloadError(
                f"{self.setting}={self.dir.nvme_path!r}: the disk is full (ENOSPC) while {doing} swap file {path}; "
                "free space on that disk or point the setting at a larger one"
            )
        if code == errno.ENOENT:
            return OffloadError(
                f"swap file {path} was deleted under the running job while {doing} it ({self.setting}="
                f"{self.dir.nvme_path!r}); make sure no cleanup job or other run uses that folder"
            )
        if code in (errno.EACCES, errno.EPERM, errno.EROFS):
            return OffloadError(
                f"{self.setting}={self.dir.nvme_path!r} is not writable ({os.strerror(code)}) while {doing} {path}"
            )
        if code == errno.EDQUOT:
            return OffloadError(f"{self.setting}={self.dir.nvme_path!r}: disk quota exceeded while {doing} {path}")
        return OffloadError(f"{doing} swap file {path} failed: {type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stop the I/O threads (waiting for queued requests); delete this space's files (and the
        folder when it owns it)."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=False)
        for rec in self._records.values():
            try:
                os.remove(rec.path)
            except OSError:
                pass
        if self.owns_dir:
            self.dir.close()


def wait_all(handles: Iterable[IOHandle | None]) -> None:
    """Wait for every handle; raise the first failure after all have finished."""
    error = None
    for h in handles:
        if h is None:
            continue
        try:
            h.wait()
        except OffloadError as exc:
            error = error or exc
    if error is not None:
        raise error
