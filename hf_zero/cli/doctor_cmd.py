"""``hf-zero doctor``: check this machine's GPUs, collectives and ZeRO paths (26 s on one H100).

Examples::

    hf-zero doctor                                   # one process per visible GPU
    hf-zero doctor --zero_config ds_config.json --nvme_path /local_nvme

Exit status: 0 when every check passed (warnings allowed), 1 when one failed or hung.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check GPUs, NCCL and every ZeRO stage/offload path on this machine",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--nproc_per_node", "--nproc-per-node", type=int, default=None,
                   help="processes (default: the visible GPUs; 2 CPU processes without a GPU)")
    p.add_argument("--zero_config", "--deepspeed", default=None, help="also train with this config's zero_optimization")
    p.add_argument("--nvme_path", "--nvme-path", default=None, help="folder for the NVMe offload cases")
    p.add_argument("--timeout", type=float, default=110.0, help="seconds before running ranks count as hung")
    p.add_argument("--keep", default=None, metavar="DIR", help="keep the ranks' logs and results in DIR")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--inject", default="", help=argparse.SUPPRESS)  # tests break one check on purpose
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hf_zero.diagnostics.doctor import render, run_doctor

    report = run_doctor(args.nproc_per_node, zero_config=args.zero_config, nvme_path=args.nvme_path,
                        timeout_s=args.timeout, keep=args.keep, inject=args.inject)
    print(report.to_json() if args.json else render(report))
    sys.stdout.flush()
    return 0 if report.ok else 1
