"""Ending the process group hf_zero created, at interpreter exit, so that scripts exit with status 0.

Why this exists: a gloo backend's worker threads (``pt_gloo_runloop``) are stopped only by its C++
destructor, and ``destroy_process_group()`` does not run that while anything still references the
group. torch itself keeps such references: functions defined with ``group=dist.group.WORLD``
(``ZeroRedundancyOptimizer``'s ``_broadcast_object``) capture the group when their module is imported
after the group exists, and a ``DeviceMesh`` kept by DTensor's sharding caches holds its groups in
``_pg_registry``; a model or engine the user keeps in a module global holds them too. The worker
threads then live into interpreter finalization. A worker that is still dropping its last
asynchronous collective at that moment (ZeRO-1's parameter broadcasts, FSDP's all-gathers) frees
tensors that have Python objects, so it takes the GIL; CPython (3.11 here) ends a thread that takes
the GIL during finalization with ``pthread_exit``, whose unwinding through a ``noexcept`` destructor
calls ``std::terminate``: "terminate called without an active exception", SIGABRT, and torchrun
reports the job as failed (a core dump shows exactly that stack). On 2 CPU cores it hit 4 of 20
two-rank launches run two at a time, mostly at stage 1 (``tests/distributed/test_clean_exit.py``).

:func:`teardown` runs as an ``atexit`` handler registered when hf_zero creates the group, so it runs
after the handlers the user registered later, while the interpreter still works. It

1. closes hf_zero's live engines (their offload threads, hooks and swap files);
2. destroys every process group;
3. drops the references torch keeps to destroyed groups (the captured default arguments, mesh
   registries) and collects garbage, so the groups' destructors run now and join their threads
   (the binding releases the GIL while it does, so a worker that needs it can finish);
4. waits until every gloo worker thread that is still alive (its group is referenced by an object
   the user keeps) is parked on its work queue, so none of them takes the GIL again.

A group someone else made (accelerate's, when a Trainer script runs under a plain ``torchrun``)
is not hf_zero's to destroy: :func:`quiesce`, registered when hf_zero finds such a group, runs steps
1 and 4 only.

Nothing here calls ``os._exit``: the script's exit status, the remaining ``atexit`` handlers
(``logging``'s flush among them) and the interpreter's own clean-up are kept.
"""

from __future__ import annotations

import atexit
import gc
import os
import platform
import sys
import threading
import time
import types
import weakref
from typing import Protocol

import torch.distributed as dist

__all__ = ["close_at_exit", "quiesce", "register_exit_quiesce", "register_exit_teardown", "teardown",
           "wait_for_idle_gloo_workers"]

_GLOO_WORKER_NAME = "pt_gloo_runloop"
"""What torch names a gloo backend's worker threads (``/proc/<pid>/task/<tid>/comm``)."""

_FUTEX_SYSCALL = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
"""The ``futex`` system call number, to read a blocked thread's wait from ``/proc/.../syscall``."""

_FUTEX_WAIT_BITSET = 9
"""The futex command ``pthread_cond_wait`` uses; with no timeout it is an idle condition wait."""

_IDLE_POLL_S = 0.002
_IDLE_ROUNDS = 3  # consecutive all-idle observations, the GIL released in between
_IDLE_TIMEOUT_S = 5.0


class _Closable(Protocol):
    def close(self) -> None: ...


_OWNED: weakref.WeakSet = weakref.WeakSet()
_REGISTERED = False
_QUIESCE_REGISTERED = False
_REGISTER_LOCK = threading.Lock()


def close_at_exit(obj: _Closable) -> None:
    """Have :func:`teardown` call ``obj.close()`` (e.g. a :class:`ZeroEngine`: its offload threads)
    before the groups are destroyed; held weakly, so this keeps nothing alive."""
    _OWNED.add(obj)


def register_exit_teardown() -> None:
    """Run :func:`teardown` at interpreter exit (once, however often this is called).

    Call it right after creating the group: ``atexit`` runs handlers last-in first-out, so the
    user's own handlers registered after this one (which may still use the group) run first.
    """
    global _REGISTERED
    with _REGISTER_LOCK:
        if not _REGISTERED:
            _REGISTERED = True
            atexit.register(teardown)


def register_exit_quiesce() -> None:
    """Run :func:`quiesce` at interpreter exit (once): for a group someone else made (accelerate
    under a plain ``torchrun`` launch of a Trainer script, the user), which hf_zero does not
    destroy. A no-op where :func:`register_exit_teardown` already ran (the teardown does more)."""
    global _QUIESCE_REGISTERED
    with _REGISTER_LOCK:
        if not _QUIESCE_REGISTERED and not _REGISTERED:
            _QUIESCE_REGISTERED = True
            atexit.register(quiesce)


def quiesce(idle_timeout_s: float = _IDLE_TIMEOUT_S) -> None:
    """Close hf_zero's engines (their offload threads) and wait until every gloo worker thread is
    parked on its work queue, leaving the groups to whoever made them: steps 1 and 4 of
    :func:`teardown`, the ones that keep a worker from taking the GIL during finalization."""
    if _REGISTERED:  # the full teardown runs (or ran) instead
        return
    _close_owned()
    wait_for_idle_gloo_workers(idle_timeout_s)


def _close_owned() -> None:
    for obj in list(_OWNED):
        try:
            obj.close()
        except Exception:
            pass
    _OWNED.clear()


