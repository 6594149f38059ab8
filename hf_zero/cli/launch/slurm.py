"""SLURM's description of a job, as ``hf-zero run`` reads it: compressed hostlists and the
variables ``srun`` sets for each task.

Only reading happens here; what ``hf-zero run`` takes from it (``--nnodes``, ``--node_rank``,
``--master_addr``) is decided in :mod:`hf_zero.cli.launch.plan`.

Hostlists follow SLURM's own grammar (``src/common/hostlist.c``, ``scontrol show hostnames``):
entries separated by commas or whitespace; a bracket holds comma-separated numbers and ranges,
whose width is that of the range's first number (``gpu[08-10]`` -> gpu08 gpu09 gpu10); several
brackets in one entry make every combination, the first bracket varying slowest
(``rack[1-2]-node[01-02]`` -> rack1-node01 rack1-node02 rack2-node01 rack2-node02). Hosts keep
SLURM's order, duplicates included.

Inside an ``srun`` step SLURM describes the *step* in ``SLURM_STEP_NODELIST``/``SLURM_STEP_NUM_NODES``
and overwrites ``SLURM_NODELIST``/``SLURM_NNODES`` with the same values, while
``SLURM_JOB_NODELIST``/``SLURM_JOB_NUM_NODES`` keep the whole allocation's (``src/common/env.c``
``env_array_for_step``). ``SLURM_NODEID`` counts within the step, so the step's variables are read
first: ``srun -N2`` inside a 4-node allocation is a 2-node job.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass

from hf_zero.cli.launch.request import LaunchLineError

__all__ = ["MAX_RANGE", "SlurmAllocation", "SlurmEnvError", "expand_hostlist", "in_slurm_job", "read_slurm_env"]

# Variables read first to last: the step's before the job's (see the module docstring).
NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
NNODES_VARS = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
NTASKS_VARS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
JOB_ID_VARS = ("SLURM_JOB_ID", "SLURM_JOBID")
# SLURM's own limit on the hosts one bracket range may name (hostlist.c MAX_RANGE); it also keeps
# a typo such as gpu[1-1000000000] from filling memory.
MAX_RANGE = 64 * 1024

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


class SlurmEnvError(LaunchLineError):
    """A SLURM variable ``hf-zero run`` cannot use; the message names the variable, its value and
    what to do."""


@dataclass(frozen=True)
class SlurmAllocation:
    """The SLURM job (or ``srun`` step) this process runs in, as its environment describes it.

    Attributes:
        job_id: ``SLURM_JOB_ID``.
        hosts: the node names, expanded, in SLURM's order (``hosts[0]`` is node 0).
        nnodes: the node count (equal to ``len(hosts)``).
        node_id: this node's index in ``hosts`` (``SLURM_NODEID``).
        nodelist_var: the variable ``hosts`` was read from (``SLURM_STEP_NODELIST``, ...).
        nnodes_var: the variable ``nnodes`` was read from (``None``: counted from ``hosts``).
        ntasks: tasks in the step or job (``SLURM_STEP_NUM_TASKS``/``SLURM_NTASKS``), if set.
        ntasks_var: the variable ``ntasks`` was read from.
        proc_id: this task's rank among them (``SLURM_PROCID``), if set.
        ntasks_per_node: ``SLURM_NTASKS_PER_NODE`` (set only with ``--ntasks-per-node``), if set.
        gpus_on_node: GPUs SLURM gave this node (``SLURM_GPUS_ON_NODE``), if set.
    """

    job_id: str
    hosts: tuple[str, ...]
    nnodes: int
    node_id: int
    nodelist_var: str
    nnodes_var: str | None = None
    ntasks: int | None = None
    ntasks_var: str | None = None
    proc_id: int | None = None
    ntasks_per_node: int | None = None
    gpus_on_node: int | None = None


def expand_hostlist(text: str, *, variable: str = "hostlist") -> list[str]:
    """The host names of a SLURM hostlist, in SLURM's order.

    Args:
        text: ``gpu[01-04,07]``, ``node1,node2``, ``a[1-2]-ib,b3``, ``rack[1-2]-node[01-02]``...
        variable: the variable ``text`` came from, named in errors.

    Example::

        >>> expand_hostlist("gpu[01-02,07],rack[1-2]-n[8-9] cpu3")
        ['gpu01', 'gpu02', 'gpu07', 'rack1-n8', 'rack1-n9', 'rack2-n8', 'rack2-n9', 'cpu3']

    Raises:
        SlurmEnvError: an unbalanced or nested bracket, an empty or non-numeric bracket element,
            a reversed range (``[5-2]``), or a range of more than :data:`MAX_RANGE` hosts.
    """
    hosts: list[str] = []
    for entry in _entries(text, variable):
        pieces = re.split(r"(\[[^\]]*\])", entry)  # literal, [bracket], literal, ...
        choices = [_bracket(p, text, variable) if p.startswith("[") else [p] for p in pieces]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def _bad(variable: str, text: str, problem: str) -> SlurmEnvError:
    return SlurmEnvError(
        f"{variable}={text!r}: {problem}. SLURM writes node lists such as gpu[01-04,07] (`scontrol show hostnames` "
        f"expands one). If you set {variable} yourself, correct it or unset it; otherwise give --nnodes, --node_rank "
        "and --master_addr on the hf-zero run line")


def _entries(text: str, variable: str) -> list[str]:
    """``text`` split at commas and whitespace outside brackets; empty entries dropped."""
    entries, current, depth = [], [], 0
    for at, char in enumerate(text):
        if char == "[":
            if depth:
                raise _bad(variable, text, f"'[' inside a bracket at position {at} (brackets do not nest)")
            depth = 1
        elif char == "]":
            if not depth:
                raise _bad(variable, text, f"']' without '[' at position {at}")
            depth = 0
        elif depth == 0 and (char == "," or char.isspace()):
            entries.append("".join(current))
            current = []
            continue
        current.append(char)
    if depth:
        raise _bad(variable, text, "'[' is never closed")
    entries.append("".join(current))
    return [e for e in entries if e]


def _bracket(piece: str, text: str, variable: str) -> list[str]:
    """``[01-03,7]`` -> ``['01', '02', '03', '7']``: each range as wide as its first number."""
    names: list[str] = []
    for element in piece[1:-1].split(","):
        element = element.strip()
        match = _RANGE.fullmatch(element)
        if not match:
            what = "an empty element" if not element else f"{element!r}, which is not a number or a range N-M"
            raise _bad(variable, text, f"{piece} holds {what}")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise _bad(variable, text, f"the range {element} in {piece} runs backwards (write {high}-{low})")
        if int(high) - int(low) + 1 > MAX_RANGE:
            raise _bad(variable, text, f"the range {element} names more than {MAX_RANGE} hosts")
        names.extend(f"{n:0{len(low)}d}" for n in range(int(low), int(high) + 1))
    return names


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((n for n in names if env.get(n, "").strip()), None)


def _int(env: Mapping[str, str], name: str | None, *, minimum: int) -> int | None:
    if name is None or not env.get(name, "").strip():
        return None
    text = env[name].strip()
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise SlurmEnvError(
            f"{name}={env[name]!r}: expected a whole number >= {minimum}. SLURM sets it; if you set it yourself, "
            "correct it or unset it")
    return value


def in_slurm_job(env: Mapping[str, str]) -> bool:
    """Whether ``env`` is a SLURM job's: ``SLURM_JOB_ID`` and a node list are set (nothing is parsed)."""
    return _first(env, JOB_ID_VARS) is not None and _first(env, NODELIST_VARS) is not None


