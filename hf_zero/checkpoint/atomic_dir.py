"""Replace a directory by a new one without a moment in which neither is there.

A save writes ``checkpoint-N.incomplete/`` and then puts it at ``checkpoint-N``. When
``checkpoint-N`` already exists (a resumed run saving the same step again, a save at the end of
training on a step just saved), deleting it first leaves no checkpoint at all if the process is
killed before the rename. Linux swaps two paths atomically (``renameat2(RENAME_EXCHANGE)``, on
ext4, xfs, btrfs, tmpfs and most local filesystems); where that is not available the old
directory is moved aside to ``<name>.old-<id>`` first and removed after the new one is in, and
:func:`recover_replaced` puts an aside directory back if a crash came between the two renames.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import shutil
import uuid

__all__ = ["ASIDE_MARK", "replace_directory", "recover_replaced"]

logger = logging.getLogger("hf_zero")

ASIDE_MARK = ".old-"
"""``checkpoint-N.old-<id>``: the previous ``checkpoint-N`` while its replacement moves in."""
_ASIDE_RE = re.compile(r"^(?P<name>.+)\.old-[0-9a-f]{12}$")
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> bool:
    """Swap the paths ``a`` and ``b`` in one step; False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):  # not Linux, or a libc older than glibc 2.28
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):  # e.g. NFS, overlay, seccomp
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def _sync_dir(path: str) -> None:
    """Make a rename in ``path`` durable (a power cut after it keeps it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories; the rename itself is done
        pass
    finally:
        os.close(fd)


def replace_directory(new: str, final: str) -> None:
    """Move the directory ``new`` to ``final``, replacing ``final`` if it exists.

    At every instant one complete directory is at ``final`` or, on systems without an atomic swap,
    at ``final.old-<id>`` (which :func:`recover_replaced` restores).

    Example::

        replace_directory("out/checkpoint-500.incomplete", "out/checkpoint-500")
    """
    new, final = os.path.abspath(new), os.path.abspath(final)
    parent = os.path.dirname(final)
    if not os.path.lexists(final):
        os.replace(new, final)
    elif _exchange(new, final):
        shutil.rmtree(new)  # now the old directory
    else:
        aside = f"{final}{ASIDE_MARK}{uuid.uuid4().hex[:12]}"
        os.replace(final, aside)
        os.replace(new, final)
        _sync_dir(parent)
        shutil.rmtree(aside)
    _sync_dir(parent)


def recover_replaced(parent: str) -> list[str]:
    """Finish replacements in ``parent`` that a crash interrupted.

    An aside ``name.old-<id>`` whose ``name`` is missing is moved back (the replacement never
    arrived); one whose ``name`` exists is removed (the replacement is in).

    Returns:
        The directories moved back.
    """
    if not os.path.isdir(parent):
        return []
    restored: list[str] = []
    for entry in sorted(os.listdir(parent)):
        match = _ASIDE_RE.match(entry)
        if match is None or not os.path.isdir(os.path.join(parent, entry)):
            continue
        aside, final = os.path.join(parent, entry), os.path.join(parent, match["name"])
        try:
            if os.path.lexists(final):
                shutil.rmtree(aside)
            else:
                os.replace(aside, final)
                restored.append(final)
                logger.warning("hf_zero: restored %s, which an interrupted save had moved aside", final)
        except FileNotFoundError:  # another rank of the same job got there first
            continue
    return restored
