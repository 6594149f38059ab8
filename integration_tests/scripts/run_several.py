"""Run several scripts one after the other in this process, each as ``python SCRIPT ARGS`` would:
one launch (one interpreter start, one import of torch/transformers/TRL, one process group) for
many short runs.

    python -m torch.distributed.run --nproc_per_node 2 run_several.py LOG_DIR [--exit-now] \
        +++ NAME SCRIPT ARGS... +++ NAME SCRIPT ARGS... ...
    hf-zero run --nproc_per_node 2 run_several.py LOG_DIR +++ NAME SCRIPT ARGS... ...

Between runs it does what a new process would start from: the same seeds of Python's, NumPy's and
torch's generators (a model head that ``from_pretrained`` initialises gets the same values whatever
ran before). Each run's ``hf_zero`` log records go to ``LOG_DIR/NAME.rank<R>.log`` (the tests read
how a reference model was sharded from them). TRL's scripts end with ``trainer.end()``, which
destroys the process group: that is skipped until the last run has returned, then the group is
left to whoever made it (hf_zero's exit teardown under ``hf-zero run``). ``--exit-now`` (the plain
DDP references) leaves with ``os._exit`` once the runs are done, as ``plain_run.py`` does and for
the same reason: releasing a gloo group after TRL's runs sometimes never returns on CPU. Nothing is
imported from hf_zero.
"""

from __future__ import annotations

import logging
import os
import random
import runpy
import sys
from pathlib import Path

SEPARATOR = "+++"


def _runs(argv: list[str]) -> list[list[str]]:
    runs, current = [], None
    for arg in argv:
        if arg == SEPARATOR:
            current = []
            runs.append(current)
        elif current is None:
            raise SystemExit(f"run_several.py: expected {SEPARATOR} before {arg!r}")
        else:
            current.append(arg)
    if not runs or any(len(r) < 2 for r in runs):
        raise SystemExit(f"run_several.py: each run is {SEPARATOR} NAME SCRIPT [ARGS...]")
    return runs


def _fresh_seeds() -> None:
    import numpy
    import torch

    random.seed(0)
    numpy.random.seed(0)
    torch.manual_seed(0)


def main(log_dir: str, runs: list[list[str]]) -> None:
    """Run each ``NAME SCRIPT ARGS`` in turn; a run that fails stops the rest."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)

    import torch.distributed

    destroy = torch.distributed.destroy_process_group
    torch.distributed.destroy_process_group = lambda group=None: None
    hf_zero_logger = logging.getLogger("hf_zero")
    hf_zero_logger.setLevel(logging.INFO)
    rank = os.environ.get("RANK", "0")
    for name, script, *args in runs:
        print(f"[run_several] {name}: {script} {' '.join(args)}", file=sys.stderr, flush=True)
        handler = logging.FileHandler(log_dir / f"{name}.rank{rank}.log")
        hf_zero_logger.addHandler(handler)
        _fresh_seeds()
        sys.argv = [script, *args]
        script_dir = os.path.dirname(os.path.abspath(script))
        sys.path.insert(0, script_dir)
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise
        finally:
            hf_zero_logger.removeHandler(handler)
            handler.close()
            sys.path.remove(script_dir)
    torch.distributed.destroy_process_group = destroy


if __name__ == "__main__":
    log_dir, *rest = sys.argv[1:]
    exit_now = rest[:1] == ["--exit-now"]
    runs = _runs(rest[1:] if exit_now else rest)
    if not exit_now:
        main(log_dir, runs)
    else:
        code = 0
        try:
            main(log_dir, runs)
        except BaseException:  # noqa: BLE001 - reported, then the process leaves at once (see above)
            import traceback

            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
