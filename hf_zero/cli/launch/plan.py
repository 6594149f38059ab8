"""``hf-zero run``'s plan: the torchrun argv (ranks run hf_zero's bootstrap) and the environment."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hf_zero.cli.launch.line import launch_request, parse_launch_line
from hf_zero.cli.launch.request import Given, LaunchLineError, LaunchRequest
from hf_zero.cli.launch.slurm import SlurmAllocation, SlurmEnvError, in_slurm_job, read_slurm_env
from hf_zero.cli.launch.torchrun_form import (
    local_world_size,
    nnodes_range,
    parse_torchrun_args,
    render_options,
    torchrun_request,
)
from hf_zero.integration.bootstrap import PASS_LOCAL_RANK_ENV
from hf_zero.offload.step_threads import CHOSEN_ENV as STEP_THREADS_CHOSEN_ENV

__all__ = ["BOOTSTRAP_MODULE", "LaunchPlan", "P2P_FIXED_DRIVER", "SLURM_MASTER_PORT", "nccl_env_for_gpus", "p2p_usable",
           "plan_launch", "plan_launch_line", "plan_request", "slurm_options", "torchrun_namespace"]

BOOTSTRAP_MODULE = "hf_zero.integration.bootstrap"
# The port node 0 listens on in a SLURM job when the line gives none: torchrun's own default, so
# the port to open between nodes is the one torch documents.
SLURM_MASTER_PORT = 29500

# GeForce/consumer cards whose NCCL P2P/IB paths fail without these variables (source 001:
# "RTX 3090 or 4000 series doesn't support faster communication ... set NCCL_P2P_DISABLE=1 and
# NCCL_IB_DISABLE=1").
_CONSUMER_GPU = re.compile(r"(GeForce|RTX\s*[2345]0\d0|RTX\s*A?[2345]000\b|TITAN)", re.IGNORECASE)
_NCCL_CONSUMER_VARS = {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"}
# RTX 40xx cards report peer access, but NCCL's P2P path hangs on them with drivers older than
# this one (review F10; accelerate's check_cuda_p2p_ib_support applies the same rule), so the
# driver's answer alone cannot be trusted there. The doctor's live NCCL test is the ground truth.
_RTX40 = re.compile(r"RTX\s*40\d0", re.IGNORECASE)
P2P_FIXED_DRIVER = "550.40.07"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def p2p_usable(gpu_names: Sequence[str], reported: bool, driver_version: str | None) -> bool:
    """Whether NCCL may use peer-to-peer between these GPUs: the driver says so (``reported``)
    and the cards are not RTX 40xx on a driver older than :data:`P2P_FIXED_DRIVER`.

    >>> p2p_usable(["NVIDIA GeForce RTX 4090"] * 2, True, "535.54.03")
    False
    >>> p2p_usable(["NVIDIA GeForce RTX 4090"] * 2, True, "550.54.14")
    True
    """
    if not reported:
        return False
    if driver_version and any(_RTX40.search(n) for n in gpu_names):
        try:
            return _version(driver_version) >= _version(P2P_FIXED_DRIVER)
        except ValueError:
            return True
    return True


def nccl_env_for_gpus(gpu_names: Sequence[str], p2p_ok: bool, env: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """NCCL variables to add for these GPUs, and the notes to print about them.

    Only when several consumer cards without peer access are present, and never over a value
    the user set.

    Example::

        >>> nccl_env_for_gpus(["NVIDIA GeForce RTX 3090"] * 2, p2p_ok=False, env={})[0]
        {'NCCL_P2P_DISABLE': '1', 'NCCL_IB_DISABLE': '1'}
    """
    if len(gpu_names) < 2 or p2p_ok or not any(_CONSUMER_GPU.search(n) for n in gpu_names):
        return {}, []
    added = {k: v for k, v in _NCCL_CONSUMER_VARS.items() if k not in env}
    notes = []
    if added:
        notes.append(
            f"hf-zero run: {gpu_names[0]} cards without P2P access: setting "
            + " ".join(f"{k}={v}" for k, v in added.items())
            + " (NCCL hangs or fails on these cards otherwise; set them yourself to override)"
        )
    return added, notes


@dataclass(frozen=True)
class LaunchPlan:
    """The torchrun arguments and extra environment of one ``hf-zero run``.

    Attributes:
        torchrun_args: the whole torchrun command line (shown to the user; tests read it).
        env: variables to add for the ranks.
        notes: lines to print before launching.
        rank_args_at: ``torchrun_args[rank_args_at:]`` are the bootstrap's arguments (SCRIPT and its
            own arguments), handed to each rank as they are: :func:`torchrun_namespace` never lets
            torch's parser read them (it would take a script's ``--log`` for its ``--log-dir``).
    """

    torchrun_args: list[str]
    env: dict[str, str]
    notes: list[str]
    rank_args_at: int | None = None


def torchrun_namespace(plan: LaunchPlan):
    """What ``torch.distributed.run.run`` is given for ``plan``: torch's parser reads the launcher
    options and the bootstrap module, and SCRIPT with its arguments are set after it, untouched.

    Raises:
        LaunchLineError: torch's parser refused an option.
    """
    at = len(plan.torchrun_args) if plan.rank_args_at is None else plan.rank_args_at
    namespace = parse_torchrun_args(plan.torchrun_args[:at])
    namespace.training_script_args = list(plan.torchrun_args[at:])
    return namespace


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _line_value(dest: str, options: Mapping[str, Given], env: Mapping[str, str]) -> str | None:
    """What the line gives for torchrun option ``dest``, or the ``PET_<DEST>`` variable torchrun
    reads for it (``""`` for a flag); ``None`` when neither does."""
    if dest in options:
        return options[dest].value or ""
    value = env.get(f"PET_{dest.upper()}", "").strip()
    return value or None


def slurm_options(options: Mapping[str, Given], env: Mapping[str, str],
                  gpu_names: Sequence[str] = ()) -> tuple[dict[str, Given], list[str]]:
    """``options`` completed from the SLURM job ``hf-zero run`` runs in, and the notes to print.

    In a job of several nodes (``SLURM_JOB_ID`` and a node list set; one ``srun`` task per node),
    the options the line leaves out are taken from SLURM: ``--nnodes`` (the node count),
    ``--node_rank`` (``SLURM_NODEID``), ``--master_addr`` (the node list's first host) and
    ``--master_port`` (:data:`SLURM_MASTER_PORT`); ``--nproc_per_node`` from ``SLURM_GPUS_ON_NODE``
    when that is set. What the line gives (or torchrun's ``PET_*`` variables) always wins. A line
    with its own rendezvous takes only what that rendezvous uses (``--rdzv_endpoint``: no address
    or port; a backend other than ``static``: only ``--nnodes``); ``--standalone`` or ``--nnodes 1``
    takes nothing. Outside SLURM, or in a one-node job, ``options`` come back unchanged.

    Raises:
        SlurmEnvError: SLURM variables that cannot be read (see :func:`read_slurm_env`), more tasks
            than nodes (``srun`` started one ``hf-zero run`` per GPU), or ``SLURM_GPUS_ON_NODE``
            above the GPUs this process sees.
    """
    options = dict(options)
    if not in_slurm_job(env):
        return options, []
    nnodes_spec = _line_value("nnodes", options, env)
    standalone = "standalone" in options or env.get("PET_STANDALONE", "").strip() not in ("", "0")
    if standalone or (nnodes_spec is not None and nnodes_range(nnodes_spec)[1] == 1):
        return options, _one_node_note("--standalone" if standalone else f"--nnodes {nnodes_spec}", env)
    backend = _line_value("rdzv_backend", options, env) or "static"
    # static rendezvous: node_rank numbers the nodes and master_addr:master_port is where they meet,
    # unless --rdzv_endpoint names that place; other backends number the nodes themselves.
    wanted = ["nnodes"]
    if backend == "static":
        wanted.append("node_rank")
        if _line_value("rdzv_endpoint", options, env) is None:
            wanted += ["master_addr", "master_port"]
    wanted = [dest for dest in wanted if _line_value(dest, options, env) is None]
    if not wanted or wanted == ["master_port"]:
        return options, []  # the line says how many nodes, which one this is and where they meet
    allocation = read_slurm_env(env)
    if allocation is None or allocation.nnodes == 1:
        return options, []
    _check_one_task_per_node(allocation)
    values = {"nnodes": str(allocation.nnodes), "node_rank": str(allocation.node_id),
              "master_addr": allocation.hosts[0], "master_port": str(SLURM_MASTER_PORT)}
    taken = {dest: Given(f"--{dest}", values[dest]) for dest in wanted}
    sources = {
        "nnodes": f"{allocation.nnodes_var}={allocation.nnodes}" if allocation.nnodes_var
        else f"{allocation.nnodes} hosts in {allocation.nodelist_var}",
        "node_rank": f"SLURM_NODEID={allocation.node_id}",
        "master_addr": f"first host of {allocation.nodelist_var}={env[allocation.nodelist_var].strip()}",
    }
    if allocation.gpus_on_node and _line_value("nproc_per_node", options, env) is None:
        if gpu_names and allocation.gpus_on_node > len(gpu_names):
            raise SlurmEnvError(
                f"SLURM_GPUS_ON_NODE={allocation.gpus_on_node} but {len(gpu_names)} GPU(s) are visible to this "
                f"process (check CUDA_VISIBLE_DEVICES): give --nproc_per_node {len(gpu_names)} or fewer on the "
                "hf-zero run line")
        taken = {"nproc_per_node": Given("--nproc_per_node", str(allocation.gpus_on_node)), **taken}
        sources = {"nproc_per_node": f"SLURM_GPUS_ON_NODE={allocation.gpus_on_node}", **sources}
    note = (f"hf-zero run: from SLURM: {' '.join(f'{g.spelling} {g.value}' for g in taken.values())} "
            f"(job {allocation.job_id}: {', '.join(sources[dest] for dest in taken if dest in sources)})")
    if "master_port" in taken:
        note += f"; port {SLURM_MASTER_PORT} is torchrun's default, --master_port on the line chooses another"
    if nnodes_spec is not None and nnodes_range(nnodes_spec)[1] != allocation.nnodes:
        note += f"; the line's --nnodes {nnodes_spec} is kept, though the SLURM job has {allocation.nnodes} nodes"
    return {**({"nproc_per_node": taken.pop("nproc_per_node")} if "nproc_per_node" in taken else {}),
            **options, **taken}, [note]


def _check_one_task_per_node(allocation: SlurmAllocation) -> None:
    """Refuse ``srun`` with one task per GPU: every task would start a node's worth of ranks.

    Raises:
        SlurmEnvError: more tasks than nodes.
    """
    if allocation.ntasks is not None and allocation.ntasks > allocation.nnodes:
        nodes = f"{allocation.nnodes_var}={allocation.nnodes}" if allocation.nnodes_var else f"{allocation.nnodes}"
        raise SlurmEnvError(
            f"{allocation.ntasks_var}={allocation.ntasks} tasks on {nodes} nodes: srun started more than one hf-zero "
            "run per node (one per GPU?), but hf-zero run starts each node's per-GPU processes itself "
            "(--nproc_per_node). Start one task per node: `srun --ntasks-per-node=1 hf-zero run --nproc_per_node "
            "GPUS_PER_NODE train.py ...` (and #SBATCH --ntasks-per-node=1 in the job script)")


def _one_node_note(spelling: str, env: Mapping[str, str]) -> list[str]:
    """The note for a line that runs one node inside a SLURM job of several (none when the job's
    variables cannot be read: the line does not need them)."""
    try:
        allocation = read_slurm_env(env)
    except SlurmEnvError:
        return []
    if allocation is None or allocation.nnodes == 1:
        return []
    return [f"hf-zero run: the SLURM job has {allocation.nnodes} nodes, but {spelling} runs this node's ranks on "
            f"their own: nothing is taken from SLURM (drop {spelling} to train on all {allocation.nnodes} nodes)"]


def plan_request(request: LaunchRequest, *, gpu_names: Sequence[str] = (), p2p_ok: bool = True,
                 env: Mapping[str, str] | None = None) -> LaunchPlan:
    """Build the torchrun argv and the environment for ``request`` (pure: no process is started).

    Inside a SLURM job of several nodes, the options the line leaves out are taken from SLURM
    first (:func:`slurm_options`).

    Args:
        request: the launch line in torchrun's terms (:func:`plan_launch_line` makes it).
        gpu_names: the GPUs visible to this process (their count is the default process count).
        p2p_ok: whether every pair of them has peer access (NCCL variables for consumer cards).
        env: the environment the launch starts from (default: ``os.environ``).

    Raises:
        LaunchLineError: a value torch's parser refuses, more processes than GPUs, or SLURM
            variables that cannot be used (:class:`~hf_zero.cli.launch.slurm.SlurmEnvError`).
    """
    env = dict(os.environ if env is None else env)
    options, slurm_notes = slurm_options(request.options, env, gpu_names)
    if "nproc_per_node" not in options and "PET_NPROC_PER_NODE" not in env:
        options = {"nproc_per_node": Given("--nproc_per_node", str(max(1, len(gpu_names)))), **options}
    args = render_options(options)
    parsed = parse_torchrun_args([*args, request.script])  # typed and checked by torch, as torchrun will
    _, max_nodes = nnodes_range(parsed.nnodes)
    # Whether a port was asked for, not parsed.master_port: torch 2.11 and older default it to
    # 29500 (two runs on one machine then collide), 2.13 to None.
    port_given = "master_port" in options or bool(env.get("PET_MASTER_PORT"))
    if (not parsed.standalone and parsed.rdzv_backend == "static" and not parsed.rdzv_endpoint
            and not port_given and max_nodes == 1):
        # torchrun 2.13 itself turns this case into a c10d rendezvous on a free local port
        # (run()); saying --standalone does it on every torch, and the logged command shows it.
        args.append("--standalone")
    nproc = local_world_size(parsed.nproc_per_node, len(gpu_names), _cores())
    if gpu_names and nproc > len(gpu_names):
        # Each rank takes GPU LOCAL_RANK (distributed/device.py select_device): the extra ranks would fail there.
        raise LaunchLineError(
            f"--nproc_per_node {parsed.nproc_per_node} starts {nproc} processes but {len(gpu_names)} GPU(s) are "
            f"visible: each rank uses GPU LOCAL_RANK, so run at most {len(gpu_names)} (--nproc_per_node "
            f"{len(gpu_names)}), or check CUDA_VISIBLE_DEVICES")
    args += ["-m", request.bootstrap or BOOTSTRAP_MODULE]
    rank_args_at = len(args)
    args += [*(["-m"] if request.module else []), request.script, *request.script_args]

    extra = dict(request.env)
    if request.pass_local_rank:
        extra[PASS_LOCAL_RANK_ENV] = "1"
    nccl, notes = nccl_env_for_gpus(gpu_names, p2p_ok, env)
    extra.update(nccl)
    if "OMP_NUM_THREADS" not in env and "OMP_NUM_THREADS" not in extra and nproc > 1:
        # Ranks share the node's cores. torchrun would give each GPU rank a single thread, and the
        # offloaded optimizer step (a CPU AdamW over the rank's whole shard) would run on one core.
        extra["OMP_NUM_THREADS"] = str(max(1, _cores() // nproc))
    if "OMP_NUM_THREADS" in extra:
        # Chosen here or on the line: the ranks must not take a 1 for torchrun's default and raise it
        # for the offloaded step (offload/step_threads.py); a value from the user's environment is
        # seen as theirs by the ranks without this mark.
        extra[STEP_THREADS_CHOSEN_ENV] = "1"
    return LaunchPlan(torchrun_args=args, env=extra, notes=[*request.notes, *slurm_notes, *notes],
                      rank_args_at=rank_args_at)


def plan_launch_line(argv: Sequence[str], *, gpu_names: Sequence[str] = (), p2p_ok: bool = True,
                     env: Mapping[str, str] | None = None) -> LaunchPlan:
    """Plan the line after ``hf-zero run`` (torchrun's or DeepSpeed's launcher options, SCRIPT, args).

    Example::

        >>> plan_launch_line(["--num_gpus", "2", "train.py", "--deepspeed", "ds.json"], env={}).torchrun_args
        ['--nproc_per_node=2', '--standalone', '-m', 'hf_zero.integration.bootstrap', 'train.py', '--deepspeed', 'ds.json']

    Raises:
        LaunchLineError: the line cannot run (the message names the option and what to do).
    """
    env = dict(os.environ if env is None else env)
    request = launch_request(parse_launch_line(argv), gpu_count=len(gpu_names), env=env)
    return plan_request(request, gpu_names=gpu_names, p2p_ok=p2p_ok, env=env)


def plan_launch(
    script: str,
    script_args: Sequence[str],
    *,
    nproc_per_node: int | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
    gpu_names: Sequence[str] = (),
    p2p_ok: bool = True,
    env: Mapping[str, str] | None = None,
) -> LaunchPlan:
    """Keyword form of :func:`plan_launch_line` for the common options (pure: no process is started).

    One node without ``--master_addr`` uses ``--standalone`` (a free local port is picked); several
    nodes meet at ``master_addr:master_port`` (default 127.0.0.1:29500).
    """
    options: dict[str, Given] = {}
    if nproc_per_node:
        options["nproc_per_node"] = Given("--nproc_per_node", str(nproc_per_node))
    if nnodes != 1 or master_addr is not None:
        options["nnodes"] = Given("--nnodes", str(nnodes))
        options["node_rank"] = Given("--node_rank", str(node_rank))
        options["master_addr"] = Given("--master_addr", master_addr or "127.0.0.1")
        options["master_port"] = Given("--master_port", str(master_port or 29500))
    request = torchrun_request(options, script, list(script_args))
    return plan_request(request, gpu_names=gpu_names, p2p_ok=p2p_ok, env=env)
