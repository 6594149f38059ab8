"""torchrun's options for ``hf-zero run``, taken from torch's own launcher parser.

``hf-zero run`` declares no torchrun option itself: :func:`add_torchrun_options` copies every
option of ``torch.distributed.run.get_args_parser()`` (both spellings, its help, its choices), so
an option torch adds works the day it is added. Values are kept as typed and handed back to
torch, whose parser types and checks them (:func:`parse_torchrun_args`).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from hf_zero.cli.launch.request import Given, LaunchLineError, LaunchRequest, RecordOption

__all__ = [
    "HANDLED_BY_HF_ZERO",
    "add_torchrun_options",
    "local_world_size",
    "nnodes_range",
    "parse_torchrun_args",
    "render_options",
    "torchrun_option_actions",
    "torchrun_request",
]

# torchrun options whose meaning hf-zero run implements itself, because every rank must start as
# `python -m hf_zero.integration.bootstrap SCRIPT` for the Trainer swap to happen before the script.
HANDLED_BY_HF_ZERO = {
    "module": "runs SCRIPT as a module (python -m SCRIPT) inside the bootstrap",
    "no_python": "refused: the script would start without Python, so without hf_zero",
    "run_path": "refused: the script would run in the launcher's interpreter, without the bootstrap",
}


def _torch_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def torchrun_option_actions() -> list[argparse.Action]:
    """The optional arguments of torch's launcher parser (``-h`` and the positionals left out)."""
    return [a for a in _torch_parser()._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]


def add_torchrun_options(parser: argparse.ArgumentParser) -> set[str]:
    """Add every torchrun option to ``parser`` as a recorded raw option (see :class:`RecordOption`).

    Returns:
        The option strings added (so that other launch forms can skip the ones torchrun has).
    """
    group = parser.add_argument_group(
        "torchrun options",
        "torch.distributed.run's own options, from torch's parser (both spellings, --opt=value or "
        "--opt value)",
    )
    added: set[str] = set()
    for action in torchrun_option_actions():
        flag = action.nargs == 0
        group.add_argument(
            *action.option_strings,
            dest=action.dest,
            action=RecordOption,
            nargs=0 if flag else None,
            choices=None if flag else action.choices,
            default=argparse.SUPPRESS,
            metavar=None if flag else (action.metavar or action.dest.upper()),
            help=(action.help or "").replace("%", "%%")
            + (f" [hf-zero run: {HANDLED_BY_HF_ZERO[action.dest]}]" if action.dest in HANDLED_BY_HF_ZERO else ""),
        )
        added.update(action.option_strings)
    return added


def torchrun_request(given: Mapping[str, Given], script: str, script_args: list[str]) -> LaunchRequest:
    """The request of a torchrun-form line: its options go to torch as given.

    Raises:
        LaunchLineError: ``--no-python`` or ``--run-path``, which would start the script without
            hf_zero's bootstrap.
    """
    for dest in ("no_python", "run_path"):
        if dest in given:
            raise LaunchLineError(
                f"{given[dest].spelling}: hf-zero run starts every rank as `python -m "
                f"hf_zero.integration.bootstrap SCRIPT` so that transformers' Trainer is swapped before "
                f"the script runs; {given[dest].spelling} would start {script} without it. Drop "
                f"{given[dest].spelling} (for a Python script), or keep plain torchrun and import "
                "ZeroTrainer/ZeroTrainingArguments in the script.")
    options = {dest: g for dest, g in given.items() if dest != "module"}
    return LaunchRequest(form="torchrun", options=options, script=script, script_args=tuple(script_args),
                         module="module" in given)


def render_options(options: Mapping[str, Given]) -> list[str]:
    """Options as torchrun argv: ``--opt=value`` (the ``=`` form keeps values starting with ``-``
    intact) or ``--flag``; a short spelling (``-r``) becomes its long one."""
    long_names = {a.dest: next(s for s in a.option_strings if s.startswith("--")) for a in torchrun_option_actions()}
    argv = []
    for dest, g in options.items():
        spelling = g.spelling if g.spelling.startswith("--") else long_names[dest]
        argv.append(spelling if g.value is None else f"{spelling}={g.value}")
    return argv


def parse_torchrun_args(argv: list[str]) -> argparse.Namespace:
    """Parse a torchrun argv with torch's own parser, as ``torch.distributed.run.main`` will.

    Raises:
        LaunchLineError: torch's parser refused a value (its message names the option).
    """
    parser = _torch_parser()

    def refuse(message: str):
        raise LaunchLineError(f"{message} (checked by torch's launcher parser; see hf-zero run --help)")

    parser.error = refuse  # argparse would print and exit; the caller reports it instead
    parser.allow_abbrev = False  # hf-zero run hands over whole option names only
    return parser.parse_args(argv)


def nnodes_range(spec: str) -> tuple[int, int]:
    """``--nnodes`` as (min, max), by torch's own rule (``2`` or ``1:4``).

    Raises:
        LaunchLineError: not ``N`` or ``MIN:MAX`` with 0 < MIN <= MAX.
    """
    from torch.distributed.run import parse_min_max_nnodes

    try:
        low, high = parse_min_max_nnodes(spec)
    except (RuntimeError, ValueError):
        low = high = 0
    if not 0 < low <= high:
        raise LaunchLineError(f"--nnodes {spec}: give a node count (--nnodes 2) or a range MIN:MAX with "
                              "0 < MIN <= MAX (--nnodes 1:4)")
    return low, high


def local_world_size(spec: str, gpu_count: int, cpu_count: int) -> int:
    """How many ranks ``--nproc_per_node spec`` starts on this node, by torchrun's rules.

    Args:
        spec: an integer, ``gpu``, ``cpu`` or ``auto`` (GPUs when there are some, else CPU cores);
            other device names (``xpu``) are asked of torch.
        gpu_count: GPUs visible to this process.
        cpu_count: cores this process may use.

    Raises:
        LaunchLineError: a count below 1, ``gpu`` without a GPU, or a name torch does not know.
    """
    try:
        count = int(spec)
    except ValueError:
        if spec == "gpu":
            if not gpu_count:
                raise LaunchLineError("--nproc_per_node gpu: no GPU is visible to this process; give a number "
                                      "(--nproc_per_node 2) to run CPU ranks") from None
            count = gpu_count
        elif spec == "auto":
            count = gpu_count or cpu_count
        elif spec == "cpu":
            count = cpu_count
        else:
            from torch.distributed.run import determine_local_world_size

            try:
                count = determine_local_world_size(spec)
            except ValueError as exc:
                raise LaunchLineError(f"--nproc_per_node {spec}: {exc} (torchrun takes a number, gpu, cpu, "
                                      "auto, or an available device name)") from None
    if count < 1:
        raise LaunchLineError(f"--nproc_per_node {spec}: start at least one process per node")
    return count
