"""The DeepSpeed launcher's options for ``hf-zero run`` (``deepspeed --num_gpus 2 train.py ...``).

Semantics follow DeepSpeed 0.19.8's ``deepspeed/launcher/runner.py`` and ``launch.py`` (read, never
imported: hf_zero does not depend on DeepSpeed). On one node the launcher

- takes the GPUs from ``--num_gpus N`` (ids 0..N-1), ``--include localhost:0,1`` or
  ``--exclude localhost:1`` (``NODE[:SLOT,...][@NODE...]``; the two are mutually exclusive and
  neither goes with ``--num_gpus``/``--num_nodes``), and sets ``CUDA_VISIBLE_DEVICES`` to them;
- meets on 127.0.0.1 at ``--master_port`` (``--master_addr`` is replaced by 127.0.0.1 without a
  hostfile; hf-zero run keeps it in a SLURM job of several nodes, which it completes from SLURM);
- passes ``--local_rank=N`` to the script right after its name (unless ``--no_local_rank``).

Multi-node runs (``--hostfile``, ``--num_nodes`` > 1, ``--force_multi``) ssh into every host; hf-zero
run does not: it refuses them and prints the ``hf-zero run`` line to start on each node.

Where hf-zero run differs on purpose: it treats ``CUDA_VISIBLE_DEVICES`` as the machine's GPUs
(DeepSpeed ignores it when one of these options is given), and without ``--master_port`` it lets
torchrun pick a free port instead of 29500.
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hf_zero.cli.launch.request import Given, LaunchLineError, LaunchRequest, RecordOption
from hf_zero.cli.launch.slurm import SlurmEnvError, read_slurm_env

__all__ = ["DEEPSPEED_OPTIONS", "DeepSpeedOption", "add_deepspeed_options", "deepspeed_request"]

_DEEPSPEED_DEFAULT_PORT = 29500  # deepspeed.constants.TORCH_DISTRIBUTED_DEFAULT_PORT


@dataclass(frozen=True)
class DeepSpeedOption:
    """One option of DeepSpeed's ``runner.py`` parser and what hf-zero run does with it.

    Attributes:
        name: DeepSpeed's dest.
        strings: its option strings.
        flag: takes no value.
        effect: ``use`` (implemented), ``multinode`` (refused, with the per-node command),
            ``refuse`` (refused), ``no_effect`` (accepted; a note says why it changes nothing).
        help: what hf-zero run does with it (shown by ``hf-zero run --help``).
    """

    name: str
    strings: tuple[str, ...]
    flag: bool
    effect: str
    help: str


DEEPSPEED_OPTIONS: tuple[DeepSpeedOption, ...] = (
    DeepSpeedOption("num_gpus", ("--num_gpus", "--num_accelerators"), False, "use",
                    "run N processes on GPUs 0..N-1 (the first N visible ones); on a CPU machine, N CPU processes"),
    DeepSpeedOption("include", ("-i", "--include"), False, "use",
                    "localhost:0,1 -> CUDA_VISIBLE_DEVICES=0,1 and one process per listed GPU"),
    DeepSpeedOption("exclude", ("-e", "--exclude"), False, "use",
                    "localhost:1 -> every visible GPU but 1 (CUDA_VISIBLE_DEVICES), one process each"),
    DeepSpeedOption("num_nodes", ("--num_nodes",), False, "use",
                    "1 only: for several nodes, start hf-zero run --nnodes N --node_rank R on each"),
    DeepSpeedOption("master_port", ("--master_port",), False, "use", "port the ranks meet on (127.0.0.1)"),
    DeepSpeedOption("master_addr", ("--master_addr",), False, "use",
                    "ignored on one node, as DeepSpeed's launcher does (ranks meet on 127.0.0.1)"),
    DeepSpeedOption("node_rank", ("--node_rank",), False, "use", "0 only (one node)"),
    DeepSpeedOption("module", ("--module",), True, "use", "run SCRIPT as a module (python -m SCRIPT)"),
    DeepSpeedOption("no_python", ("--no_python",), True, "use",
                    "refused: the script would start without Python, so without hf_zero"),
    DeepSpeedOption("no_local_rank", ("--no_local_rank",), True, "use", "do not pass --local_rank=N to the script"),
    DeepSpeedOption("enable_each_rank_log", ("--enable_each_rank_log",), False, "use",
                    "DIR: each rank's stdout/stderr go to files under DIR (torchrun --log-dir DIR --redirects 3)"),
    DeepSpeedOption("hostfile", ("-H", "--hostfile"), False, "multinode",
                    "refused: run hf-zero run --nnodes N --node_rank R --master_addr ADDR on each host"),
    DeepSpeedOption("force_multi", ("--force_multi",), True, "multinode", "refused (multi-node launcher mode)"),
    DeepSpeedOption("launcher", ("--launcher",), False, "no_effect", "no effect on one node (multi-node backend)"),
    DeepSpeedOption("launcher_args", ("--launcher_args",), False, "no_effect",
                    "no effect on one node (multi-node backend arguments)"),
    DeepSpeedOption("no_ssh", ("--no_ssh",), True, "no_effect", "no effect: hf-zero run never uses ssh"),
    DeepSpeedOption("no_ssh_check", ("--no_ssh_check",), True, "no_effect", "no effect: hf-zero run never uses ssh"),
    DeepSpeedOption("ssh_port", ("--ssh_port",), False, "no_effect", "no effect: hf-zero run never uses ssh"),
    DeepSpeedOption("venv_script", ("--venv_script",), False, "no_effect",
                    "no effect on one node (sourced on remote hosts only)"),
    DeepSpeedOption("save_pid", ("--save_pid",), True, "no_effect",
                    "no effect: no /tmp/<pid>.deepspeed file is written (hf-zero run's own pid is the launcher's)"),
    DeepSpeedOption("bind_cores_to_rank", ("--bind_cores_to_rank",), True, "no_effect",
                    "no effect: no numactl binding; each rank gets cores/N OpenMP threads (set OMP_NUM_THREADS to choose)"),
    DeepSpeedOption("bind_core_list", ("--bind_core_list",), False, "no_effect",
                    "no effect: no numactl binding; each rank gets cores/N OpenMP threads (set OMP_NUM_THREADS to choose)"),
    DeepSpeedOption("log_level", ("--log_level",), False, "no_effect", "no effect: DeepSpeed launcher's own log level"),
    DeepSpeedOption("quiet", ("-q", "--quiet"), True, "no_effect", "no effect: DeepSpeed launcher's own log level"),
    DeepSpeedOption("autotuning", ("--autotuning",), False, "refuse",
                    "refused: DeepSpeed's autotuner is not part of hf_zero"),
)


def add_deepspeed_options(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Add DeepSpeed's launcher options that ``parser`` (already holding torchrun's) lacks.

    An option torchrun has under the same name (``--master_port``, ``--master_addr``,
    ``--node_rank``, ``--module``, ``--no_python``) stays torchrun's one option: a line using only
    those is a torchrun line.

    Returns:
        DeepSpeed name -> the key it is recorded under in the parsed line: ``deepspeed.NAME`` for
        options added here, torchrun's dest for the shared ones.
    """
    group = parser.add_argument_group(
        "DeepSpeed launcher options (one node)",
        "`deepspeed ... train.py` lines run unchanged as `hf-zero run ... train.py`: the ranks get "
        "--local_rank=N as DeepSpeed passes it. Not to be mixed with torchrun-only options.",
    )
    owners = parser._option_string_actions  # argparse's own table of declared option strings
    keys: dict[str, str] = {}
    for opt in DEEPSPEED_OPTIONS:
        if any(s in owners and owners[s].dest == opt.name for s in opt.strings):
            keys[opt.name] = opt.name  # torchrun has it: one option, recorded under torch's dest
            continue
        free = [s for s in opt.strings if s not in owners]
        if not free:
            continue
        group.add_argument(*free, dest=f"deepspeed.{opt.name}", action=RecordOption, nargs=0 if opt.flag else None,
                           default=argparse.SUPPRESS, metavar=None if opt.flag else opt.name.upper(), help=opt.help)
        keys[opt.name] = f"deepspeed.{opt.name}"
    shared = [opt for opt in DEEPSPEED_OPTIONS if keys.get(opt.name) == opt.name]
    if shared:
        group.description += " Also DeepSpeed's " + "; ".join(f"{o.strings[0]}: {o.help}" for o in shared) + \
            " (the torchrun options of the same name)."
    return keys


