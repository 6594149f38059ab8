"""``ZeroTrainingArguments``: ``TrainingArguments`` plus ``--zero_config`` (``--deepspeed`` is an alias).

The config is parsed (syntax, keys, types) when the arguments are built, so a typo in
``ds_config.json`` fails before the model is loaded; ``"auto"`` values are resolved later, when the
Trainer knows the world size, the model and the number of training steps.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, make_dataclass
from typing import Any

from transformers import Seq2SeqTrainingArguments, TrainingArguments

from hf_zero.integration.versions import apply_removed_arguments, removed_argument_fields

__all__ = ["ZeroTrainingArguments", "ZeroSeq2SeqTrainingArguments", "ZeroArgumentsMixin", "latest_zero_config"]

_HELP = (
    "hf_zero config: path to a DeepSpeed-style JSON/YAML file, a dict, or a JSON string "
    "(\"auto\" values are filled from these arguments). --deepspeed is accepted as an alias."
)


class ZeroArgumentsMixin:
    """Routes ``deepspeed`` to ``zero_config`` before ``TrainingArguments.__post_init__`` sees it
    (which would import DeepSpeed), then parses the config once."""

    zero_config: Any

    def __post_init__(self) -> None:
        from hf_zero.config import ZeroConfigError
        from hf_zero.config.schema import ZeroConfig
        from hf_zero.config.parse import parse_config

        apply_removed_arguments(self)
        from hf_zero.accelerate_support.trainer_args import apply_launch_settings

        apply_launch_settings(self)  # hf-zero run with accelerate's options or config file (docs/accelerate.md)
        deepspeed = getattr(self, "deepspeed", None)
        if deepspeed:
            if self.zero_config is not None and self.zero_config != deepspeed:
                raise ZeroConfigError(
                    f"both --zero_config={self.zero_config!r} and --deepspeed={deepspeed!r} were given; "
                    "pass one (--deepspeed is an alias of --zero_config in hf_zero)"
                )
            self.zero_config = deepspeed
            self.deepspeed = None
        if self.zero_config is not None and not self.use_cpu:
            from hf_zero.distributed import device as accel

            if not accel.accelerator_available():
                # transformers only sets up multi-process CPU training (gloo, sharded batches) and
                # accepts bf16 on CPU with use_cpu; without it every rank would train alone.
                self.use_cpu = True
        super().__post_init__()  # type: ignore[misc]
        # The user's value stays in the field (it is serialised with the arguments); the parsed,
        # frozen config sits beside it.
        self.parsed_zero_config: ZeroConfig | None = None
        if isinstance(self.zero_config, ZeroConfig):
            self.parsed_zero_config = self.zero_config
        elif self.zero_config is not None:
            self.parsed_zero_config = parse_config(self.zero_config)
        _set_local_rank(self)
        if self.parsed_zero_config is not None:
            _remember(self)

    @property
    def place_model_on_device(self) -> bool:
        # The engine moves or shards the model itself; a full copy on the GPU first would defeat ZeRO-3.
        return False if self.zero_config is not None else None  # type: ignore[return-value]


# The transformers-4 names (integration/versions.py) as fields, so that the argument parser takes
# the old flags and ``TrainingArguments(no_cuda=True)`` is not a TypeError; __post_init__ maps them.
# Keyword-only, and listed after transformers' own fields (the class comes before TrainingArguments
# in the bases, and dataclass collects fields from the last base first): a positional argument
# binds as in the installed TrainingArguments, so TrainingArguments("out") sets output_dir.
TransformersV4Arguments = make_dataclass("TransformersV4Arguments", removed_argument_fields(), kw_only=True)

_LATEST_CONFIG: weakref.ref | None = None


def latest_zero_config() -> Any:
    """The parsed zero config of the most recently built arguments that carry one, or None.

    What ``transformers.integrations.deepspeed`` keeps for ``is_deepspeed_zero3_enabled()`` (a
    weak reference set when ``TrainingArguments(deepspeed=...)`` is built): here for hf_zero's
    DeepSpeed API, which answers the same question from it.
    """
    args = _LATEST_CONFIG() if _LATEST_CONFIG is not None else None
    return getattr(args, "parsed_zero_config", None)


def _remember(args: Any) -> None:
    global _LATEST_CONFIG
    _LATEST_CONFIG = weakref.ref(args)


def _set_local_rank(args: Any) -> None:
    """``local_rank`` as transformers 4 set it (``_setup_devices``): the process's local rank from
    the launcher, 0 in a single process. transformers 5 keeps the field but leaves it at -1, so
    scripts that save only ``if training_args.local_rank == 0`` would save nothing."""
    state = getattr(args, "distributed_state", None)
    if state is not None:
        args.local_rank = state.local_process_index


@dataclass
class ZeroTrainingArguments(ZeroArgumentsMixin, TransformersV4Arguments, TrainingArguments):
    """``transformers.TrainingArguments`` with ``zero_config``.

    Example::

        >>> args = ZeroTrainingArguments(output_dir="out", zero_config="ds_zero3.json", bf16=True)
        >>> parser = HfArgumentParser(ZeroTrainingArguments)   # gives --zero_config
    """

    zero_config: dict | str | None = field(default=None, kw_only=True, metadata={"help": _HELP})


@dataclass
class ZeroSeq2SeqTrainingArguments(ZeroArgumentsMixin, TransformersV4Arguments, Seq2SeqTrainingArguments):
    """``Seq2SeqTrainingArguments`` with ``zero_config``."""

    zero_config: dict | str | None = field(default=None, kw_only=True, metadata={"help": _HELP})
