"""Swap folders belong to whoever holds their lock, not to whatever their pid looks like from here.

Two containers that share a hostname and ``nvme_path`` but not a PID namespace see each other's
pids as dead (or as some unrelated live process). These tests give a folder such an owner record
while its lock is held by a live process, and check which folders a second run removes.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import stat
import subprocess

import pytest

from _swap_owner import start_swap_owner

from hf_zero.offload import nvme
from hf_zero.offload.nvme import SwapDir, new_run_id, remove_stale_dirs
from hf_zero.offload.swap_ownership import LOCK_FILE, OWNER_FILE

SETTING = "zero_optimization.offload_optimizer.nvme_path"


def dead_pid() -> int:
    """A pid that no process has any more (a child that already exited and was reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def pretend_owner_pid(swap_dir: SwapDir, pid: int) -> None:
    """Rewrite the owner record as the other container would have written it: same host, a pid
    from its own PID namespace."""
    path = os.path.join(swap_dir.path, OWNER_FILE)
    with open(path, encoding="utf-8") as f:
        owner = json.load(f)
    owner["pid"] = pid
    with open(path, "w", encoding="utf-8") as f:
        json.dump(owner, f)


@pytest.mark.parametrize("pid_seen", ["dead", "unrelated-alive"])
def test_a_live_owner_keeps_its_folder_whatever_its_pid_looks_like(tmp_path, pid_seen):
    other = SwapDir(str(tmp_path), new_run_id(), 0, SETTING)  # holds its lock, as a live run does
    pretend_owner_pid(other, dead_pid() if pid_seen == "dead" else 1)

    mine = SwapDir(str(tmp_path), new_run_id(), 0, SETTING)  # removes stale folders at start

    assert os.path.isdir(other.path), "a second run removed a live run's swap folder"
    assert remove_stale_dirs(str(tmp_path)) == []
    other.close()
    mine.close()
    assert os.listdir(tmp_path) == []


def test_a_lock_held_through_another_open_file_keeps_the_folder(tmp_path):
    # flock locks belong to an open file description: a second open() of the lock file, locked,
    # stands for the owner in another PID namespace. The folder record says its pid is dead.
    run = tmp_path / "hf_zero-elsewhere" / "rank0"
    run.mkdir(parents=True)
    (run / OWNER_FILE).write_text(json.dumps({"host": nvme.socket.gethostname(), "pid": dead_pid()}))
    fd = os.open(run / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert remove_stale_dirs(str(tmp_path)) == []
        assert run.is_dir()
    finally:
        os.close(fd)  # the owner is gone: the kernel drops its lock
    assert [os.path.basename(p) for p in remove_stale_dirs(str(tmp_path))] == ["hf_zero-elsewhere"]
    assert os.listdir(tmp_path) == []


def test_a_free_lock_means_the_owner_is_gone_even_if_its_pid_looks_alive(tmp_path):
    run = tmp_path / "hf_zero-crashed" / "rank0"
    run.mkdir(parents=True)
    (run / OWNER_FILE).write_text(json.dumps({"host": nvme.socket.gethostname(), "pid": os.getpid()}))
    (run / LOCK_FILE).touch()  # nobody holds it
    assert [os.path.basename(p) for p in remove_stale_dirs(str(tmp_path))] == ["hf_zero-crashed"]


def test_folders_being_made_and_of_other_hosts_are_left_alone(tmp_path):
    making = tmp_path / "hf_zero-making" / "rank0"
    making.mkdir(parents=True)
    (making / LOCK_FILE).touch()  # the owner locks before it writes owner.json: not written yet
    elsewhere = tmp_path / "hf_zero-elsewhere" / "rank0"
    elsewhere.mkdir(parents=True)
    (elsewhere / OWNER_FILE).write_text(json.dumps({"host": "another-host", "pid": dead_pid()}))
    (elsewhere / LOCK_FILE).touch()  # locks may not reach across a network file system
    assert remove_stale_dirs(str(tmp_path)) == []
    assert sorted(os.listdir(tmp_path)) == ["hf_zero-elsewhere", "hf_zero-making"]


def test_a_run_with_one_live_rank_is_kept_whole(tmp_path):
    run_id = new_run_id()
    live = SwapDir(str(tmp_path), run_id, 1, SETTING)
    pretend_owner_pid(live, dead_pid())
    crashed = tmp_path / f"hf_zero-{run_id}" / "rank0"  # rank 0's process died: its lock is free
    crashed.mkdir()
    (crashed / OWNER_FILE).write_text(json.dumps({"host": nvme.socket.gethostname(), "pid": dead_pid()}))
    (crashed / LOCK_FILE).touch()
    assert remove_stale_dirs(str(tmp_path)) == [] and os.path.isdir(live.path)
    live.close()
    assert remove_stale_dirs(str(tmp_path)) == [live.run_dir]
    assert os.listdir(tmp_path) == []


def test_swap_folders_are_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        d = SwapDir(str(tmp_path), new_run_id(), 0, SETTING)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(d.run_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(d.path).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(d.path, LOCK_FILE)).st_mode) & 0o077 == 0
    d.close()


def test_a_killed_owner_process_leaves_a_folder_the_next_run_removes(tmp_path):
    # A real second process: while it lives (its pid rewritten to look dead), its folder stays;
    # once SIGKILLed (no clean-up runs), the kernel drops its lock and the next run removes it.
    proc, path = start_swap_owner(tmp_path)
    try:
        owner = os.path.join(path, OWNER_FILE)
        record = json.loads(open(owner, encoding="utf-8").read())
        record["pid"] = dead_pid()
        with open(owner, "w", encoding="utf-8") as f:
            json.dump(record, f)
        assert remove_stale_dirs(str(tmp_path)) == [] and os.path.isdir(path)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert remove_stale_dirs(str(tmp_path)) == [os.path.dirname(path)]
    assert os.listdir(tmp_path) == []