def deepspeed_request(given: Mapping[str, Given], script: str, script_args: Sequence[str], *,
                      gpu_count: int, env: Mapping[str, str]) -> LaunchRequest:
    """The request of a DeepSpeed-launcher line, in torchrun's terms.

    Args:
        given: DeepSpeed name -> the option as given (see :func:`add_deepspeed_options`).
        script, script_args: the script and its arguments.
        gpu_count: GPUs visible to this process.
        env: the environment (``CUDA_VISIBLE_DEVICES``).

    Raises:
        LaunchLineError: a multi-node line (with the per-node ``hf-zero run`` command), a refused
            option, or GPUs that do not exist.
    """
    command = shlex.join([script, *script_args])
    port = _int(given, "master_port")
    for name in ("hostfile", "force_multi"):
        if name in given:
            raise _multinode_error(given[name], given, command, port)
    num_nodes = _int(given, "num_nodes")
    if num_nodes is not None and num_nodes > 1:
        raise _multinode_error(given["num_nodes"], given, command, port, nodes=num_nodes)
    node_rank = _int(given, "node_rank")
    if node_rank not in (None, 0, -1):  # DeepSpeed's default is -1; one node is node 0
        raise _multinode_error(given["node_rank"], given, command, port)
    for name in ("no_python", "autotuning"):
        if name in given:
            spelling = given[name].spelling
            why = ("the script would start without Python, so without hf_zero's bootstrap; drop it for a Python script"
                   if name == "no_python" else "DeepSpeed's autotuner is not part of hf_zero; drop it and tune with "
                   "hf-zero estimate")
            raise LaunchLineError(f"{spelling}: {why}")

    selection = [n for n in ("include", "exclude") if n in given]
    if len(selection) == 2:
        raise LaunchLineError("--include and --exclude are mutually exclusive (as in DeepSpeed's launcher): keep one")
    # DeepSpeed refuses any explicit value >= 0 here (its defaults are -1), 0 included
    counted = [n for n in ("num_nodes", "num_gpus") if n in given and _int(given, n) >= 0]
    if selection and counted:
        raise LaunchLineError(f"--{counted[0]} with --{selection[0]}: DeepSpeed's launcher refuses this pair; "
                              f"--{selection[0]} already says which GPUs (and so how many) to use")

    notes: list[str] = []
    rank_env: dict[str, str] = {}
    options: dict[str, Given] = {}
    visible = _visible_gpus(gpu_count, env)
    nproc = None
    if selection:
        devices = _select(selection[0], given[selection[0]].value or "", visible, env)
        rank_env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        nproc = len(devices)
        notes.append(f"hf-zero run: {given[selection[0]].spelling} {given[selection[0]].value}: "
                     f"CUDA_VISIBLE_DEVICES={rank_env['CUDA_VISIBLE_DEVICES']}, {nproc} process(es)")
    elif (_int(given, "num_gpus") or 0) > 0:
        nproc = _int(given, "num_gpus")
        if gpu_count and nproc > gpu_count:
            raise LaunchLineError(f"--num_gpus {nproc} but {gpu_count} GPU(s) are visible: use --num_gpus {gpu_count} "
                                  "or fewer (check CUDA_VISIBLE_DEVICES)")
    if nproc is not None:
        options["nproc_per_node"] = Given("--nproc_per_node", str(nproc))
        # DeepSpeed counts GPUs from 0 ignoring CUDA_VISIBLE_DEVICES; say so only where that picks others
        # (--include names GPUs explicitly, and they were checked to be in the list).
        renumbered = visible is not None and visible != [str(i) for i in range(len(visible))]
        if env.get("CUDA_VISIBLE_DEVICES") and renumbered and "include" not in selection:
            notes.append(f"hf-zero run: GPUs chosen among CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} "
                         "(DeepSpeed's launcher would ignore it when --exclude/--num_gpus is given)")
    if port is not None:
        options["master_port"] = Given("--master_port", str(port))
    if "master_addr" in given and _slurm_nodes(env) > 1:
        # an srun step on several nodes: hf-zero run completes the line from SLURM (plan.slurm_options),
        # and an address the line gives is where the nodes meet, as every option the line gives wins
        options["master_addr"] = given["master_addr"]
    elif "master_addr" in given:
        notes.append(f"hf-zero run: {given['master_addr'].spelling} {given['master_addr'].value} is ignored on one "
                     "node, as DeepSpeed's launcher does: the ranks meet on 127.0.0.1")
    log_dir = given["enable_each_rank_log"].value if "enable_each_rank_log" in given else None
    if log_dir and log_dir != "None":  # "None" is DeepSpeed's own spelling of "off"
        options["log_dir"] = Given("--log-dir", log_dir)
        options["redirects"] = Given("--redirects", "3")
        notes.append(f"hf-zero run: --enable_each_rank_log {log_dir}: each rank's stdout/stderr go to "
                     f"{log_dir}/<run id>/attempt_0/<rank>/stdout.log and stderr.log (torchrun's layout)")
    for opt in DEEPSPEED_OPTIONS:
        if opt.effect == "no_effect" and opt.name in given:
            notes.append(f"hf-zero run: {given[opt.name].spelling}: {opt.help}")
    return LaunchRequest(form="deepspeed", options=options, script=script, script_args=tuple(script_args),
                         module="module" in given, env=rank_env, pass_local_rank="no_local_rank" not in given,
                         notes=tuple(notes))


