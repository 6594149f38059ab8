"""``hf-zero run``'s launch lines: torchrun's options (from torch's own parser) or the DeepSpeed
launcher's one-node options, planned into a torchrun command whose ranks run hf_zero's bootstrap.

Modules: ``request`` (shared types), ``torchrun_form`` and ``deepspeed_form`` (one per launcher),
``line`` (the parser; which form a line is), ``plan`` (argv, environment, process count; the
options a SLURM job supplies), ``slurm`` (SLURM's hostlists and variables, read).
"""

from hf_zero.cli.launch.line import build_launch_parser, launch_request, parse_launch_line
from hf_zero.cli.launch.plan import (
    BOOTSTRAP_MODULE,
    LaunchPlan,
    nccl_env_for_gpus,
    plan_launch,
    plan_launch_line,
    plan_request,
    torchrun_namespace,
)
from hf_zero.cli.launch.request import LaunchLineError, LaunchRequest

__all__ = [
    "BOOTSTRAP_MODULE",
    "LaunchLineError",
    "LaunchPlan",
    "LaunchRequest",
    "build_launch_parser",
    "launch_request",
    "nccl_env_for_gpus",
    "parse_launch_line",
    "plan_launch",
    "plan_launch_line",
    "plan_request",
    "torchrun_namespace",
]
