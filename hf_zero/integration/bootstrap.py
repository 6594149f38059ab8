"""Entry point each rank runs under ``hf-zero run``: patch transformers, then run the user's script.

    python -m hf_zero.integration.bootstrap finetune.py --zero_config ds.json ...
    python -m hf_zero.integration.bootstrap -m mypackage.train ...     (torchrun/DeepSpeed --module)
"""

from __future__ import annotations

import os
import runpy
import sys

# Set by `hf-zero run` for DeepSpeed-launcher lines: DeepSpeed's launcher gives each rank's script
# `--local_rank=N` right after its name (deepspeed/launcher/launch.py); torchrun only sets LOCAL_RANK.
PASS_LOCAL_RANK_ENV = "HF_ZERO_PASS_LOCAL_RANK"


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    as_module = bool(argv) and argv[0] == "-m"  # SCRIPT is a module name, as in `python -m`
    if as_module:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m hf_zero.integration.bootstrap [-m] SCRIPT [ARGS...]")
    script = argv[0]
    if not as_module and not os.path.isfile(script):
        raise SystemExit(f"hf-zero run: training script not found: {script}")
    if os.environ.pop(PASS_LOCAL_RANK_ENV, "") == "1":  # popped: the script's own subprocesses don't inherit it
        argv.insert(1, f"--local_rank={os.environ.get('LOCAL_RANK', '0')}")
    from hf_zero.integration.patch import use_hf_zero_trainer

    use_hf_zero_trainer()
    _maybe_low_memory_loading(argv[1:])
    # Make the script see itself as `python script.py args`.
    sys.argv = argv
    if as_module:
        runpy.run_module(script, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")
    from hf_zero.distributed.env import exit_cleanly

    exit_cleanly(0)


def _maybe_low_memory_loading(script_args: list[str]) -> None:
    """At ZeRO-3, make from_pretrained load real weights on local rank 0 only (the others build
    the model on the meta device and receive their shards when it is sharded)."""
    from hf_zero.engine.materialize import (
        install_low_memory_loading,
        should_use_low_memory_loading,
        zero_config_from_argv,
    )

    try:
        low_memory = should_use_low_memory_loading(zero_config_from_argv(script_args))
    except Exception:  # a bad config is reported by the script's own argument parsing, with its file
        low_memory = False
    if low_memory:
        install_low_memory_loading()


if __name__ == "__main__":
    main()