def _slurm_nodes(env: Mapping[str, str]) -> int:
    """Nodes of the SLURM job ``env`` describes (0 outside SLURM, or where its variables cannot be
    read: planning reads them again and reports why)."""
    try:
        allocation = read_slurm_env(env)
    except SlurmEnvError:
        return 0
    return allocation.nnodes if allocation else 0


def _int(given: Mapping[str, Given], name: str) -> int | None:
    if name not in given:
        return None
    g = given[name]
    try:
        return int(g.value or "")
    except ValueError:
        raise LaunchLineError(f"{g.spelling} {g.value!r}: expected an integer") from None


def _visible_gpus(gpu_count: int, env: Mapping[str, str]) -> list[str] | None:
    """Ids of the GPUs this process sees: CUDA_VISIBLE_DEVICES's entries when set, else 0..n-1;
    ``None`` without a GPU (then --include is taken as written)."""
    if not gpu_count:
        return None
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed:
        return [d.strip() for d in listed.split(",")][:gpu_count]
    return [str(i) for i in range(gpu_count)]


def _parse_node_specs(option: str, text: str) -> dict[str, list[int]]:
    """DeepSpeed's NODE_SPEC[@NODE_SPEC ...] with NODE_SPEC = NAME[:SLOT[,SLOT ...]] (runner.py's
    parse_node_config_list): host -> sorted unique slots (empty: every slot)."""
    hosts: dict[str, list[int]] = {}
    for spec in text.split("@"):
        name, _, slots = spec.partition(":")
        try:
            ids = [int(s) for s in slots.split(",")] if slots else []
        except ValueError:
            raise LaunchLineError(f"{option} {text}: GPU ids must be integers (e.g. {option} localhost:0,1)") from None
        if not name:
            raise LaunchLineError(f"{option} {text}: every entry needs a host name (e.g. {option} localhost:0,1)")
        hosts.setdefault(name, []).extend(ids)
    return {h: sorted(set(ids)) for h, ids in hosts.items()}


