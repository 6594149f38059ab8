"""``hf-zero consolidate CHECKPOINT OUT``: sharded checkpoint -> safetensors folder, on one CPU process.

CHECKPOINT is a directory written by ``save_checkpoint``, a Trainer ``checkpoint-N`` folder
holding one, or a DeepSpeed ZeRO checkpoint (``checkpoint-N`` with ``latest`` and ``global_stepN/``). OUT must not exist or be empty. Exit 0 on success; 2 with a one-line message for a
missing or incomplete checkpoint or a non-empty OUT.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``consolidate`` to the ``hf-zero`` subcommands.

    Args:
        subparsers: The object returned by ``ArgumentParser.add_subparsers()``.
    """
    parser = subparsers.add_parser(
        "consolidate",
        help="turn a sharded checkpoint into safetensors that from_pretrained loads",
        description="Read the model weights of a sharded hf_zero checkpoint (any number of ranks) and write "
        "them as safetensors shards + index with the config and tokenizer files, in one CPU process "
        "(no GPU, no launcher). A peft checkpoint gives its adapter. A DeepSpeed ZeRO-1/2/3 checkpoint "
        "(checkpoint-N with latest and global_stepN/) gives the tensors of DeepSpeed's zero_to_fp32.py, "
        "without DeepSpeed and without unpickling anything but tensors and DeepSpeed's own few names.",
    )
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint directory (or a Trainer checkpoint-N folder, hf_zero's or DeepSpeed's)")
    parser.add_argument("output_dir", metavar="OUT", help="output directory (must not exist or be empty)")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                        help="dtype of the written weights (default fp32: the exact master weights)")
    parser.add_argument("--max_shard_size", default="5GB",
                        help="largest output file, e.g. 5GB or 500MB (default 5GB)")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Consolidate ``args.checkpoint`` into ``args.output_dir``; return the exit code."""
    from hf_zero.checkpoint.consolidate import consolidate_checkpoint
    from hf_zero.checkpoint.sharded import CheckpointError

    try:
        written = consolidate_checkpoint(
            args.checkpoint,
            args.output_dir,
            dtype=args.dtype,
            max_shard_size=_shard_size(args.max_shard_size),
            progress=not getattr(args, "no_progress", False),
        )
    except (FileNotFoundError, FileExistsError, CheckpointError, ValueError) as exc:
        print(f"hf-zero consolidate: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} files to {args.output_dir}: {', '.join(written)}")
    return 0


def _shard_size(value: str) -> int | str:
    """``"5GB"`` stays a string (huggingface_hub parses it); a plain number is bytes."""
    return int(value) if str(value).isdigit() else value
