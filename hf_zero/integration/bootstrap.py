"""Entry point each rank runs under ``hf-zero run``: patch transformers, then run the user's script.

    python -m hf_zero.integration.bootstrap finetune.py --zero_config ds.json ...
"""

from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit("usage: python -m hf_zero.integration.bootstrap SCRIPT [ARGS...]")
    script = argv[0]
    if not os.path.isfile(script):
        raise SystemExit(f"hf-zero run: training script not found: {script}")
    from hf_zero.integration.patch import use_hf_zero_trainer

    use_hf_zero_trainer()
    # Make the script see itself as `python script.py args`.
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    from hf_zero.distributed.env import exit_cleanly

    exit_cleanly(0)


if __name__ == "__main__":
    main()
