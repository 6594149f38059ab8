"""``accelerate launch``'s options and config files for ``hf-zero run``.

``accelerate launch --config_file fsdp_config.yaml train.py`` runs as
``hf-zero run --config_file fsdp_config.yaml train.py``. The options come from accelerate's own
launcher parser (``accelerate.commands.launch.launch_command_parser``: both spellings, its types
and choices), never from a copy. The line's values are typed by that parser, merged with the config
file as ``accelerate launch`` merges them, and converted by
:mod:`hf_zero.config.sources.accelerate_yaml`: DEEPSPEED and FSDP configs become hf_zero's ZeRO
config (plus wrapping, state dict type, activation checkpointing), handed to every rank in one
environment variable (:data:`SETTINGS_ENV`) that hf_zero's Trainer and ``Accelerator`` hand-off read.

The process layout follows ``accelerate/utils/launch.py`` (``prepare_multi_gpu_env``):
``--num_processes`` is the total over ``--num_machines``; ``--machine_rank`` is the node rank;
``--main_process_ip/--main_process_port`` is where the ranks meet (``--same_network``: as
``--master_addr/--master_port``, else a rendezvous endpoint); ``--gpu_ids`` sets
``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from hf_zero.cli.launch.request import Given, LaunchLineError, LaunchRequest, RecordOption
from hf_zero.config.sources.accelerate_yaml import SETTINGS_ENV

__all__ = ["ACCELERATE_BOOTSTRAP", "SETTINGS_ENV", "accelerate_option_actions", "accelerate_request",
           "add_accelerate_options"]


ACCELERATE_BOOTSTRAP = "hf_zero.accelerate_support.bootstrap"
"""What each rank of an accelerate-form line runs: installs the ``Accelerator`` hand-off, then
hf_zero's usual bootstrap (Trainer swap) and the script."""

# accelerate options whose meaning is torchrun's (accelerate hands them to torchrun unchanged).
_AS_TORCHRUN = ("module", "no_python", "log_dir", "role", "rdzv_backend", "rdzv_conf", "max_restarts",
                "monitor_interval", "tee")
_REFUSED = {
    "tpu": "TPUs are not supported by hf_zero",
    "tpu_use_cluster": "TPUs are not supported by hf_zero",
    "use_megatron_lm": "Megatron-LM is not part of hf_zero; use --use_deepspeed or --use_fsdp",
    "use_parallelism_config": "tensor/context/sequence parallelism is not part of hf_zero (data parallel only)",
    "aws_access_key_id": "SageMaker launches are not supported; run hf-zero run on the machine",
    "aws_secret_access_key": "SageMaker launches are not supported; run hf-zero run on the machine",
}


def _accelerate_parser() -> argparse.ArgumentParser:
    from accelerate.commands.launch import launch_command_parser

    return launch_command_parser()


def accelerate_option_actions() -> list[argparse.Action]:
    """The optional arguments of accelerate's launch parser (``-h`` left out)."""
    return [a for a in _accelerate_parser()._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]


