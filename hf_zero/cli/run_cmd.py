"""``hf-zero run``: launch an unmodified Trainer script on N ranks with hf_zero underneath.

The line after ``hf-zero run`` is a torchrun line or a DeepSpeed-launcher line with the launcher's
name replaced (:mod:`hf_zero.cli.launch` parses and plans it; torch's launcher runs it).
"""

from __future__ import annotations

import argparse
import os
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    from hf_zero.cli.launch.line import DESCRIPTION, USAGE

    p = subparsers.add_parser(
        "run",
        help="run a Trainer script on several processes (torchrun or deepspeed launch line) with "
             "--zero_config/--deepspeed routed to hf_zero",
        description=DESCRIPTION,
        usage=USAGE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # The whole line is parsed by hf_zero.cli.launch (torchrun's options come from torch's own
        # parser, built on demand). A prefix no argv can hold makes argparse hand it over untouched,
        # so an unknown or misspelt option gets that parser's message, not a bare "unrecognized".
        prefix_chars="\0",
        add_help=False,
        allow_abbrev=False,
    )
    p.add_argument("launch_line", nargs=argparse.REMAINDER)
    p.set_defaults(func=run)


def _gpus() -> tuple[list[str], bool]:
    from hf_zero.distributed import device as accel

    if not accel.accelerator_available():
        return [], True
    from hf_zero.cli.launch.plan import p2p_usable

    names = [accel.device_name(i) for i in range(accel.device_count())]
    reported = all(accel.can_access_peer(i, j) for i in range(len(names)) for j in range(len(names)) if i != j)
    return names, p2p_usable(names, reported, _driver_version())


def _driver_version() -> str | None:
    """The NVIDIA driver's version from ``nvidia-smi`` (None when it cannot be asked)."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.strip().splitlines()
    return lines[0].strip() if lines else None


def _missing(script: str, as_module: bool) -> str | None:
    """Why ``script`` cannot start (``None`` when it can): each rank runs it from this directory."""
    if not as_module:
        return None if os.path.isfile(script) else f"training script not found: {script}"
    import importlib.util

    sys.path.insert(0, os.getcwd())  # `python -m` in each rank looks in the working directory first
    try:
        found = importlib.util.find_spec(script) is not None
    except (ImportError, ValueError):
        found = False
    finally:
        sys.path.pop(0)
    return None if found else f"module not found: {script} (run from the directory that holds it, or install it)"


def run(args: argparse.Namespace) -> int:
    from hf_zero.cli.launch import LaunchLineError, launch_request, parse_launch_line, plan_request, torchrun_namespace

    try:
        line = parse_launch_line(args.launch_line)
    except SystemExit as exc:  # --help printed
        return int(exc.code or 0)
    except LaunchLineError as exc:
        print(f"hf-zero run: {exc}", file=sys.stderr)
        return 2
    names, p2p = _gpus()
    try:
        request = launch_request(line, gpu_count=len(names), env=os.environ)
        problem = _missing(request.script, request.module)
        if problem:
            print(f"hf-zero run: {problem}", file=sys.stderr)
            return 2
        plan = plan_request(request, gpu_names=names, p2p_ok=p2p)
    except LaunchLineError as exc:
        print(f"hf-zero run: {exc}", file=sys.stderr)
        return 2
    for note in plan.notes:
        print(note, file=sys.stderr)
    try:
        namespace = torchrun_namespace(plan)  # SCRIPT's own arguments never go through torch's parser
    except LaunchLineError as exc:
        print(f"hf-zero run: {exc}", file=sys.stderr)
        return 2
    os.environ.update(plan.env)
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import run as torchrun_run

    try:
        record(torchrun_run)(namespace)  # what torch.distributed.run.main does after parsing
    except SystemExit as exc:  # torchrun exits with the failing rank's code
        return int(exc.code or 0)
    except Exception as exc:  # ChildFailedError: the ranks already printed their tracebacks
        print(f"hf-zero run: {type(exc).__name__}: training failed (see the rank output above)", file=sys.stderr)
        return 1
    return 0
