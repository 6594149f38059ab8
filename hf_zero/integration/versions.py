"""What transformers removed that fine-tuning scripts still use: one table, with the release that
removed each name and what the hf_zero classes do with it.

Scripts written for transformers 4 (Qwen's and FastChat's ``finetune.py``, the Alpaca family) pass
``--evaluation_strategy``, ``--warmup_ratio``, ``Trainer(tokenizer=...)`` and read
``training_args.local_rank``; transformers 5 rejects or ignores them. Under ``hf-zero run`` the
swapped ``TrainingArguments``/``Trainer`` (and ``ZeroTrainingArguments``/``ZeroTrainer`` wherever
they are used) take every name below:

- ``alias``: mapped onto its transformers 5 replacement (the value is also kept under the old
  name, so a script that reads it back still finds it);
- ``kept``: accepted and kept for the script to read; the Trainer never read it, in 4.x either;
- ``error``: accepted by the parser, then refused with the replacement named, unless the value is
  one that asks for nothing (the 4.x default, or a value meaning what transformers 5 does anyway).

The release numbers were read from the published wheels (``TrainingArguments`` fields, the
``Trainer`` signature, ``transformers/deepspeed.py``): 4.45.0 -> 4.46.0, 4.50.0 -> 4.51.0,
4.57.1 -> 5.0.0, 5.1.0 -> 5.2.0, 5.14.0 -> 5.15.0. ``docs/deepspeed_compat.md`` renders the table
(:func:`render_table`; a unit test keeps the page in step).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "RemovedName",
    "REMOVED_NAMES",
    "removed_argument_fields",
    "removed_from_installed",
    "apply_removed_arguments",
    "render_table",
]


@dataclass(frozen=True)
class RemovedName:
    """One name transformers removed, and what hf_zero does with it."""

    name: str
    """The name as scripts write it: an argument field, ``Trainer(kw=)``, an attribute or a module."""
    kind: str
    """``argument`` (a ``TrainingArguments`` field), ``trainer`` (a ``Trainer`` keyword or
    attribute), or ``module``."""
    removed_in: str
    """The first transformers release without it (or, for ``local_rank``, without the behaviour)."""
    handling: str
    """``alias``, ``kept`` or ``error`` (see the module docstring)."""
    replacement: str
    """What transformers 5 has instead, as the docs and the error message say it."""
    type: Any = None
    """For arguments: the field's type (what the argument parser converts the value to)."""
    default: Any = None
    """For arguments: the field's default. None for aliases of valued fields (so that "not given"
    is told apart from any value); the 4.x default otherwise."""
    no_effect: tuple = ()
    """For ``error`` arguments: values that ask for nothing and are accepted quietly."""
    apply: Callable[[Any, Any], None] | None = None
    """For ``alias`` arguments: ``apply(args, value)`` sets the transformers 5 fields."""


# ----------------------------------------------------------------------------------------- aliases
def _set_if_unset(attr: str, flag: str) -> Callable[[Any, Any], None]:
    """``args.<attr> = value``, unless the user also gave the new name a value of its own (one
    that is neither its default nor this value)."""

    def apply(args: Any, value: Any) -> None:
        current = getattr(args, attr)
        if current != _default(args, attr) and current != value:
            raise ValueError(f"--{flag} {value!r} and --{attr} {current!r} both given; pass only --{attr}")
        setattr(args, attr, value)

    return apply


def _default(args: Any, attr: str) -> Any:
    spec = type(args).__dataclass_fields__[attr]
    return spec.default_factory() if spec.default is dataclasses.MISSING else spec.default


def _warmup_ratio(args: Any, ratio: Any) -> None:
    if not 0 <= float(ratio) < 1:
        raise ValueError(f"--warmup_ratio must be in [0, 1), got {ratio}; use --warmup_steps for a step count")
    if args.warmup_steps not in (0, 0.0, float(ratio)):  # equal: arguments rebuilt from their own dict
        raise ValueError(f"--warmup_ratio {ratio} and --warmup_steps {args.warmup_steps} both given; pass one")
    args.warmup_steps = float(ratio)  # transformers 5 reads warmup_steps < 1 as a ratio of the total steps