def _select(option: str, text: str, visible: list[str] | None, env: Mapping[str, str]) -> list[str]:
    """GPU ids (as CUDA_VISIBLE_DEVICES entries) that ``--include``/``--exclude`` leave."""
    flag = f"--{option}"
    hosts = _parse_node_specs(flag, text)
    others = [h for h in hosts if h != "localhost"]
    if others:
        raise LaunchLineError(
            f"{flag} {text} names host(s) {', '.join(others)}: without a hostfile DeepSpeed's launcher (and hf-zero "
            f"run) knows only localhost (e.g. {flag} localhost:0,1). For several nodes, start hf-zero run --nnodes N "
            "--node_rank R --master_addr NODE0_ADDRESS on each node")
    slots = [str(s) for s in hosts.get("localhost", [])]
    where = (f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}" if env.get("CUDA_VISIBLE_DEVICES")
             else f"{len(visible or [])} visible GPU(s)")
    if visible is None and (option == "exclude" or not slots):
        raise LaunchLineError(f"{flag} {text}: no GPU is visible to count from; name the GPUs "
                              "(--include localhost:0,1) or use --num_gpus N")
    missing = [s for s in slots if visible is not None and s not in visible]
    if missing:
        raise LaunchLineError(f"{flag} {text}: GPU {', '.join(missing)} is not among the {where} "
                              f"({','.join(visible or [])}); name GPUs from that list")
    if option == "include":
        return slots or list(visible or [])
    left = [d for d in visible or [] if slots and d not in slots]
    if not left:
        raise LaunchLineError(f"{flag} {text} leaves no GPU to run on ({where})")
    return left


