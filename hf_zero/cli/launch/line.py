"""Parse an ``hf-zero run`` line: torchrun's options, or the DeepSpeed launcher's, then SCRIPT.

One parser holds both launchers' options (torchrun's from torch's own parser); which of them the
line uses decides its form. Options both launchers have (``--master_port``, ``--master_addr``,
``--node_rank``, ``--module``, ``--no_python``) decide nothing; a line with no DeepSpeed-only option
is a torchrun line.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hf_zero.cli.launch.accelerate_form import accelerate_request, add_accelerate_options
from hf_zero.cli.launch.deepspeed_form import add_deepspeed_options, deepspeed_request
from hf_zero.cli.launch.request import Given, LaunchLineError, LaunchRequest, given_options
from hf_zero.cli.launch.torchrun_form import add_torchrun_options, torchrun_request

__all__ = ["ParsedLine", "build_launch_parser", "launch_request", "parse_launch_line"]

USAGE = "hf-zero run [torchrun options | DeepSpeed launcher options | accelerate launch options] SCRIPT [SCRIPT ARGS ...]"
DESCRIPTION = """\
Runs SCRIPT on several processes with torch's elastic launcher (torchrun). In each rank,
transformers' Trainer and TrainingArguments are replaced by hf_zero's before SCRIPT starts, so
--zero_config ds.json (or --deepspeed ds.json) trains with ZeRO without DeepSpeed.

Replace `torchrun` or `deepspeed` on your launch line with `hf-zero run`:
  torchrun --standalone --nnodes=1 --nproc_per_node=2 train.py ...  ->  hf-zero run --standalone --nnodes=1 --nproc_per_node=2 train.py ...
  deepspeed --num_gpus 2 train.py --deepspeed ds.json               ->  hf-zero run --num_gpus 2 train.py --deepspeed ds.json
  deepspeed --include localhost:0,1 --master_port 29501 train.py    ->  hf-zero run --include localhost:0,1 --master_port 29501 train.py
  accelerate launch --config_file fsdp_config.yaml train.py         ->  hf-zero run --config_file fsdp_config.yaml train.py

Without --nproc_per_node (or --num_gpus/--include/--exclude) one process per visible GPU, or one
on a CPU machine. With DeepSpeed-launcher options each rank's SCRIPT gets --local_rank=N, as
DeepSpeed passes it. Several nodes: on each node run
  hf-zero run --nnodes 2 --node_rank R --master_addr NODE0_ADDRESS --master_port 29500 --nproc_per_node 8 train.py ...
