"""How much host memory this process may still take: the container's (cgroup's) limit and usage,
and the kernel's ``MemAvailable``.

Used by ``hf-zero env`` (reported) and by the offload backends before they pin memory: pinned
(page-locked) memory is charged to the cgroup, and a container that goes over ``memory.max`` is
OOM-killed (SIGKILL, nothing to catch) instead of getting an error, so the headroom has to be
checked before the allocation, not after.
"""

from __future__ import annotations

import os

__all__ = ["NO_LIMIT_BYTES", "CgroupMemory", "cgroup_memory", "host_headroom", "parse_cgroup_limit",
           "parse_meminfo", "parse_proc_self_cgroup"]

NO_LIMIT_BYTES = 2**62  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1

# (root, /proc/self/cgroup key, limit file, usage file) for cgroup v2, then v1's memory controller.
_HIERARCHIES = (("/sys/fs/cgroup", "v2", "memory.max", "memory.current"),
                ("/sys/fs/cgroup/memory", "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"))


def parse_meminfo(text: str) -> dict[str, int]:
    """``/proc/meminfo`` text as ``{field: value}``: ``kB`` values in bytes, unit-less counts as is."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        parts = rest.split()
        if sep and parts and parts[0].isdigit():
            out[name.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return out


def parse_cgroup_limit(text: str) -> int | None:
    """A cgroup memory limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``) in bytes, or ``None``
    for no limit (``max``, or v1's huge sentinel). Raises ``ValueError`` for anything else."""
    value = text.strip()
    if value == "max":
        return None
    limit = int(value)
    return None if limit >= NO_LIMIT_BYTES else limit


def parse_proc_self_cgroup(text: str) -> dict[str, str]:
    """``/proc/self/cgroup`` as ``{"v2": path, "memory": path}`` for the hierarchies present
    (``0::/path`` is cgroup v2; ``N:...memory...:/path`` is the v1 memory controller)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) == 3 and parts[0] == "0" and parts[1] == "":
            out["v2"] = parts[2]
        elif len(parts) == 3 and "memory" in parts[1].split(","):
            out["memory"] = parts[2]
    return out


class CgroupMemory(tuple):
    """``(limit, usage, source)``: the tightest limit in bytes (None: none), the usage of the
    cgroup that sets it (None when unreadable), and the limit's file."""

    __slots__ = ()

    def __new__(cls, limit: int | None, usage: int | None, source: str):
        return super().__new__(cls, (limit, usage, source))

    limit = property(lambda self: self[0])
    usage = property(lambda self: self[1])
    source = property(lambda self: self[2])


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def cgroup_memory(root: str = "") -> CgroupMemory:
    """The tightest memory limit on this process's cgroup and its ancestors (v2, else v1), with
    that cgroup's current usage: schedulers (Slurm, Kubernetes) often limit a parent and leave the
    leaf at ``max``. ``root`` prefixes every path (tests point it at a fake tree).

    Raises:
        FileNotFoundError: no cgroup memory controller is visible.
    """
    own = parse_proc_self_cgroup(_read(root + "/proc/self/cgroup"))
    for base, key, limit_name, usage_name in _HIERARCHIES:
        parts = [p for p in own.get(key, "/").split("/") if p]
        dirs = [os.path.join(root + base, *parts[:k]) for k in range(len(parts), -1, -1)]
        found = [(parse_cgroup_limit(_read(os.path.join(d, limit_name))), d)
                 for d in dirs if os.path.isfile(os.path.join(d, limit_name))]
        if not found:
            continue
        limited = [(limit, d) for limit, d in found if limit is not None]
        if not limited:
            return CgroupMemory(None, None, os.path.join(found[0][1], limit_name))
        limit, where = min(limited)
        try:
            usage = int(_read(os.path.join(where, usage_name)).strip())
        except (OSError, ValueError):
            usage = None
        return CgroupMemory(limit, usage, os.path.join(where, limit_name))
    raise FileNotFoundError("no cgroup memory.max or memory.limit_in_bytes")


def host_headroom(root: str = "") -> tuple[int | None, str]:
    """Bytes this process can still allocate before the kernel or the container stops it, and
    what bounds it: the smaller of ``MemAvailable`` and the cgroup's limit minus its usage.
    ``(None, reason)`` when neither can be read."""
    bounds: list[tuple[int, str]] = []
    try:
        info = parse_meminfo(_read(root + "/proc/meminfo"))
        if "MemAvailable" in info:
            bounds.append((info["MemAvailable"], "MemAvailable in /proc/meminfo"))
    except OSError:
        pass
    try:
        cg = cgroup_memory(root)
        if cg.limit is not None and cg.usage is not None:
            bounds.append((max(0, cg.limit - cg.usage), f"the container's memory limit minus its usage ({cg.source})"))
    except (OSError, ValueError):
        pass
    if not bounds:
        return None, "neither /proc/meminfo nor a cgroup memory limit is readable"
    return min(bounds)