def _hostfile_hosts(path: str) -> list[tuple[str, int]] | None:
    """(host, slots) rows of an MPI-style hostfile (``worker-0 slots=4``), as DeepSpeed reads it;
    ``None`` when it cannot be read (the message then shows the generic per-node command)."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError:
        return None
    hosts = []
    for line in lines:
        match = re.search(r"^(\S+)\s+slots=(\d+)", line.strip())
        if match and not line.strip().startswith("#"):
            hosts.append((match.group(1), int(match.group(2))))
    return hosts or None


def _multinode_error(cause: Given, given: Mapping[str, Given], command: str, port: int | None,
                     nodes: int | None = None) -> LaunchLineError:
    port = port or _DEEPSPEED_DEFAULT_PORT
    what = cause.spelling if cause.value is None else f"{cause.spelling} {cause.value}"
    lines = [f"{what}: a multi-node DeepSpeed launch (it ssh-es into every host). hf-zero run starts the ranks of "
             "one node, like torchrun: start it on every node instead, with the same --master_addr (node 0's "
             "address) and --node_rank 0..N-1:"]
    hosts = _hostfile_hosts(given["hostfile"].value or "") if "hostfile" in given else None
    if hosts:
        for rank, (host, slots) in enumerate(hosts):
            lines.append(f"  on {host}: hf-zero run --nnodes {len(hosts)} --node_rank {rank} --master_addr {hosts[0][0]} "
                         f"--master_port {port} --nproc_per_node {slots} {command}")
    else:
        count = nodes or "N"
        lines.append(f"  on node R: hf-zero run --nnodes {count} --node_rank R --master_addr NODE0_ADDRESS "
                     f"--master_port {port} --nproc_per_node GPUS_PER_NODE {command}")
    return LaunchLineError("\n".join(lines))
