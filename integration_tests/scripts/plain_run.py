"""Run a script as ``python SCRIPT ARGS`` would, then end the process at once: the reference runs.

    python -m torch.distributed.run --nproc_per_node 2 integration_tests/scripts/plain_run.py SCRIPT [ARGS...]

Plain DDP runs of TRL's scripts on CPU sometimes never end after their last line (about 1 in 4
here): ``trainer.end()`` destroys the gloo process group, and releasing it then waits forever on
one of its worker threads (hf_zero's own runs tear their groups down in another order:
``hf_zero/distributed/teardown.py``). The references are not what the tests examine, so here the
group is left alone (``destroy_process_group`` does nothing) and, once the script has returned
(its files are written), the output is flushed and the process leaves with ``os._exit``.
Nothing is imported from hf_zero.
"""

from __future__ import annotations

import os
import runpy
import sys

if __name__ == "__main__":
    import torch.distributed

    torch.distributed.destroy_process_group = lambda group=None: None
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
