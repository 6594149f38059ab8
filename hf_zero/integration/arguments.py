"""``ZeroTrainingArguments``: ``TrainingArguments`` plus ``--zero_config`` (``--deepspeed`` is an alias).

The config is parsed (syntax, keys, types) when the arguments are built, so a typo in
``ds_config.json`` fails before the model is loaded; ``"auto"`` values are resolved later, when the
Trainer knows the world size, the model and the number of training steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import Seq2SeqTrainingArguments, TrainingArguments

__all__ = ["ZeroTrainingArguments", "ZeroSeq2SeqTrainingArguments", "ZeroArgumentsMixin"]

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

        _apply_removed_argument_aliases(self)
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

    @property
    def place_model_on_device(self) -> bool:
        # The engine moves or shards the model itself; a full copy on the GPU first would defeat ZeRO-3.
        return False if self.zero_config is not None else None  # type: ignore[return-value]


_ALIAS_HELP = "transformers 4.x name, accepted so that old launch commands keep working: {}"


def _apply_removed_argument_aliases(args: Any) -> None:
    """Map transformers 4.x flags that launch commands in tutorials still use (source 000:
    ``--evaluation_strategy "no" --warmup_ratio 0.03``) onto their transformers 5 fields."""
    legacy_eval = getattr(args, "evaluation_strategy", None)
    if legacy_eval is not None:
        args.eval_strategy = legacy_eval
    ratio = getattr(args, "warmup_ratio", None)
    if ratio is not None:
        if not 0 <= float(ratio) < 1:
            raise ValueError(f"--warmup_ratio must be in [0, 1), got {ratio}; use --warmup_steps for a step count")
        if args.warmup_steps not in (0, 0.0):
            raise ValueError(f"--warmup_ratio {ratio} and --warmup_steps {args.warmup_steps} both given; pass one")
        args.warmup_steps = float(ratio)  # transformers 5 reads warmup_steps < 1 as a ratio


@dataclass
class ZeroTrainingArguments(ZeroArgumentsMixin, TrainingArguments):
    """``transformers.TrainingArguments`` with ``zero_config``.

    Example::

        >>> args = ZeroTrainingArguments(output_dir="out", zero_config="ds_zero3.json", bf16=True)
        >>> parser = HfArgumentParser(ZeroTrainingArguments)   # gives --zero_config
    """

    zero_config: dict | str | None = field(default=None, metadata={"help": _HELP})
    evaluation_strategy: str | None = field(default=None, metadata={"help": _ALIAS_HELP.format("--eval_strategy")})
    warmup_ratio: float | None = field(default=None, metadata={"help": _ALIAS_HELP.format("--warmup_steps <1")})


@dataclass
class ZeroSeq2SeqTrainingArguments(ZeroArgumentsMixin, Seq2SeqTrainingArguments):
    """``Seq2SeqTrainingArguments`` with ``zero_config``."""

    zero_config: dict | str | None = field(default=None, metadata={"help": _HELP})
    evaluation_strategy: str | None = field(default=None, metadata={"help": _ALIAS_HELP.format("--eval_strategy")})
    warmup_ratio: float | None = field(default=None, metadata={"help": _ALIAS_HELP.format("--warmup_steps <1")})
