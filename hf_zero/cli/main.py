"""``hf-zero``: the command-line entry point (argparse only; each subcommand calls library code).

Each subcommand lives in its own module listed in :data:`_COMMAND_MODULES`; a module exposes
``register(subparsers)``, which adds its parser and sets ``func`` (``args -> exit code``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

__all__ = ["build_parser", "main"]

# Imported in order; a listed module that is missing is a packaging bug, so the ImportError propagates.
_COMMAND_MODULES = [
    "hf_zero.cli.config_cmd",
    "hf_zero.cli.run_cmd",
    "hf_zero.cli.estimate_cmd",
    "hf_zero.cli.consolidate_cmd",
    "hf_zero.cli.env_cmd",
    "hf_zero.cli.doctor_cmd",
]


def build_parser() -> argparse.ArgumentParser:
    """Build the ``hf-zero`` parser with every subcommand from :data:`_COMMAND_MODULES`.

    Returns:
        The top-level parser.

    Raises:
        ImportError: A listed subcommand module does not exist.
    """
    from hf_zero import __version__

    parser = argparse.ArgumentParser(
        prog="hf-zero",
        description="ZeRO for the Hugging Face Trainer from your DeepSpeed config, without DeepSpeed.",
    )
    parser.add_argument("--version", action="version", version=f"hf-zero {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``hf-zero`` with ``argv`` (default: ``sys.argv[1:]``).

    Args:
        argv: Command-line arguments without the program name.

    Returns:
        The exit code: 0 on success, 2 for usage errors and invalid configs (argparse's convention).
    """
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return 2
    return int(func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
