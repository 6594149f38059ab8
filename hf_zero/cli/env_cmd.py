"""``hf-zero env``: versions, GPUs, host limits and environment variables to attach to a bug report.

Examples::

    hf-zero env
    hf-zero env --nvme_path /mnt/nvme --json > env.json

Exit status: 0 (an unreadable fact is reported as ``unknown (<reason>)``, never as an error).
"""

from __future__ import annotations

import argparse
import sys

from hf_zero.cli.subcommand import add_subcommand, standalone_parser

__all__ = ["build_parser", "register", "run"]

_DESCRIPTION = """\
Print what a bug report needs: versions (hf_zero, Python, OS, torch with CUDA/cuDNN/NCCL,
transformers, accelerate, peft, safetensors, datasets, deepspeed), GPUs (memory, compute
capability, native bf16, MIG, driver, peer-to-peer access, nvidia-smi topology), distributed
backends, host limits (CPU, RAM, cgroup memory limit, ulimit -l, /dev/shm), the environment
variables that change a run (secret-looking values redacted) and, with --nvme_path, whether that
folder suits NVMe offload. Warnings at the end name what to fix before a run."""


def _configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of text")
    parser.add_argument("--nvme_path", "--nvme-path", dest="nvme_path", default=None, metavar="PATH",
                        help="also check this folder for NVMe offload: file system, free space, O_DIRECT")
    parser.set_defaults(func=run)
    return parser


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``env`` subcommand to ``hf-zero``'s subparsers; ``args.func`` is :func:`run`."""
    return add_subcommand(subparsers, "env", "print versions, GPUs, host limits and env vars to attach to a bug report", _DESCRIPTION, _configure)


def build_parser() -> argparse.ArgumentParser:
    """A standalone parser (``python -m hf_zero.cli.env_cmd``), the same flags as the subcommand."""
    return standalone_parser("env", _DESCRIPTION, _configure)


def run(args: argparse.Namespace) -> int:
    """Collect the report for parsed ``args`` and print it (text, or JSON with ``--json``); return 0."""
    # Imported here, as torch is inside it: building the `hf-zero` parser stays cheap.
    from hf_zero.diagnostics.env_report import collect_env, render_text

    report = collect_env(nvme_path=args.nvme_path)
    print(report.to_json() if args.json else render_text(report))
    return 0


if __name__ == "__main__":
    sys.exit(run(build_parser().parse_args()))