def _env(var: str, flag: str) -> Callable[[Any, Any], None]:
    """Put the value where transformers 5 reads it now, an environment variable (for the
    callbacks and searches this process starts), unless it holds another value already."""

    def apply(args: Any, value: Any) -> None:
        current = os.environ.get(var)
        if current not in (None, str(value)):
            raise ValueError(f"--{flag} {value!r} conflicts with {var}={current!r} in the environment; keep one")
        os.environ[var] = str(value)

    return apply


def _when_true(apply: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    """For a 4.x boolean flag: act on True only (False asked for the default behaviour)."""

    def gated(args: Any, value: Any) -> None:
        if value:
            apply(args, value)

    return gated


def _optim_adafactor(args: Any, value: Any) -> None:
    if str(args.optim) not in (str(_default(args, "optim")), "adafactor"):
        raise ValueError(f"--adafactor and --optim {args.optim} both given; pass --optim adafactor only")
    args.optim = "adafactor"


def _include_inputs(args: Any, value: Any) -> None:
    args.include_for_metrics = list(args.include_for_metrics or [])
    if "inputs" not in args.include_for_metrics:
        args.include_for_metrics.append("inputs")


def _tokens_seen(args: Any, value: Any) -> None:
    if args.include_num_input_tokens_seen in (False, "no"):
        args.include_num_input_tokens_seen = "all"


_FSDP_CONFIG = "use --fsdp_config '{{\"{key}\": ...}}' (with --zero_config, hf_zero shards the model instead)"

REMOVED_NAMES: tuple[RemovedName, ...] = (
    # --- TrainingArguments: aliases ---------------------------------------------------------------
    RemovedName("evaluation_strategy", "argument", "4.51.0", "alias", "--eval_strategy", str, None,
                apply=_set_if_unset("eval_strategy", "evaluation_strategy")),
    RemovedName("warmup_ratio", "argument", "5.15.0", "alias",
                "--warmup_steps R (a value below 1 is a ratio of the total steps)", float, None,
                apply=_warmup_ratio),
    RemovedName("logging_dir", "argument", "5.15.0", "alias", "the TENSORBOARD_LOGGING_DIR environment variable",
                str, None, apply=_env("TENSORBOARD_LOGGING_DIR", "logging_dir")),
    RemovedName("group_by_length", "argument", "5.2.0", "alias", "--train_sampling_strategy group_by_length",
                bool, False, apply=_when_true(lambda a, v: _set_if_unset(
                    "train_sampling_strategy", "group_by_length")(a, "group_by_length"))),
    RemovedName("per_gpu_train_batch_size", "argument", "5.0.0", "alias", "--per_device_train_batch_size", int, None,
                apply=_set_if_unset("per_device_train_batch_size", "per_gpu_train_batch_size")),
    RemovedName("per_gpu_eval_batch_size", "argument", "5.0.0", "alias", "--per_device_eval_batch_size", int, None,
                apply=_set_if_unset("per_device_eval_batch_size", "per_gpu_eval_batch_size")),
    RemovedName("no_cuda", "argument", "5.0.0", "alias", "--use_cpu", bool, False,
                apply=_when_true(lambda a, v: setattr(a, "use_cpu", True))),
    RemovedName("adafactor", "argument", "5.0.0", "alias", "--optim adafactor", bool, False,
                apply=_when_true(_optim_adafactor)),
    RemovedName("include_inputs_for_metrics", "argument", "5.0.0", "alias", "--include_for_metrics inputs", bool,
                False, apply=_when_true(_include_inputs)),
    RemovedName("include_tokens_per_second", "argument", "5.0.0", "alias",
                "--include_num_input_tokens_seen (logs train_tokens_per_second from the tokens seen)", bool, False,
                apply=_when_true(_tokens_seen)),
    RemovedName("push_to_hub_model_id", "argument", "5.0.0", "alias", "--hub_model_id", str, None,
                apply=_set_if_unset("hub_model_id", "push_to_hub_model_id")),
    RemovedName("push_to_hub_token", "argument", "5.0.0", "alias", "--hub_token", str, None,
                apply=_set_if_unset("hub_token", "push_to_hub_token")),
    RemovedName("torchdynamo", "argument", "5.0.0", "alias", "--torch_compile_backend", str, None,
                apply=_set_if_unset("torch_compile_backend", "torchdynamo")),
    RemovedName("ray_scope", "argument", "5.0.0", "alias", "the RAY_SCOPE environment variable", str, None,
                apply=_env("RAY_SCOPE", "ray_scope")),
    # --- TrainingArguments: kept for the script -------------------------------------------------
    RemovedName("overwrite_output_dir", "argument", "5.0.0", "kept",
                "nothing: the Trainer never read it; scripts that check it still find it", bool, False),
    # --- TrainingArguments: refused, with the replacement -----------------------------------------
    RemovedName("save_safetensors", "argument", "5.0.0", "error",
                "transformers 5 always writes safetensors; drop the flag (True is accepted)", bool, True, no_effect=(True,)),
    RemovedName("use_mps_device", "argument", "5.0.0", "error",
                "the mps device is used when available; drop the flag (False is accepted)", bool, False,
                no_effect=(False,)),
    RemovedName("jit_mode_eval", "argument", "5.0.0", "error", "use --torch_compile", bool, False, no_effect=(False,)),
    RemovedName("fp16_opt_level", "argument", "5.0.0", "error",
                "Apex AMP is gone, --fp16/--bf16 use torch autocast; drop the flag (O1 is accepted)", str, "O1",
                no_effect=("O1",)),
    RemovedName("half_precision_backend", "argument", "5.0.0", "error",
                "torch autocast is the only backend; drop the flag (auto and cpu_amp are accepted)", str, "auto",
                no_effect=("auto", "cpu_amp")),
    RemovedName("fp16_backend", "argument", "5.0.0", "error",
                "torch autocast is the only backend; drop the flag (auto and cpu_amp are accepted)", str, "auto",
                no_effect=("auto", "cpu_amp")),
    RemovedName("tpu_num_cores", "argument", "5.0.0", "error", "the XLA launcher sets the cores; drop the flag", int, None,
                no_effect=(None,)),
    RemovedName("tpu_metrics_debug", "argument", "5.0.0", "error", "use --debug tpu_metrics_debug", bool, False,
                no_effect=(False,)),
    RemovedName("past_index", "argument", "5.0.0", "error",
                "models return their cache themselves; drop the flag (-1 is accepted)", int, -1, no_effect=(-1,)),
    RemovedName("fsdp_min_num_params", "argument", "5.0.0", "error", _FSDP_CONFIG.format(key="min_num_params"),
                int, 0, no_effect=(0,)),
    RemovedName("fsdp_transformer_layer_cls_to_wrap", "argument", "5.0.0", "error",
                _FSDP_CONFIG.format(key="transformer_layer_cls_to_wrap"), str, None, no_effect=(None,)),
    RemovedName("use_legacy_prediction_loop", "argument", "5.0.0", "error",
                "evaluation_loop is the only loop; drop the flag (False is accepted)", bool, False, no_effect=(False,)),
    RemovedName("push_to_hub_organization", "argument", "5.0.0", "error", "use --hub_model_id ORGANIZATION/NAME", str,
                None, no_effect=(None,)),
    RemovedName("mp_parameters", "argument", "5.0.0", "error",
                "SageMaker model parallelism was removed; use --zero_config (the empty string is accepted)", str, "", no_effect=("",)),
    # --- Trainer ------------------------------------------------------------------------------------
    RemovedName("Trainer(tokenizer=...)", "trainer", "5.0.0", "alias", "Trainer(processing_class=...)"),
    RemovedName("trainer.tokenizer", "trainer", "5.0.0", "alias", "trainer.processing_class"),
    RemovedName("training_args.local_rank", "trainer", "5.0.0", "alias",
                "training_args.local_process_index (the field stays, but transformers 5 leaves it at -1; "
                "hf_zero sets it from the launcher's LOCAL_RANK, 0 in a single process, as 4.x did)"),
    # --- modules ------------------------------------------------------------------------------------
    RemovedName("transformers.deepspeed", "module", "4.46.0", "alias",
                "transformers.integrations.deepspeed (provided while hf_zero's DeepSpeed API is installed)"),
)


def _installed_fields() -> frozenset[str]:
    """The fields of the installed transformers' own ``TrainingArguments``: on a release older than
    an entry's ``removed_in`` the name is still its own, and transformers handles it as it always
    did. Under ``hf-zero run`` ``transformers.TrainingArguments`` is hf_zero's subclass, whose
    old-name fields must not count, so the first class defined by transformers in its MRO is read."""
    import transformers

    own = next(c for c in transformers.TrainingArguments.__mro__ if c.__module__.startswith("transformers."))
    return frozenset(f.name for f in dataclasses.fields(own))


def removed_from_installed(entry: RemovedName) -> bool:
    """Whether the installed transformers lacks ``entry`` (it is as new as ``removed_in`` or
    newer). An argument counts as removed when the installed ``TrainingArguments`` has no such
    field; the other kinds by the release number."""
    if entry.kind == "argument":
        return entry.name not in _installed_fields()
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release >= Version(entry.removed_in).release


def removed_argument_fields() -> list[tuple[str, Any, Any]]:
    """``(name, type, dataclasses.field)`` for every ``TrainingArguments`` field the installed
    transformers has removed, for :func:`dataclasses.make_dataclass`: the parser then accepts the
    old flags."""
    out = []
    installed = _installed_fields()
    for entry in REMOVED_NAMES:
        if entry.kind != "argument" or entry.name in installed:
            continue
        help_text = f"removed in transformers {entry.removed_in}; hf_zero: {entry.handling} -> {entry.replacement}"
        out.append((entry.name, entry.type | None, field(default=entry.default, metadata={"help": help_text})))
    return out


def apply_removed_arguments(args: Any) -> None:
    """Map the removed fields ``args`` holds onto transformers 5 (run before its ``__post_init__``).
    Names the installed release still has (an older one) are left to it.

    Raises:
        ValueError: a refused argument with a value that asks for something, naming the
            replacement; or an alias given together with its replacement set differently.
    """
    installed = _installed_fields()
    for entry in REMOVED_NAMES:
        if entry.kind != "argument" or entry.name in installed or not hasattr(args, entry.name):
            continue
        value = getattr(args, entry.name)
        if entry.handling == "error":
            if value not in entry.no_effect:
                raise ValueError(
                    f"--{entry.name}={value!r} was removed in transformers {entry.removed_in}; {entry.replacement}"
                )
        elif entry.handling == "alias" and value is not None and entry.apply is not None:
            entry.apply(args, value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_table() -> str:
    """The markdown table of :data:`REMOVED_NAMES` for ``docs/deepspeed_compat.md``."""
    lines = ["| name | kind | removed in | hf_zero | replacement / what to do |", "| --- | --- | --- | --- | --- |"]
    for e in REMOVED_NAMES:
        shown = f"--{e.name}" if e.kind == "argument" else e.name
        lines.append(f"| `{shown}` | {e.kind} | {e.removed_in} | {e.handling} | {_cell(e.replacement)} |")
    return "\n".join(lines) + "\n"
