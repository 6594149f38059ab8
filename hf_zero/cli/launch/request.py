"""What a parsed ``hf-zero run`` line asks for: the types the launch forms share."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["Given", "LaunchLineError", "LaunchRequest", "RecordOption", "given_options"]


class LaunchLineError(ValueError):
    """A launch line hf-zero run cannot run; the message names the option and what to do instead."""


@dataclass(frozen=True)
class Given:
    """One launcher option as the user wrote it: the spelling (``--nproc_per_node``) and the raw
    value (``None`` for a flag). Kept raw so that torch's own parser types and checks it."""

    spelling: str
    value: str | None


class RecordOption(argparse.Action):
    """argparse action that records a launcher option in ``namespace.given`` (dest -> :class:`Given`).

    Only the options the user typed are recorded, in the order first given (a repeated option
    keeps its place, the last value wins, as in argparse). argparse hands over the full spelling
    even when the user abbreviated it, so the recorded spelling is always a real option string.
    """

    def __call__(self, parser, namespace, values, option_string=None):
        value = None if self.nargs == 0 else values
        given = vars(namespace).setdefault("given", {})
        given[self.dest] = Given(option_string or self.option_strings[0], value)


def given_options(namespace: argparse.Namespace) -> dict[str, Given]:
    """The options :class:`RecordOption` recorded in ``namespace`` (empty when none was given)."""
    return dict(vars(namespace).get("given", {}))


@dataclass(frozen=True)
class LaunchRequest:
    """A launch line in torchrun's terms, before hardware-dependent planning.

    Attributes:
        form: ``"torchrun"``, ``"deepspeed"`` or ``"accelerate"`` (which launcher's options the line used).
        options: torchrun options keyed by torch's dest, in the order to pass them.
        script: the training script path, or a module name when ``module`` is set.
        script_args: the script's own arguments.
        module: run ``script`` as ``python -m script`` (torchrun's and DeepSpeed's ``--module``).
        env: variables the line sets for every rank (``CUDA_VISIBLE_DEVICES`` from ``--include``).
        pass_local_rank: each rank's script gets ``--local_rank=N`` (DeepSpeed's launcher does this).
        notes: lines to print before launching.
        bootstrap: the module each rank runs before the script (None: hf_zero's Trainer bootstrap;
            accelerate-form lines also install the ``Accelerator`` hand-off).
    """

    form: str
    options: Mapping[str, Given]
    script: str
    script_args: tuple[str, ...]
    module: bool = False
    env: Mapping[str, str] = field(default_factory=dict)
    pass_local_rank: bool = False
    notes: tuple[str, ...] = ()
    bootstrap: str | None = None
