"""The NVMe swap layer on its own: folders, buffers, threaded I/O and its faults (one process)."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from _swap_owner import start_swap_owner

from hf_zero.config.schema import AioConfig
from hf_zero.offload import nvme
from hf_zero.offload.base import OffloadError
from hf_zero.offload.nvme import (
    ALIGN,
    BufferPool,
    SwapDir,
    SwapSpace,
    new_run_id,
    remove_stale_dirs,
)

SETTING = "zero_optimization.offload_optimizer.nvme_path"


def make_space(path, aio: AioConfig | None = None, *, direct: bool = True) -> SwapSpace:
    swap_dir = SwapDir(str(path), new_run_id(), 0, SETTING)
    return SwapSpace(swap_dir, aio or AioConfig(block_size=8192, thread_count=2), SETTING, direct=direct, owns_dir=True)


def random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


AIO_VARIANTS = [
    AioConfig(block_size=4096, queue_depth=1, single_submit=True, thread_count=1, overlap_events=False),
    AioConfig(block_size=8192, queue_depth=4, single_submit=False, thread_count=3, overlap_events=True),
    AioConfig(block_size=1_048_576, queue_depth=8, single_submit=False, thread_count=2, overlap_events=True),
]


@pytest.mark.parametrize("aio", AIO_VARIANTS, ids=["single-sync", "batched-3threads", "1MiB-blocks"])
@pytest.mark.parametrize("direct", [True, False], ids=["odirect", "buffered"])
def test_round_trip(tmp_path, aio, direct):
    space = make_space(tmp_path, aio, direct=direct)
    pool = BufferPool(2, 100_000, pin=False, setting="pin")
    space.create("rec", 100_000)
    out, back = pool.acquire(), pool.acquire()
    out.copy_(random_bytes(out.numel()))
    space.write("rec", out).wait()
    back.zero_()
    space.read("rec", back).wait()
    assert torch.equal(out, back)
    assert os.path.getsize(space.path("rec")) == space.size("rec") == nvme.round_up(100_000)
    space.close()
    assert not os.path.exists(space.dir.path)


def test_unaligned_region_io_into_any_tensor(tmp_path):
    space = make_space(tmp_path, direct=False)
    space.create("unit", 1000)
    values = torch.randn(7).to(torch.bfloat16)
    space.write("unit", values, values.numel() * 2, offset=6).wait()
    back = torch.zeros(7, dtype=torch.bfloat16)
    space.read("unit", back, 14, offset=6).wait()
    assert torch.equal(back, values)
    # The I/O goes through raw pointers, so the tensors' storages stay resizable (parameter
    # swapping frees shard storage by resizing it to 0 bytes).
    assert back.untyped_storage().resizable()
    space.close()


def test_buffer_pool_hands_out_aligned_buffers_and_blocks_when_empty():
    pool = BufferPool(2, 5000, pin=False, setting="pin")
    assert pool.nbytes == 8192 and pool.total_bytes == 2 * 8192
    a, b = pool.acquire(), pool.acquire()
    assert a.data_ptr() % ALIGN == 0 and b.data_ptr() % ALIGN == 0 and a.data_ptr() != b.data_ptr()
    with pytest.raises(OffloadError, match="no swap buffer came back"):
        pool.acquire(timeout=0.05)
    pool.release(a)
    pool.release(a)  # twice is harmless
    assert pool.available() == 1
    assert pool.acquire(timeout=0.05) is a


def test_aio_queue_depth_and_single_submit_shape_the_system_calls(tmp_path, monkeypatch):
    calls = []
    real = os.pwritev

    def counting(fd, buffers, offset):
        calls.append(len(buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(nvme, "_pwritev", counting)
    data = random_bytes(16 * 4096)
    for single, depth, expected in ((True, 8, [1] * 16), (False, 4, [4] * 4), (False, 16, [16])):
        calls.clear()
        aio = AioConfig(block_size=4096, queue_depth=depth, single_submit=single, thread_count=1)
        space = make_space(tmp_path, aio, direct=False)
        space.create("rec", data.numel())
        space.write("rec", data).wait()
        assert calls == expected
        space.close()


def test_overlap_events_false_completes_before_returning(tmp_path):
    space = make_space(tmp_path, AioConfig(block_size=4096, thread_count=2, overlap_events=False))
    space.create("rec", 64 * 4096)
    handle = space.write("rec", random_bytes(64 * 4096))
    assert handle.done()
    space.close()


def test_disk_full_while_writing_names_the_file_and_setting(tmp_path, monkeypatch):
    space = make_space(tmp_path)
    space.create("rec", 3 * 4096)

    def full(fd, buffers, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(nvme, "_pwritev", full)
    with pytest.raises(OffloadError) as info:
        space.write("rec", random_bytes(3 * 4096)).wait()
    message = str(info.value)
    assert "disk is full (ENOSPC)" in message and space.path("rec") in message and SETTING in message
    space.close()


def test_disk_too_small_fails_at_start(tmp_path, monkeypatch):
    space = make_space(tmp_path)
    monkeypatch.setattr(nvme.shutil, "disk_usage", lambda path: SimpleNamespace(free=2**30))
    with pytest.raises(OffloadError, match=r"need 10\.00 GiB but the disk has 1\.00 GiB free") as info:
        space.check_free_space(10 * 2**30)
    assert SETTING in str(info.value)

    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(nvme.os, "posix_fallocate", no_room)
    with pytest.raises(OffloadError, match="disk is full"):
        space.create("big", 1 << 20)
    space.close()


def test_truncated_swap_file(tmp_path):
    space = make_space(tmp_path)
    space.create("rec", 4 * 4096)
    space.write("rec", random_bytes(4 * 4096)).wait()
    os.truncate(space.path("rec"), 100)
    with pytest.raises(OffloadError, match="is truncated") as info:
        space.read("rec", torch.zeros(4 * 4096, dtype=torch.uint8)).wait()
    assert space.path("rec") in str(info.value)
    space.close()


def test_deleted_swap_file(tmp_path):
    space = make_space(tmp_path)
    space.create("rec", 4096)
    os.remove(space.path("rec"))
    with pytest.raises(OffloadError, match="was deleted under the running job") as info:
        space.read("rec", torch.zeros(4096, dtype=torch.uint8)).wait()
    assert space.path("rec") in str(info.value) and SETTING in str(info.value)
    space.close()


def test_missing_path_and_file_path(tmp_path):
    with pytest.raises(OffloadError, match="does not exist") as info:
        SwapDir(str(tmp_path / "nope"), new_run_id(), 0, SETTING)
    assert SETTING in str(info.value) and "nope" in str(info.value)
    (tmp_path / "file").write_text("x")
    with pytest.raises(OffloadError, match="is not a folder"):
        SwapDir(str(tmp_path / "file"), new_run_id(), 0, SETTING)


def test_unwritable_path(tmp_path, monkeypatch):
    def denied(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(nvme.os, "makedirs", denied)
    with pytest.raises(OffloadError, match="is not writable") as info:
        SwapDir(str(tmp_path), new_run_id(), 0, SETTING)
    assert SETTING in str(info.value) and str(tmp_path) in str(info.value)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs procfs")
def test_folder_no_one_can_write_even_root():
    # procfs refuses new entries for every user, so this runs where CI runs as root.
    with pytest.raises(OffloadError, match="is not writable") as info:
        SwapDir("/proc", new_run_id(), 0, SETTING)
    assert SETTING in str(info.value) and "'/proc'" in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(OffloadError, match="is not writable"):
            SwapDir(str(ro), new_run_id(), 0, SETTING)
    finally:
        ro.chmod(0o700)


def test_runs_get_their_own_folders_and_close_removes_them(tmp_path):
    a = SwapDir(str(tmp_path), new_run_id(), 0, SETTING)
    b = SwapDir(str(tmp_path), new_run_id(), 0, SETTING)
    a1 = SwapDir(str(tmp_path), os.path.basename(a.run_dir).removeprefix("hf_zero-"), 1, SETTING)
    assert a.run_dir != b.run_dir and a1.run_dir == a.run_dir
    assert a.path.endswith("rank0") and a1.path.endswith("rank1")
    a.close()
    assert not os.path.exists(a.path) and os.path.exists(a.run_dir)  # rank 1 still there
    a1.close()
    assert not os.path.exists(a.run_dir)
    nvme._cleanup_live_dirs()  # what atexit runs
    assert os.listdir(tmp_path) == []


def test_stale_folders_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead_pid = int(dead.stdout)
    for name, host, pid in (("dead", socket.gethostname(), dead_pid), ("alive", socket.gethostname(), os.getpid()),
                            ("elsewhere", "another-host", dead_pid)):
        rank_dir = tmp_path / f"hf_zero-{name}" / "rank0"
        rank_dir.mkdir(parents=True)
        (rank_dir / nvme.OWNER_FILE).write_text(json.dumps({"host": host, "pid": pid}))
    removed = remove_stale_dirs(str(tmp_path))
    assert [os.path.basename(r) for r in removed] == ["hf_zero-dead"]
    assert sorted(os.listdir(tmp_path)) == ["hf_zero-alive", "hf_zero-elsewhere"]


def test_sigterm_removes_the_folder(tmp_path):
    proc, path = start_swap_owner(tmp_path)
    assert os.path.isdir(path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM  # still dies of the signal
    assert os.listdir(tmp_path) == []


def test_exception_exit_removes_the_folder(tmp_path):
    script = textwrap.dedent(f"""
        from hf_zero.offload.nvme import SwapDir, new_run_id
        d = SwapDir({str(tmp_path)!r}, new_run_id(), 0, "s")
        raise RuntimeError("training failed")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1 and "training failed" in proc.stderr
    assert os.listdir(tmp_path) == []


def test_an_unclosed_folder_goes_when_its_owner_is_collected(tmp_path):
    import gc

    d = SwapDir(str(tmp_path), new_run_id(), 0, SETTING)
    path = d.path
    del d
    gc.collect()
    assert not os.path.exists(path) and os.listdir(tmp_path) == []
