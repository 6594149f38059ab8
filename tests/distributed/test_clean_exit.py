"""A user's script that ends without any clean-up code exits with its own status, every time.

``clean_exit_script.py`` is the DeepSpeed-style loop as users write it (``hf_zero.initialize``,
``engine.backward``, ``engine.step``) with nothing at the end: no ``destroy_process_group``, no
``os._exit``. Before hf_zero's exit teardown (``hf_zero/distributed/teardown.py``) such a script
intermittently died at interpreter exit with "terminate called without an active exception"
(SIGABRT in a rank, torchrun reporting the job failed), most often at stage 1, under load.
Launches run two at a time, which also supplies the CPU contention that exposed the abort.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from _launch import REPO

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("clean_exit_script.py")
LAUNCHES = 20  # two-rank launches of the script, each an exit of both ranks through the teardown
CONCURRENT = 2
ABORT_SIGNS = ("terminate called", "SIGABRT", "exitcode  : -6")


def _run(*args: str, ranks: int | None = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    """The script under torchrun with ``ranks`` CPU ranks (or as a plain ``python`` process when
    None); returns the completed process whatever its status."""
    if ranks is None:
        cmd = [sys.executable, str(SCRIPT), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               str(SCRIPT), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def _variants() -> list[tuple[str, str, str]]:
    """(stage, ending, where the script keeps its objects) for each launch: every stage, both with
    the engine in ``main()``'s locals (gone before exit) and kept in module globals (alive until the
    interpreter clears them), stage 1 (the abort's most frequent victim) first. The last two
    launches end with an uncaught exception (stage 1) and with ``sys.exit(3)`` (stage 3): they
    leave through the same exit teardown, so they are trials of it like the others, and running
    them in the pool (not alone afterwards) saves two launches."""
    stages = ("1", "3", "2", "0")
    plain = [(stages[i % 4], "ok", "globals" if (i // 4) % 2 else "locals") for i in range(LAUNCHES - 2)]
    return plain + [("1", "raise", "locals"), ("3", "exit3", "locals")]


@pytest.fixture(scope="module")
def launches() -> list[tuple[tuple[str, str, str], subprocess.CompletedProcess]]:
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=CONCURRENT) as pool:
        results = list(pool.map(lambda v: (v, _run(*v)), _variants()))
    print(f"{LAUNCHES} launches, {CONCURRENT} at a time: {time.monotonic() - start:.0f} s")
    return results


def _one(launches, variant: tuple[str, str, str]) -> subprocess.CompletedProcess:
    (proc,) = [proc for v, proc in launches if v == variant]
    return proc


def test_no_launch_aborts_at_exit(launches):
    assert len(launches) == LAUNCHES
    for (stage, ending, keep), proc in launches:
        output = proc.stdout + proc.stderr
        assert not any(sign in output for sign in ABORT_SIGNS), f"stage {stage} ({ending}, {keep}):\n{output[-3000:]}"
        # The users' atexit handlers still run, on both ranks.
        assert proc.stdout.count("user atexit ran") == 2, f"stage {stage} ({ending}, {keep}):\n{proc.stdout}"


def test_plain_script_exits_with_status_0_every_time(launches):
    plain = [(v, proc) for v, proc in launches if v[1] == "ok"]
    failures = [
        f"stage {stage} ({keep}): exit status {proc.returncode}\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
        for (stage, _, keep), proc in plain
        if proc.returncode != 0
    ]
    statuses = [proc.returncode for _, proc in plain]
    assert not failures, f"{len(failures)} of {len(plain)} launches failed ({statuses}):\n" + "\n\n".join(failures)


def test_a_script_that_raises_still_fails(launches):
    proc = _one(launches, ("1", "raise", "locals"))
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "RuntimeError: the user's script failed after training" in output
    assert "exitcode  : 1" in output  # the ranks failed with the exception, not with an abort


def test_sys_exit_status_is_kept(launches):
    # One process (hf_zero makes a one-process group): the script's status is the process's.
    alone = _run("1", "exit3", ranks=None)
    assert alone.returncode == 3, alone.stderr[-3000:]
    assert "user atexit ran" in alone.stdout
    assert not any(sign in alone.stdout + alone.stderr for sign in ABORT_SIGNS), alone.stderr[-3000:]
    # Under torchrun, each rank's status is what torchrun reports.
    launched = _one(launches, ("3", "exit3", "locals"))
    output = launched.stdout + launched.stderr
    assert launched.returncode != 0 and "exitcode  : 3" in output, output[-3000:]