Under SLURM (srun, one task per node) the options left out of the line come from SLURM: --nnodes,
--node_rank (SLURM_NODEID), --master_addr (the node list's first host), --master_port 29500.
"""


class _LaunchParser(argparse.ArgumentParser):
    """argparse that raises :class:`LaunchLineError` instead of printing and exiting, so that
    ``hf-zero run`` reports every bad line the same way (and tests can read the message)."""

    def error(self, message: str):
        if message.startswith("the following arguments are required"):
            message = "no SCRIPT given"  # argparse would also list SCRIPT ARGS, which may be empty
        raise LaunchLineError(f"{message}. Usage: {USAGE} (hf-zero run --help lists the options)")


def build_launch_parser() -> tuple[argparse.ArgumentParser, dict[str, str]]:
    """The ``hf-zero run`` parser: torchrun's options, DeepSpeed's, SCRIPT and its arguments.

    Returns:
        The parser, and DeepSpeed option name -> the key it is recorded under
        (see :func:`hf_zero.cli.launch.deepspeed_form.add_deepspeed_options`).
    """
    # allow_abbrev=False: an option is matched by its whole name only, as accelerate launch does;
    # three launchers' options share prefixes (--log could be --log_dir, --log-dir, --log_level...).
    parser = _LaunchParser(prog="hf-zero run", usage=USAGE, description=DESCRIPTION, allow_abbrev=False,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_torchrun_options(parser)
    keys = add_deepspeed_options(parser)
    accelerate_keys = add_accelerate_options(parser)
    parser.add_argument("script", metavar="SCRIPT",
                        help="the training script (a module name with --module/-m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="SCRIPT ARGS",
                        help="the script's own arguments (--zero_config ds.json, --output_dir, ...)")
    parser.accelerate_keys = accelerate_keys  # read by parse_launch_line
    return parser, keys


@dataclass(frozen=True)
class ParsedLine:
    """An ``hf-zero run`` line as parsed, before its form is decided.

    Attributes:
        given: every launcher option given, by key (torchrun's dest, or ``deepspeed.NAME``).
        deepspeed_keys: DeepSpeed option name -> its key in ``given``.
        script: SCRIPT.
        accelerate_keys: accelerate option dest -> its key in ``given`` (``accelerate.DEST`` or the
            shared torchrun/DeepSpeed key).
        script_args: SCRIPT's arguments.
    """

    given: Mapping[str, Given]
    deepspeed_keys: Mapping[str, str]
    script: str
    script_args: tuple[str, ...]
    accelerate_keys: Mapping[str, str] = None  # type: ignore[assignment]


def parse_launch_line(argv: Sequence[str]) -> ParsedLine:
    """Parse the arguments after ``hf-zero run``.

    Raises:
        LaunchLineError: an unknown option (with the closest known one), a bad value, or no SCRIPT.
        SystemExit: ``-h``/``--help`` (after printing the help).
    """
    parser, keys = build_launch_parser()
    argv = list(argv)
    at = _script_index(argv, parser)
    options = argv[:at]
    if argv[at:at + 1] == ["--"]:  # `hf-zero run --nproc_per_node 2 -- train.py`, as torchrun takes it
        at += 1
    # Only the launcher's part is parsed: everything after SCRIPT is the script's, whatever it looks
    # like (argparse would otherwise read a script's --log or --nproc_per_node as a launcher option).
    namespace = parser.parse_args([*options, *argv[at:at + 1]])
    return ParsedLine(given=given_options(namespace), deepspeed_keys=keys, script=namespace.script,
                      script_args=tuple(argv[at + 1:]), accelerate_keys=parser.accelerate_keys)


def _script_index(argv: list[str], parser: argparse.ArgumentParser) -> int:
    """Where SCRIPT is in ``argv``: the first argument that is neither a launcher option (whole name,
    ``--opt=value`` or ``-rVALUE``) nor an option's value; ``len(argv)`` when there is none.

    Raises:
        LaunchLineError: an unknown option before SCRIPT (with the closest known one).
    """
    actions = parser._option_string_actions  # argparse's own table of declared option strings
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--" or not token.startswith("-") or token == "-":
            return i
        if token in actions:
            i += 1 if actions[token].nargs == 0 else 2
        elif token.split("=", 1)[0] in actions or (not token.startswith("--") and token[:2] in actions):
            i += 1  # --opt=value, -rVALUE (or combined short flags, which argparse checks)
        else:
            raise LaunchLineError(_unknown_option_message(token, parser))
    return len(argv)


def launch_request(line: ParsedLine, *, gpu_count: int, env: Mapping[str, str]) -> LaunchRequest:
    """Decide the line's form and translate it into a :class:`LaunchRequest`.

    Args:
        line: the parsed line.
        gpu_count: GPUs visible to this process (DeepSpeed's --include/--exclude/--num_gpus check it).
        env: the environment (``CUDA_VISIBLE_DEVICES``).

    Raises:
        LaunchLineError: torchrun-only and DeepSpeed-only options on one line, or what the form refuses.
    """
    accelerate_only = [k for k in line.given if k.startswith("accelerate.")]
    if accelerate_only:
        return _accelerate_line(line, accelerate_only, gpu_count=gpu_count, env=env)
    deepspeed_only = [k for k in line.given if k.startswith("deepspeed.")]
    shared = {k for k in line.deepspeed_keys.values() if not k.startswith("deepspeed.")}
    torchrun_only = [k for k in line.given if not k.startswith("deepspeed.") and k not in shared]
    if deepspeed_only and torchrun_only:
        t, d = line.given[torchrun_only[0]].spelling, line.given[deepspeed_only[0]].spelling
        raise LaunchLineError(
            f"{t} is a torchrun option and {d} a DeepSpeed launcher option: use one launcher's options on a line. "
            "torchrun form: hf-zero run --nproc_per_node 2 SCRIPT ...; DeepSpeed form: hf-zero run --num_gpus 2 "
            "SCRIPT ... (--master_port, --master_addr, --node_rank, --module go with either)")
    if deepspeed_only:
        given = {name: line.given[key] for name, key in line.deepspeed_keys.items() if key in line.given}
        return deepspeed_request(given, line.script, line.script_args, gpu_count=gpu_count, env=env)
    return torchrun_request(line.given, line.script, list(line.script_args))


def _accelerate_line(line: ParsedLine, accelerate_only: list[str], *, gpu_count: int,
                     env: Mapping[str, str]) -> LaunchRequest:
    """An accelerate-form line: options only accelerate has, plus the ones it shares with torchrun
    (``--module``, ``--rdzv_backend``, ``--max_restarts``...) or DeepSpeed (``--quiet``)."""
    keys = line.accelerate_keys or {}
    shared_keys = {key: dest for dest, key in keys.items() if not key.startswith("accelerate.")}
    others = [k for k in line.given if not k.startswith("accelerate.") and k not in shared_keys]
    if others:
        a, o = line.given[accelerate_only[0]].spelling, line.given[others[0]].spelling
        launcher = "DeepSpeed launcher" if others[0].startswith("deepspeed.") else "torchrun"
        raise LaunchLineError(
            f"{a} is an accelerate launch option and {o} a {launcher} option: use one launcher's options on a line. "
            "accelerate form: hf-zero run --num_processes 2 [--config_file FILE] SCRIPT ...")
    given = {key.split(".", 1)[1]: g for key, g in line.given.items() if key.startswith("accelerate.")}
    shared = {key: g for key, g in line.given.items() if key in shared_keys and not key.startswith("deepspeed.")}
    return accelerate_request(given, shared, line.script, line.script_args, gpu_count=gpu_count, env=env)


def _unknown_option_message(token: str, parser: argparse.ArgumentParser) -> str:
    option = token.split("=", 1)[0]
    known = [s for s in parser._option_string_actions if s.startswith("--")]
    longer = sorted(s for s in known if s.startswith(option))
    close = difflib.get_close_matches(option, known, n=1)
    if longer:  # an abbreviation: hf-zero run, like accelerate launch, takes whole names only
        hint = f" (options are not abbreviated: write one of {', '.join(longer[:6])} in full)"
    else:
        hint = f" (did you mean {close[0]}?)" if close else ""
    return (f"unknown launcher option {option}{hint}. hf-zero run takes torchrun's options, the DeepSpeed "
            "launcher's one-node options and accelerate launch's options before SCRIPT (hf-zero run --help lists them); options for your script go "
            "after SCRIPT")
