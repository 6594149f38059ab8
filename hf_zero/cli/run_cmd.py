"""``hf-zero run``: launch an unmodified Trainer script on N ranks with hf_zero underneath."""

from __future__ import annotations

import argparse
import os
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="run a Trainer script on several processes with --zero_config/--deepspeed routed to hf_zero",
        description=(
            "Runs SCRIPT with torch's elastic launcher (torchrun). Inside each rank, transformers' Trainer "
            "and TrainingArguments are replaced by hf_zero's, so --zero_config ds.json (or --deepspeed "
            "ds.json) trains with ZeRO without DeepSpeed. Example: hf-zero run --nproc_per_node 2 "
            "finetune.py --zero_config ds_zero3.json --output_dir out --bf16 True"
        ),
    )
    p.add_argument("--nproc_per_node", type=int, default=None, help="processes per node (default: GPU count, or 1)")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node_rank", type=int, default=0)
    p.add_argument("--master_addr", default=None)
    p.add_argument("--master_port", type=int, default=None)
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=run)


def _gpus() -> tuple[list[str], bool]:
    from hf_zero.distributed import device as accel

    if not accel.accelerator_available():
        return [], True
    names = [accel.device_name(i) for i in range(accel.device_count())]
    p2p = all(accel.can_access_peer(i, j) for i in range(len(names)) for j in range(len(names)) if i != j)
    return names, p2p


def run(args: argparse.Namespace) -> int:
    from hf_zero.cli.launch import plan_launch

    if not os.path.isfile(args.script):
        print(f"hf-zero run: training script not found: {args.script}", file=sys.stderr)
        return 2
    names, p2p = _gpus()
    plan = plan_launch(
        args.script,
        args.script_args,
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        gpu_names=names,
        p2p_ok=p2p,
    )
    for note in plan.notes:
        print(note, file=sys.stderr)
    os.environ.update(plan.env)
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(plan.torchrun_args)
    except SystemExit as exc:  # torchrun exits with the failing rank's code
        return int(exc.code or 0)
    except Exception as exc:  # ChildFailedError: the ranks already printed their tracebacks
        print(f"hf-zero run: {type(exc).__name__}: training failed (see the rank output above)", file=sys.stderr)
        return 1
    return 0
