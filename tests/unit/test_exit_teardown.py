"""The exit teardown (hf_zero/distributed/teardown.py) in one process: what it ends and how it
recognises gloo worker threads that can no longer touch Python.

Each case runs in a fresh interpreter, since it creates and destroys the default process group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hf_zero.distributed import teardown

REPO = Path(__file__).resolve().parents[2]

needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads threads from /proc")
# torch names gloo's worker threads "pt_gloo_runloop" since pytorch#169979 (Dec 2025): 2.11 does,
# 2.9 leaves them unnamed, so there the teardown cannot tell them apart (docs/versions.md).
names_gloo_threads = pytest.mark.skipif(
    torch.torch_version.TorchVersion(torch.__version__) < (2, 10),
    reason="this torch does not name its gloo worker threads (pt_gloo_runloop)")

_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    from hf_zero.distributed.env import init_distributed
    from hf_zero.distributed import teardown

    def gloo_workers():
        return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "pt_gloo_runloop"
                   for t in os.listdir("/proc/self/task"))

    init_distributed()  # one process, on an in-memory store
    # What keeps a destroyed group alive in torch: a default argument evaluated after the group
    # exists (ZeroRedundancyOptimizer's _broadcast_object), and a DeviceMesh that DTensor's
    # sharding caches keep. Then an asynchronous collective, as ZeRO-1 and FSDP run them.
    import torch.distributed.optim.zero_redundancy_optimizer as zero
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (1,))
    (distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]) * 2).sum()
    dist.broadcast(torch.ones(3), 0, async_op=True).wait()
    del mesh
    keep = dist.group.WORLD if sys.argv[1] == "user-keeps-group" else None
    before = gloo_workers()
    teardown.teardown()
    print(json.dumps({"before": before, "after": gloo_workers(), "initialized": dist.is_initialized(),
                      "default_scrubbed": zero._broadcast_object.__defaults__[0] is None,
                      "parked": teardown.wait_for_idle_gloo_workers(1.0)}))
""")


def _run(case: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # a one-process group, whatever launched the tests
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, case], capture_output=True, text=True, timeout=120,
                          env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_proc
@names_gloo_threads
def test_teardown_ends_the_group_and_joins_its_threads():
    result = _run("script-keeps-nothing")
    assert result["before"] >= 1
    assert not result["initialized"] and result["default_scrubbed"]
    # destroy_process_group() alone leaves these threads running into interpreter finalization.
    assert result["after"] == 0


@needs_proc
@names_gloo_threads
def test_threads_of_a_group_the_user_keeps_are_found_parked():
    result = _run("user-keeps-group")
    assert result["after"] >= 1  # still referenced: its threads live on...
    assert result["parked"]  # ...but wait on their queue and will not take the GIL again


@pytest.mark.parametrize(
    ("line", "parked"),
    [
        ("202 0x55579b2f8d50 0x189 0x0 0x0 0x0 0xffffffff 0x7fc177ffed10 0x7fc19be9af16", True),  # idle cond wait
        ("202 0x7f34 0x189 0x0 0x7ffd1000 0x0 0xffffffff 0x7fc1 0x7fc1", False),  # timed: waits for the GIL
        ("202 0x7f34 0x80 0x2 0x0 0x0 0x0 0x7fc1 0x7fc1", False),  # a mutex held by another worker
        ("232 0x6 0x7fc17cc13b80 0x40 0xa 0x0 0x555798afd4d0 0x7fc1 0x7fc1", False),  # epoll, not futex
        ("running", False),
    ],
)
def test_parked_means_an_untimed_condition_wait(line, parked):
    assert teardown._is_untimed_condition_wait(line.split(), 202) is parked


_FOREIGN_GROUP = textwrap.dedent("""
    import atexit, json
    import torch, torch.distributed as dist
    registered = []
    real_register = atexit.register
    atexit.register = lambda fn, *a, **k: (registered.append(fn.__name__), real_register(fn, *a, **k))[1]
    # The group made by someone else (accelerate's PartialState under a plain torchrun launch).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from hf_zero.distributed.env import init_distributed
    from hf_zero.distributed import teardown

    class Engine:
        closed = False
        def close(self):
            Engine.closed = True

    engine = Engine()
    init_distributed()
    teardown.close_at_exit(engine)
    dist.broadcast(torch.ones(3), 0, async_op=True).wait()
    teardown.quiesce(1.0)
    print(json.dumps({"registered": registered, "closed": Engine.closed, "initialized": dist.is_initialized(),
                      "parked": teardown.wait_for_idle_gloo_workers(1.0)}))
""")


@needs_proc
@names_gloo_threads
def test_a_group_hf_zero_did_not_make_is_left_alive_but_quiet_at_exit():
    """Under a Trainer launched with plain torchrun, accelerate makes the group: hf_zero does not
    destroy it at exit, but closes its engines and leaves gloo's workers parked (teardown.quiesce)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-c", _FOREIGN_GROUP], capture_output=True, text=True, timeout=120,
                          env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["registered"] == ["quiesce"]  # not teardown: the group is not hf_zero's
    assert result["closed"] and result["initialized"] and result["parked"]