def add_accelerate_options(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Add accelerate's launch options that ``parser`` (holding torchrun's and DeepSpeed's) lacks.

    An option whose spelling another launcher already declares (``--module``, ``--log_dir``,
    ``--rdzv_backend``, ``--quiet`` ...) stays that one option: it means the same to accelerate,
    which passes it on to torchrun, and decides nothing about the line's form.

    Returns:
        accelerate dest -> the key it is recorded under: ``accelerate.DEST`` for options added here,
        the other launcher's key for the shared ones.
    """
    group = parser.add_argument_group(
        "accelerate launch options",
        "`accelerate launch [--config_file FILE] ... train.py` lines run as `hf-zero run ... train.py`: "
        "DEEPSPEED and FSDP configs become hf_zero's ZeRO config (docs/accelerate.md). Options from "
        "accelerate's own parser; not to be mixed with torchrun-only or DeepSpeed-launcher-only options.",
    )
    owners = parser._option_string_actions
    keys: dict[str, str] = {}
    for action in accelerate_option_actions():
        owned = [s for s in action.option_strings if s in owners]
        if owned:
            keys.setdefault(action.dest, owners[owned[0]].dest)
            continue
        flag = action.nargs == 0
        group.add_argument(*action.option_strings, dest=f"accelerate.{action.dest}", action=RecordOption,
                           nargs=0 if flag else None, default=argparse.SUPPRESS,
                           metavar=None if flag else action.dest.upper(),
                           help=(action.help or "").replace("%", "%%") or None)
        keys.setdefault(action.dest, f"accelerate.{action.dest}")
    return keys


def _typed_line_values(given: Mapping[str, Given]) -> dict[str, Any]:
    """The options typed on the line, typed and checked by accelerate's parser (name -> value)."""
    parser = _accelerate_parser()

    def refuse(message: str):
        raise LaunchLineError(f"{message} (checked by accelerate's launch parser; see hf-zero run --help)")

    parser.error = refuse
    argv: list[str] = []
    for g in given.values():
        argv.append(g.spelling if g.value is None else f"{g.spelling}={g.value}")
    namespace = parser.parse_args([*argv, "SCRIPT"])
    typed = getattr(namespace, "nondefault", set())
    # Flags store through _StoreConstAction, which records them in nondefault as well.
    return {dest: getattr(namespace, dest) for dest in typed}


def accelerate_request(given: Mapping[str, Given], shared: Mapping[str, Given], script: str,
                       script_args: Sequence[str], *, gpu_count: int, env: Mapping[str, str]) -> LaunchRequest:
    """The request of an accelerate-form line, in torchrun's terms.

    Args:
        given: accelerate dest -> option as given (options only accelerate has).
        shared: torchrun dest -> option as given (``--module``, ``--rdzv_backend``...; passed on).
        script, script_args: the script and its arguments.
        gpu_count: GPUs visible to this process.
        env: the environment.

    Raises:
        LaunchLineError: a refused option or setting (TPU, Megatron-LM, HYBRID sharding, fp8...),
            an unreadable config file, or a process layout that does not divide.
    """
    from hf_zero.config.errors import ZeroConfigError
    from hf_zero.config.sources.accelerate_plugins import convert, launch_defaults
    from hf_zero.config.sources.accelerate_yaml import (
        default_accelerate_config_file,
        flatten_accelerate_config,
        merge_launch_values,
        read_accelerate_config,
        settings_env_value,
    )

    for dest, why in _REFUSED.items():
        if dest in given:
            raise LaunchLineError(f"{given[dest].spelling}: {why}")
    line = _typed_line_values(given)
    notes: list[str] = []
    config_file = line.get("config_file")
    if config_file is None and not line.get("cpu"):
        config_file = default_accelerate_config_file()
        if config_file:
            notes.append(f"hf-zero run: using accelerate's default config {config_file} (as accelerate launch does "
                         "without --config_file)")
    try:
        flat = flatten_accelerate_config(read_accelerate_config(config_file)) if config_file else None
        values = merge_launch_values(launch_defaults(), flat, line)
        values["_known"] = sorted(launch_defaults())
        settings = convert(values, str(config_file or "accelerate options"))
    except ZeroConfigError as exc:
        raise LaunchLineError(str(exc)) from None
    for line_note in settings.no_effect:
        notes.append(f"hf-zero run: {line_note}")
    notes.extend(f"hf-zero run: {n}" for n in settings.notes)

    options: dict[str, Given] = {dest: g for dest, g in shared.items() if dest != "module"}
    machines = settings.num_machines or 1
    procs = settings.num_processes
    if procs is not None and procs == -1:
        raise LaunchLineError(f"{config_file}: num_processes -1: pass --num_processes N (accelerate asks for it too)")
    if machines > 1:
        if procs is None or procs % machines:
            raise LaunchLineError(f"--num_processes {procs} over --num_machines {machines}: give the total process "
                                  "count, a multiple of the machine count (accelerate divides it per machine)")
        if not settings.main_process_ip:
            raise LaunchLineError("--num_machines > 1 needs --main_process_ip (machine 0's address), as accelerate")
        port = settings.main_process_port or 29500
        options["nproc_per_node"] = Given("--nproc_per_node", str(procs // machines))
        options["nnodes"] = Given("--nnodes", str(machines))
        options["node_rank"] = Given("--node_rank", str(settings.machine_rank or 0))
        if settings.same_network:
            options["master_addr"] = Given("--master_addr", settings.main_process_ip)
            options["master_port"] = Given("--master_port", str(port))
        else:
            options["rdzv_endpoint"] = Given("--rdzv_endpoint", f"{settings.main_process_ip}:{port}")
            if "rdzv_backend" not in options and settings.rdzv_backend:
                options["rdzv_backend"] = Given("--rdzv_backend", settings.rdzv_backend)
    else:
        if procs is not None:
            if gpu_count and procs > gpu_count and settings.gpu_ids is None:
                raise LaunchLineError(f"--num_processes {procs} but {gpu_count} GPU(s) are visible: each rank uses "
                                      f"one GPU, so run at most {gpu_count}")
            options["nproc_per_node"] = Given("--nproc_per_node", str(procs))
        if settings.main_process_port:
            options["master_port"] = Given("--master_port", str(settings.main_process_port))

    rank_env = {SETTINGS_ENV: settings_env_value(settings), "ACCELERATE_MIXED_PRECISION": settings.mixed_precision}
    if settings.gpu_ids is not None:
        rank_env["CUDA_VISIBLE_DEVICES"] = settings.gpu_ids
        notes.append(f"hf-zero run: --gpu_ids {settings.gpu_ids}: CUDA_VISIBLE_DEVICES={settings.gpu_ids}")
    threads = values.get("num_cpu_threads_per_process")
    if threads:
        rank_env["OMP_NUM_THREADS"] = str(threads)
    if values.get("debug"):
        rank_env["ACCELERATE_DEBUG_MODE"] = "true"
    if settings.low_memory_loading is False and settings.zero_config is not None:
        from hf_zero.engine.materialize import ENV_SWITCH

        rank_env[ENV_SWITCH] = "0"  # zero3_init_flag / fsdp_cpu_ram_efficient_loading false
    if "no_python" in shared:
        raise LaunchLineError(f"{shared['no_python'].spelling}: the script would start without Python, so without "
                              "hf_zero's bootstrap; drop it for a Python script")
    return LaunchRequest(form="accelerate", options=options, script=script, script_args=tuple(script_args),
                         module="module" in shared, env=rank_env, notes=tuple(notes),
                         bootstrap=ACCELERATE_BOOTSTRAP)
