"""``hf-zero config check FILE [FILE ...]``: parse, merge and resolve configs without training.
``hf-zero config --from-accelerate FILE``: the hf_zero config an accelerate config file becomes.

Prints the resolved config as JSON (the hf_zero field tree), the keys still ``"auto"`` and the
accepted keys that have no effect, and exits 0; or prints every problem to stderr and exits 2.
Trainer-style flags (``--per_device_train_batch_size`` ...) stand in for TrainingArguments, so a
config can be checked against a launch line before any model is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import warnings
from types import SimpleNamespace
from typing import Any

__all__ = ["CliTrainingArgs", "register", "run_check", "run_from_accelerate"]

# Flags that stand for TrainingArguments fields; giving any of them builds a CliTrainingArgs.
_TRAINER_FLAGS = (
    "per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate", "weight_decay",
    "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "fp16", "bf16", "warmup_steps",
    "warmup_ratio",
)


@dataclasses.dataclass
class CliTrainingArgs:
    """The TrainingArguments fields ``resolve_auto`` reads, with transformers' defaults.

    A stand-in so ``config check`` needs no transformers import.
    """

    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    fp16: bool = False
    bf16: bool = False
    warmup_steps: float = 0
    world_size: int | None = None

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """transformers 5: ``warmup_steps`` >= 1 is a step count, below 1 a ratio of the total."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        return math.ceil(num_training_steps * self.warmup_steps)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``config`` (with its ``check`` action) to the ``hf-zero`` subcommands.

    Args:
        subparsers: The object returned by ``ArgumentParser.add_subparsers()``.
    """
    config = subparsers.add_parser("config", help="check DeepSpeed-style config files",
                                   description="Inspect DeepSpeed-style configs the way hf_zero reads them.")
    config.add_argument(
        "--from-accelerate", "--from_accelerate", dest="from_accelerate", metavar="FILE",
        help="print the hf_zero config an accelerate config file (accelerate config --config_file FILE) becomes: "
        "its DEEPSPEED or FSDP settings as a DeepSpeed-style config, plus wrapping, state dict type, activation "
        "checkpointing and the settings that change nothing (docs/accelerate.md)")
    config.add_argument("--zero_config_only", action="store_true",
                        help="with --from-accelerate: print only the config (a file to pass as --zero_config)")
    config.set_defaults(func=lambda args: run_from_accelerate(args) if args.from_accelerate else _usage(config))
    actions = config.add_subparsers(dest="config_command", metavar="ACTION")

    check = actions.add_parser(
        "check",
        help="parse, merge and resolve configs; print the result as JSON",
        description="Parse FILE(s) (fragments are deep-merged, later wins), resolve \"auto\" from the "
        "flags given, print the result as JSON. Exit 0 when the config is usable, 2 otherwise.",
    )
    check.add_argument("files", nargs="+", metavar="FILE", help="config file(s): .json, .yaml or .yml")
    check.add_argument("--non_strict", action="store_true", help="warn about unknown keys instead of failing")
    run = check.add_argument_group("run size")
    run.add_argument("--world_size", type=int, help="number of data-parallel ranks")
    run.add_argument("--num_training_steps", type=int, help="total optimizer steps (scheduler lengths)")
    run.add_argument("--hidden_size", type=int, help="model hidden size (hidden-size based bucket sizes)")
    trainer = check.add_argument_group("training arguments (as the Trainer's flags; defaults as transformers)")
    trainer.add_argument("--per_device_train_batch_size", type=int)
    trainer.add_argument("--gradient_accumulation_steps", type=int)
    trainer.add_argument("--learning_rate", type=float)
    trainer.add_argument("--weight_decay", type=float)
    trainer.add_argument("--adam_beta1", type=float)
    trainer.add_argument("--adam_beta2", type=float)
    trainer.add_argument("--adam_epsilon", type=float)
    trainer.add_argument("--max_grad_norm", type=float)
    trainer.add_argument("--bf16", action="store_true", default=None)
    trainer.add_argument("--fp16", action="store_true", default=None)
    warmup = trainer.add_mutually_exclusive_group()
    warmup.add_argument("--warmup_steps", type=float, help="steps (>= 1) or a ratio of the total (< 1)")
    warmup.add_argument("--warmup_ratio", type=float, help="ratio of the total steps (as transformers 4.x)")
    check.set_defaults(func=run_check)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _training_args(ns: argparse.Namespace) -> CliTrainingArgs | None:
    given = {name: getattr(ns, name) for name in _TRAINER_FLAGS if getattr(ns, name, None) is not None}
    if not given:
        return None
    if "warmup_ratio" in given:
        given["warmup_steps"] = given.pop("warmup_ratio")
    return CliTrainingArgs(**given, world_size=ns.world_size)


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def _notes(cfg: Any) -> list[str]:
    notes = []
    zero = cfg.zero_optimization
    for name in ("offload_optimizer", "offload_param"):
        section = getattr(zero, name)
        if section.device == "nvme" and section.nvme_path and not os.path.isdir(section.nvme_path):
            notes.append(
                f"zero_optimization.{name}.nvme_path={section.nvme_path!r} does not exist on this machine; "
                "create it (on a fast local disk) before training"
            )
    return notes


def run_check(ns: argparse.Namespace) -> int:
    """Run ``hf-zero config check``.

    Args:
        ns: Parsed arguments of the ``check`` action.

    Returns:
        0 when the config parses and resolves (values may stay ``"auto"``), 2 when it does not.
    """
    from hf_zero.config import ZeroConfigError, describe_no_effect, load_config

    sources = ns.files if len(ns.files) > 1 else ns.files[0]
    model_config = SimpleNamespace(hidden_size=ns.hidden_size) if ns.hidden_size is not None else None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = load_config(
                sources,
                training_args=_training_args(ns),
                model=model_config,
                world_size=ns.world_size,
                num_training_steps=ns.num_training_steps,
                strict=not ns.non_strict,
            )
    except ZeroConfigError as err:
        print(f"hf-zero config check: {len(err.problems)} problem(s)", file=sys.stderr)
        for line in err.problems:
            print(f"  {line}", file=sys.stderr)
        return 2
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)

    tree = _jsonable(cfg)
    for meta in ("source", "no_effect_keys", "explicit_keys"):
        tree.pop(meta, None)
    report = {
        "source": cfg.source,
        "config": tree,
        "unresolved": cfg.unresolved(),
        "no_effect": describe_no_effect(cfg),
        "notes": _notes(cfg),
    }
    print(json.dumps(report, indent=2))
    return 0


def run_from_accelerate(ns: argparse.Namespace) -> int:
    """Run ``hf-zero config --from-accelerate FILE``: print what ``hf-zero run --config_file FILE``
    would train with, as JSON; exit 2 (with the reason) when hf_zero refuses the file.

    The ``zero_config`` part is checked by hf_zero's parser; ``"auto"`` values stay for the Trainer
    or the ``Accelerator`` to fill at start-up, as accelerate's plugin leaves them.
    """
    from hf_zero.config import ZeroConfigError, describe_no_effect, parse_config
    from hf_zero.config.sources.accelerate_yaml import settings_from_accelerate_file

    try:
        settings = settings_from_accelerate_file(ns.from_accelerate)
        parsed = parse_config(settings.zero_config) if settings.zero_config is not None else None
    except ZeroConfigError as err:
        print(f"hf-zero config: {err}", file=sys.stderr)
        return 2
    if ns.zero_config_only:
        if settings.zero_config is None:
            print(f"hf-zero config: {ns.from_accelerate}: distributed_type {settings.distributed_type} has no ZeRO "
                  "config (use DEEPSPEED or FSDP)", file=sys.stderr)
            return 2
        print(json.dumps(settings.zero_config, indent=2))
        return 0
    report = settings.to_json()
    report["no_effect"] = [*report["no_effect"], *(describe_no_effect(parsed) if parsed is not None else [])]
    print(json.dumps(report, indent=2))
    return 0
