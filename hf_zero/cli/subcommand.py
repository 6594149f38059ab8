"""The two parsers every ``hf-zero`` subcommand module offers: its entry under ``hf-zero`` and a
standalone one for ``python -m hf_zero.cli.<name>_cmd``, both configured by the same function."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["add_subcommand", "standalone_parser"]

Configure = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def add_subcommand(subparsers: argparse._SubParsersAction, name: str, help: str, description: str,
                   configure: Configure) -> argparse.ArgumentParser:
    """Add ``name`` to ``hf-zero``'s subparsers and give it its flags (``configure``)."""
    parser = subparsers.add_parser(name, help=help, description=description,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    return configure(parser)


def standalone_parser(name: str, description: str, configure: Configure) -> argparse.ArgumentParser:
    """``hf-zero <name>`` as a parser of its own, with the same flags as the subcommand."""
    parser = argparse.ArgumentParser(prog=f"hf-zero {name}", description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    return configure(parser)