def read_slurm_env(env: Mapping[str, str]) -> SlurmAllocation | None:
    """The SLURM job ``env`` describes, or ``None`` outside one (see :func:`in_slurm_job`).

    Raises:
        SlurmEnvError: a node list that does not parse or names no host, a node count that is not
            its length, ``SLURM_NODEID`` missing on several nodes or outside ``0..nnodes-1``, or a
            count that is not a number.
    """
    if not in_slurm_job(env):
        return None
    job_id = env[_first(env, JOB_ID_VARS)].strip()
    nodelist_var = _first(env, NODELIST_VARS)
    text = env[nodelist_var]
    hosts = tuple(expand_hostlist(text, variable=nodelist_var))
    if not hosts:
        raise _bad(nodelist_var, text, "it names no host")
    nnodes_var = _first(env, NNODES_VARS)
    nnodes = _int(env, nnodes_var, minimum=1)
    if nnodes is None:
        nnodes = len(hosts)
    elif nnodes != len(hosts):
        raise SlurmEnvError(
            f"{nnodes_var}={env[nnodes_var]!r} but {nodelist_var}={text!r} names {len(hosts)} host(s) "
            f"({', '.join(hosts[:4])}{', ...' if len(hosts) > 4 else ''}): SLURM sets both to the same job, so "
            "one was set by hand or left over from another job. Make them agree (or unset both), or give "
            "--nnodes, --node_rank and --master_addr on the hf-zero run line")
    node_id = _int(env, "SLURM_NODEID", minimum=0)
    if node_id is None:
        if nnodes > 1:
            raise SlurmEnvError(
                f"SLURM_NODEID is not set, in a {nnodes}-node job ({nodelist_var}={text!r}): srun sets it for each "
                "task. Start hf-zero run with `srun --ntasks-per-node=1 hf-zero run ...` (in the sbatch script), or "
                "give --node_rank on the line")
        node_id = 0
    if node_id >= nnodes:
        raise SlurmEnvError(
            f"SLURM_NODEID={env['SLURM_NODEID']!r} but the job has {nnodes} node(s) ({nodelist_var}={text!r}): "
            f"node ids run 0..{nnodes - 1}. If you set SLURM_NODEID yourself, correct it; otherwise give --node_rank "
            "on the line")
    ntasks_var = _first(env, NTASKS_VARS)
    return SlurmAllocation(
        job_id=job_id,
        hosts=hosts,
        nnodes=nnodes,
        node_id=node_id,
        nodelist_var=nodelist_var,
        nnodes_var=nnodes_var,
        ntasks=_int(env, ntasks_var, minimum=1),
        ntasks_var=ntasks_var,
        proc_id=_int(env, "SLURM_PROCID", minimum=0),
        ntasks_per_node=_int(env, "SLURM_NTASKS_PER_NODE", minimum=1),
        gpus_on_node=_int(env, "SLURM_GPUS_ON_NODE", minimum=0),
    )
