"""Who owns a swap folder: a lock its owner holds for its whole life.

A rank's swap folder holds ``owner.lock``, locked with ``flock(LOCK_EX)`` by the process that made
the folder until it exits, and ``owner.json`` (host, pid, rank, time: for people reading the
folder). Another process may take the folder for abandoned only when it can lock ``owner.lock``
itself: the kernel drops a process's ``flock`` locks when it dies, however it dies (SIGKILL
included), and the lock is shared by every process using that file system on this machine, whatever
PID namespace it runs in. A pid says nothing across PID namespaces: two containers that share a
hostname and ``nvme_path`` each see the other's pids as dead (or as some unrelated live process),
and deciding by pid they deleted each other's live folders.

The owner takes the lock before it writes ``owner.json``, so a folder with ``owner.json`` whose lock
is free has lost its owner, and a folder without ``owner.json`` is still being made. Folders from
hf_zero versions without a lock file are judged by their pid, as those versions did.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

__all__ = ["LOCK_FILE", "OWNER_FILE", "claim", "release", "take_if_abandoned"]

OWNER_FILE = "owner.json"
LOCK_FILE = "owner.lock"


def claim(folder: str, rank: int) -> int:
    """Make this process the owner of ``folder`` (just created by it) for as long as it lives.

    Returns the lock's file descriptor; keep it open (closing it gives the folder up) and pass it
    to :func:`release` once the folder is removed.

    Raises:
        OSError: the lock or owner file cannot be written.
    """
    # Not inherited by programs this process starts: a launched helper that outlives us must not
    # keep our folder looking owned. (Forked children share it until they exit, which is right:
    # they may still use the folder.)
    fd = os.open(os.path.join(folder, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        # Blocking: a process checking this folder for staleness holds the lock for a moment only
        # (it finds no owner.json yet and leaves the folder alone).
        fcntl.flock(fd, fcntl.LOCK_EX)
        with open(os.path.join(folder, OWNER_FILE), "w", encoding="utf-8") as f:
            json.dump({"host": socket.gethostname(), "pid": os.getpid(), "rank": rank,
                       "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, f)
    except BaseException:
        os.close(fd)
        raise
    return fd


def release(fd: int | None) -> None:
    """Give up a folder's lock (closing the descriptor drops the ``flock``); None is ignored."""
    if fd is None:
        return
    try:
        os.close(fd)
    except OSError:
        pass


def take_if_abandoned(folder: str, host: str) -> tuple[bool, int | None]:
    """Whether ``folder`` (a rank's swap folder of *this* host) has lost its owner.

    Returns ``(abandoned, fd)``: when abandoned and the folder has a lock file, ``fd`` holds its
    lock, so that no one can claim the folder while the caller removes it; :func:`release` it
    after. Folders of other hosts are never abandoned (a network file system may not share
    locks between machines), nor are folders still being made (no ``owner.json`` yet).
    """
    try:
        with open(os.path.join(folder, OWNER_FILE), encoding="utf-8") as f:
            owner = json.load(f)
    except (OSError, ValueError):
        return False, None  # being made right now, or not ours: leave it
    if not isinstance(owner, dict) or owner.get("host") != host:
        return False, None
    try:
        fd = os.open(os.path.join(folder, LOCK_FILE), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        # Made by an hf_zero without lock files: only its pid can tell.
        return not _pid_alive(int(owner.get("pid", 0) or 0)), None
    except OSError:
        return False, None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        # EWOULDBLOCK: its owner is alive, in this PID namespace or another. Any other error: the
        # lock cannot be checked here, so the owner is assumed alive too.
        os.close(fd)
        return False, None
    return True, fd


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
