"""``hf-zero estimate``: memory per GPU / node for ZeRO stages 0-3 and a ready ``--zero_config``.

Examples::

    hf-zero estimate --model ./Qwen2-7B --num_gpus 2 --gpu_memory 24GB --cpu_memory 128GB \\
        --lora-rank 16 --gradient_checkpointing
    hf-zero estimate --model 7.5e9 --num_gpus 8 --num_nodes 8 --no_activations --json

Exit status: 0 when some configuration fits, 1 when none does, 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hf_zero.cli.subcommand import add_subcommand, standalone_parser
from hf_zero.estimator.comm_report import (
    DEFAULT_COMPUTE_TFLOPS,
    DEFAULT_INTER_NODE_GBPS,
    DEFAULT_INTRA_NODE_GBPS,
    NODE_SWEEP,
    Links,
    recommend,
    render_plan,
    sweep,
    workload,
)
from hf_zero.estimator import (
    ALL_LINEAR,
    DEFAULT_GPU_RESERVE_BYTES,
    DEFAULT_MICRO_BATCH_SIZE,
    DEFAULT_NVME_PATH,
    DEFAULT_SEQ_LEN,
    DEFAULT_SUB_GROUP_SIZE,
    PRECISIONS,
    EstimatorError,
    estimate,
    parse_param_count,
    render_report,
    zero_config_for,
)

__all__ = ["EXIT_BAD_INPUT", "EXIT_FITS", "EXIT_NOTHING_FITS", "build_parser", "register", "run"]

EXIT_FITS = 0
EXIT_NOTHING_FITS = 1
EXIT_BAD_INPUT = 2

_DESCRIPTION = """\
Estimate the memory of ZeRO stages 0-3, with and without optimizer / parameter offload (cpu, nvme):
per GPU, per node of host RAM and per node of NVMe, for parameters, gradients, Adam state (the ZeRO
paper's K = 12 bytes) and activations. Marks what fits the given memory and prints a --zero_config
JSON for the fastest configuration that fits. The model is read from its config, never its weights.

Sizes: "24GB", "24GiB", "24g" all mean 24 * 2**30 bytes (binary, as nvidia-smi); a bare number is
bytes ("80e9"). Parameter counts are decimal ("6.7B" = 6.7e9)."""


def _add(parser: argparse.ArgumentParser, name: str, **kwargs: Any) -> None:
    """Add ``--name`` with its dashed twin (``--num_gpus`` and ``--num-gpus``), same destination."""
    body = name.removeprefix("--")
    spellings = dict.fromkeys(["--" + body, "--" + body.replace("_", "-"), "--" + body.replace("-", "_")])
    parser.add_argument(*spellings, dest=body.replace("-", "_"), **kwargs)


def _configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    model = parser.add_argument_group("model")
    _add(model, "--model", required=True, metavar="PATH_OR_CONFIG_OR_PARAM_COUNT",
         help="a local model directory with config.json, a config.json path, or a parameter count "
              "(7e9, 6.7B, 500M, 1,234,567); weights are never read")
    _add(model, "--trust_remote_code", action="store_true",
         help="let transformers run a local model's own code to count its parameters exactly")
    for name, what in (
        ("--hidden_size", "hidden size"),
        ("--num_layers", "number of transformer layers"),
        ("--num_heads", "attention heads (default hidden_size / 128)"),
        ("--num_kv_heads", "key/value heads (LoRA; default num_heads)"),
        ("--intermediate_size", "MLP size (needed for LoRA)"),
        ("--vocab_size", "vocabulary (logits)"),
    ):
        _add(model, name, type=int, default=None, metavar="N", help=f"with a bare count: {what}")

    cluster = parser.add_argument_group("hardware")
    _add(cluster, "--num_gpus", type=int, default=1, metavar="N", help="GPUs per node (default 1)")
    cluster.add_argument("--gpus_per_node", "--gpus-per-node", dest="num_gpus", type=int, default=argparse.SUPPRESS,
                         metavar="N", help="the same as --num_gpus")
    _add(cluster, "--num_nodes", type=int, default=1, metavar="M", help="nodes (default 1)")
    _add(cluster, "--gpu_memory", default=None, metavar="SIZE", help="memory of one GPU, e.g. 24GB (default: not checked)")
    _add(cluster, "--cpu_memory", default=None, metavar="SIZE", help="host RAM per node, e.g. 128GB (default: not checked)")
    _add(cluster, "--nvme_memory", default=None, metavar="SIZE", help="free NVMe space per node (default: not checked)")
    _add(cluster, "--gpu_reserve", default=str(DEFAULT_GPU_RESERVE_BYTES), metavar="SIZE",
         help="kept free per GPU when judging fit: CUDA context, NCCL, fragmentation (default 1GiB)")
    _add(cluster, "--nvme_path", default=DEFAULT_NVME_PATH, metavar="DIR",
         help=f"nvme_path written into a printed NVMe config (default {DEFAULT_NVME_PATH})")

    training = parser.add_argument_group("training")
    _add(training, "--dtype", choices=sorted(PRECISIONS), default="bf16",
         help="bf16/fp16: 16-bit mixed precision (2+2+12 bytes per parameter); fp32: 4+4+8 (default bf16)")
    _add(training, "--lora-rank", type=int, default=None, metavar="R", help="LoRA rank (default: full fine-tuning)")
    _add(training, "--lora_target_modules", default=ALL_LINEAR, metavar="NAMES",
         help="comma-separated module names (q_proj,v_proj) or 'all-linear' (default: every linear "
              "layer except the LM head, as peft)")
    _add(training, "--micro_batch_size", type=int, default=DEFAULT_MICRO_BATCH_SIZE, metavar="B",
         help=f"sequences per GPU per step (default {DEFAULT_MICRO_BATCH_SIZE})")
    _add(training, "--seq_len", type=int, default=DEFAULT_SEQ_LEN, metavar="L", help=f"tokens per sequence (default {DEFAULT_SEQ_LEN})")
    _add(training, "--gradient_checkpointing", action="store_true", help="recompute activations in backward")
    _add(training, "--flash_attention", action="store_true",
         help="attention scores are not stored (flash / memory-efficient SDPA kernels)")
    _add(training, "--no_activations", action="store_true",
         help="model states only (parameters, gradients, optimizer): the ZeRO paper's formulas")
    _add(training, "--sub_group_size", type=_count, default=DEFAULT_SUB_GROUP_SIZE, metavar="N",
         help="optimizer sub-group elements (1e8, 100M); sizes the NVMe host buffers (default 1e9)")

    comm = parser.add_argument_group("communication plan (printed with --num_nodes > 1 or --plan)")
    _add(comm, "--plan", action="store_true",
         help="print the bytes each GPU sends per step inside its node and across nodes for stages 1-3, flat, "
              "MiCS (mics_shard_size) and hpZ (zero_hpz_partition_size), a modelled step time and the layout "
              f"to use, for {', '.join(map(str, NODE_SWEEP))} nodes and --num_nodes")
    _add(comm, "--gradient_accumulation_steps", type=int, default=1, metavar="N", help="micro-steps per step (default 1)")
    _add(comm, "--intra_node_bandwidth", type=float, default=DEFAULT_INTRA_NODE_GBPS, metavar="GB/s",
         help=f"GB/s one GPU sends inside its node (default {DEFAULT_INTRA_NODE_GBPS:g}: NVLink 4 / NVSwitch)")
    _add(comm, "--inter_node_bandwidth", type=float, default=DEFAULT_INTER_NODE_GBPS, metavar="GB/s",
         help=f"GB/s one GPU sends to other nodes (default {DEFAULT_INTER_NODE_GBPS:g}: a 400 Gb/s NIC per GPU)")
    _add(comm, "--tflops", type=float, default=DEFAULT_COMPUTE_TFLOPS, metavar="TFLOP/s",
         help=f"achieved TFLOP/s per GPU (default {DEFAULT_COMPUTE_TFLOPS:g}: ~40%% of an H100's bf16 peak)")
    _add(comm, "--communication_data_type", choices=("fp32", "bf16", "fp16"), default="fp32",
         help="dtype gradients are reduced in (the config key of that name; hf_zero's default fp32)")

    output = parser.add_argument_group("output")
    _add(output, "--json", action="store_true",
         help="print the table as a JSON list of rows (stage, offload_optimizer, offload_param, "
              "gpu_bytes, cpu_bytes, nvme_bytes, fits)")
    _add(output, "--save_config", default=None, metavar="PATH",
         help="also write the chosen --zero_config JSON to PATH")
    parser.set_defaults(func=run)
    return parser


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``estimate`` subcommand to ``hf-zero``'s subparsers; ``args.func`` is :func:`run`."""
    return add_subcommand(subparsers, "estimate", "memory per GPU/node for ZeRO stages 0-3 and offload; prints a ready --zero_config", _DESCRIPTION, _configure)


def build_parser() -> argparse.ArgumentParser:
    """A standalone parser (``python -m hf_zero.cli.estimate_cmd``), the same flags as the subcommand."""
    return standalone_parser("estimate", _DESCRIPTION, _configure)


def _count(text: str) -> int:
    """argparse type for element counts written like ``1e8`` or ``100M``."""
    try:
        return parse_param_count(text)
    except EstimatorError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _targets(text: str) -> str | list[str]:
    return text if text.strip().lower() == ALL_LINEAR else [t.strip() for t in text.split(",") if t.strip()]


def run(args: argparse.Namespace) -> int:
    """Run the estimate for parsed ``args``; print the report (or ``--json`` rows); return the exit code."""
    try:
        est = estimate(
            args.model,
            num_gpus=args.num_gpus,
            num_nodes=args.num_nodes,
            gpu_memory=args.gpu_memory,
            cpu_memory=args.cpu_memory,
            nvme_memory=args.nvme_memory,
            gpu_reserve=args.gpu_reserve,
            dtype=args.dtype,
            lora_rank=args.lora_rank,
            lora_target_modules=_targets(args.lora_target_modules),
            micro_batch_size=args.micro_batch_size,
            seq_len=args.seq_len,
            gradient_checkpointing=args.gradient_checkpointing,
            flash_attention=args.flash_attention,
            include_activations=not args.no_activations,
            sub_group_size=args.sub_group_size,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            num_heads=args.num_heads,
            vocab_size=args.vocab_size,
            intermediate_size=args.intermediate_size,
            num_kv_heads=args.num_kv_heads,
            trust_remote_code=args.trust_remote_code,
        )
    except EstimatorError as exc:
        print(f"hf-zero estimate: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT

    plan = None
    if args.plan or args.num_nodes > 1:
        try:
            plan = _plan(args, est)
        except EstimatorError as exc:
            print(f"hf-zero estimate: error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
    best = est.fastest_fit
    if args.json and args.plan:
        print(json.dumps({"memory": est.as_rows(), "communication": plan[1]}, indent=2))
    elif args.json:
        print(json.dumps(est.as_rows(), indent=2))
    else:
        print(render_report(est, nvme_path=args.nvme_path))
        if plan is not None:
            print()
            print(plan[0])
    if args.save_config and best is not None:
        cfg = zero_config_for(best, nvme_path=args.nvme_path, sub_group_size=est.sub_group_size,
                              largest_tensor=est.model.largest_tensor)
        try:
            Path(args.save_config).write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            print(f"hf-zero estimate: error: cannot write --save_config {args.save_config!r}: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        if not args.json:
            print(f"\nWrote {args.save_config}")
    elif args.save_config:
        print(f"hf-zero estimate: nothing fits, so {args.save_config!r} was not written", file=sys.stderr)
    return EXIT_FITS if best is not None else EXIT_NOTHING_FITS


def _plan(args: argparse.Namespace, est) -> tuple[str, list[dict]]:
    """The communication plan's text and JSON rows (``comm_report.py``)."""
    for flag in ("num_gpus", "num_nodes", "gradient_accumulation_steps"):
        if getattr(args, flag) < 1:
            raise EstimatorError(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    for flag in ("intra_node_bandwidth", "inter_node_bandwidth", "tflops"):
        if not getattr(args, flag) > 0:
            raise EstimatorError(f"--{flag} must be positive, got {getattr(args, flag)}")
    work = workload(est.model, dtype=args.dtype, gas=args.gradient_accumulation_steps,
                    tokens_per_gpu=args.micro_batch_size * args.seq_len * args.gradient_accumulation_steps,
                    lora_rank=args.lora_rank, lora_target_modules=_targets(args.lora_target_modules),
                    gradient_checkpointing=args.gradient_checkpointing, reduce_dtype=args.communication_data_type)
    links = Links(intra=args.intra_node_bandwidth * 1e9, inter=args.inter_node_bandwidth * 1e9,
                  flops=args.tflops * 1e12)
    counts = sorted(set(NODE_SWEEP) | {args.num_nodes}) if args.plan else [args.num_nodes]
    table = sweep(work, args.num_gpus, links, counts)
    rows = []
    for k in counts:
        best, why = recommend(table[k])
        rows.extend({**r.as_dict(), "recommended": r is best, **({"why": why} if r is best else {})} for r in table[k])
    return render_plan(work, table, args.num_gpus, links), rows


if __name__ == "__main__":
    sys.exit(run(build_parser().parse_args()))