def teardown(idle_timeout_s: float = _IDLE_TIMEOUT_S) -> None:
    """Close hf_zero's engines, destroy the process groups and make sure no gloo worker thread
    is left mid-work; safe to call more than once and when no group exists.

    Every step is guarded: at exit, a step that fails must not keep the next ones from running
    (nor change the script's exit status).
    """
    _close_owned()
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a peer may already be gone; there is nothing left to agree on
            pass
    if dist.is_available() and not dist.is_initialized():
        # No group is alive any more, so every group object still referenced is a stale one.
        try:
            _drop_stale_group_references()
        except Exception:
            pass
        gc.collect()  # the groups' destructors join their worker threads now
    wait_for_idle_gloo_workers(idle_timeout_s)


# ------------------------------------------------------------------------------ stale references
def _is_group(obj: object) -> bool:
    # By type, not isinstance(): no __class__ lookups on whatever else a default may be.
    return issubclass(type(obj), dist.ProcessGroup)


def _drop_stale_group_references() -> None:
    """Forget destroyed groups where torch keeps them beyond ``destroy_process_group()``."""
    _scrub_default_arguments()
    _clear_mesh_registries()


def _scrub_default_arguments() -> None:
    """Replace groups captured as default arguments in ``torch.distributed`` modules by None.

    ``def f(group=dist.group.WORLD)`` evaluates ``WORLD`` when the module is imported; imported
    after the group was created (as hf_zero imports ``ZeroRedundancyOptimizer``), the function
    keeps the group alive for good. None is what such a default holds when imported earlier.
    """
    # Types are compared with type(), never isinstance(): isinstance() looks up __class__, which
    # some module attributes answer with a deprecation warning (torch.distributed.reduce_op).
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torch.distributed"):
            continue
        for value in list(vars(module).values()):
            if type(value) is types.FunctionType:
                _scrub_function(value)
            elif issubclass(type(value), type) and value.__module__ == name:
                for attr in list(vars(value).values()):
                    if type(attr) in (staticmethod, classmethod):
                        attr = attr.__func__
                    if type(attr) is types.FunctionType:
                        _scrub_function(attr)


def _scrub_function(func: types.FunctionType) -> None:
    defaults = func.__defaults__
    if defaults and any(_is_group(d) for d in defaults):
        func.__defaults__ = tuple(None if _is_group(d) else d for d in defaults)
    kwdefaults = func.__kwdefaults__
    if kwdefaults and any(_is_group(d) for d in kwdefaults.values()):
        func.__kwdefaults__ = {k: None if _is_group(d) else d for k, d in kwdefaults.items()}


def _clear_mesh_registries() -> None:
    """Empty the group registry of every live ``DeviceMesh``: DTensor's sharding-propagation
    caches keep meshes (and so, through ``_pg_registry``, their groups) alive after training."""
    mesh_module = sys.modules.get("torch.distributed.device_mesh")
    mesh_cls = getattr(mesh_module, "DeviceMesh", None)
    if not isinstance(mesh_cls, type):
        return  # no mesh was ever made in this process
    for obj in gc.get_objects():
        if issubclass(type(obj), mesh_cls):
            registry = getattr(obj, "_pg_registry", None)
            if isinstance(registry, dict):
                registry.clear()


# ------------------------------------------------------------------------------ worker threads
def wait_for_idle_gloo_workers(timeout_s: float = _IDLE_TIMEOUT_S) -> bool:
    """Wait (the GIL released) until every live gloo worker thread is parked on its work queue.

    A worker finishing a collective frees the work's tensors and may need the GIL for that; once
    it waits on its queue's condition variable with no timeout, it runs no more code until new
    work arrives or its group's destructor stops it, neither of which needs Python. A thread
    waiting for the GIL waits with a timeout, so it does not count as parked. Returns True when all
    are parked (or there are none), False on timeout or where threads cannot be inspected (then
    the wait was a plain pause that let threads waiting for the GIL take it).
    """
    deadline = time.monotonic() + timeout_s
    rounds = 0
    while True:
        states = _gloo_worker_states()
        if states is None:
            time.sleep(min(0.05, timeout_s))
            return False
        if not states:
            return True  # every group's destructor has joined its threads
        rounds = rounds + 1 if all(states) else 0
        if rounds >= _IDLE_ROUNDS:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_IDLE_POLL_S)  # releases the GIL: a worker waiting for it gets it now


def _gloo_worker_states() -> list[bool] | None:
    """For each live gloo worker thread, whether it is parked (waiting for nothing but new work);
    None where ``/proc`` cannot tell (not Linux, or the files are unreadable)."""
    task_dir = "/proc/self/task"
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return None
    futex = _FUTEX_SYSCALL.get(platform.machine().lower())
    states = []
    for tid in tids:
        base = f"{task_dir}/{tid}"
        try:
            with open(f"{base}/comm", encoding="utf-8") as f:
                if f.read().strip() != _GLOO_WORKER_NAME:
                    continue
            with open(f"{base}/stat", encoding="utf-8") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if state != "S":
                states.append(False)  # running, runnable, or in uninterruptible I/O
                continue
            if futex is None:
                states.append(True)  # unknown architecture: sleeping is the best sign there is
                continue
            with open(f"{base}/syscall", encoding="utf-8") as f:
                fields = f.read().split()
        except FileNotFoundError:
            continue  # the thread ended between listing and reading
        except (OSError, IndexError):
            return None
        states.append(_is_untimed_condition_wait(fields, futex))
    return states


def _is_untimed_condition_wait(fields: list[str], futex: int) -> bool:
    """Whether ``/proc/<tid>/syscall`` shows ``futex(addr, FUTEX_WAIT_BITSET, val, NULL, ...)``:
    the idle ``condition_variable::wait`` of the worker loop, not a GIL wait (which has a timeout)
    and not a mutex wait held up by another worker."""
    try:
        if int(fields[0]) != futex:
            return False
        op, timeout = int(fields[2], 16), int(fields[4], 16)
    except (IndexError, ValueError):
        return False
    return (op & 0x7F) == _FUTEX_WAIT_BITSET and timeout == 0
