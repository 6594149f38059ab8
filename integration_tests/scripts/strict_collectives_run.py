"""Run a script as ``python SCRIPT ARGS`` would, with the test suite's strict collectives on:

    hf-zero run --nproc_per_node 2 integration_tests/scripts/strict_collectives_run.py SCRIPT ARGS...

tests/strict_collectives.py makes a collective fail on CPU where NCCL would fail on a GPU (a
host-memory tensor, such as an ``offload_param`` shard, entering it). The script runs as
``__main__``, so its calls count as a script's. Each rank prints the strict counters at the end
(``strict stats {...}``), so a test can show the mode saw host tensors and their moves.
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.strict_collectives

from tests.strict_collectives import install, stats  # noqa: E402


def main() -> None:
    install()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")
    print("strict stats " + json.dumps(stats), flush=True)


if __name__ == "__main__":
    main()
