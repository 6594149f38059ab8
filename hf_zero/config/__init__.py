"""hf_zero's config layer: DeepSpeed-style JSON/YAML/dict in, frozen :class:`ZeroConfig` out.

``load_config`` = :func:`~hf_zero.config.parse.parse_config` (keys, aliases, types, validation)
then :func:`~hf_zero.config.auto.resolve_auto` (``"auto"`` from TrainingArguments and the model).
Imports neither torch nor transformers, so ``hf-zero config check`` stays fast.
"""

from __future__ import annotations

from typing import Any

from hf_zero.config.auto import resolve_auto
from hf_zero.config.errors import ZeroConfigError, ZeroConfigWarning
from hf_zero.config.parse import (
    NO_EFFECT_KEYS,
    ConfigSource,
    describe_no_effect,
    merge_configs,
    parse_config,
)
from hf_zero.config.schema import AUTO, ZeroConfig

__all__ = [
    "AUTO",
    "NO_EFFECT_KEYS",
    "ZeroConfig",
    "ZeroConfigError",
    "ZeroConfigWarning",
    "describe_no_effect",
    "load_config",
    "merge_configs",
    "parse_config",
    "resolve_auto",
]


def _model_config(model: Any) -> Any:
    """``model.config`` for an ``nn.Module`` (or peft wrapper) that has one, else ``model`` itself."""
    if model is None:
        return None
    config = getattr(model, "config", None)
    return config if config is not None else model


def load_config(
    source: ConfigSource | ZeroConfig,
    training_args: Any = None,
    model: Any = None,
    *,
    world_size: int | None = None,
    num_training_steps: int | None = None,
    strict: bool = True,
) -> ZeroConfig:
    """Parse a DeepSpeed-style config and resolve its ``"auto"`` values.

    Args:
        source: A path (``.json``/``.yaml``/``.yml``), a dict (deep-copied), a JSON string,
            base64-encoded JSON, a list of those (fragments deep-merged, later wins), or an already
            parsed :class:`ZeroConfig` (then only resolved).
        training_args: ``transformers.TrainingArguments`` (or an object with the same attribute
            names) to fill ``"auto"`` batch sizes, learning rate, betas, clipping, precision, warmup.
        model: An ``nn.Module`` with ``.config``, a model config object, or None; used for the
            hidden-size based bucket sizes.
        world_size: Data-parallel ranks; defaults to ``training_args.world_size``.
        num_training_steps: Total optimizer steps, for the scheduler's ``"auto"`` lengths.
        strict: False turns unknown keys into warnings instead of errors.

    Returns:
        The frozen config. Values nothing given here can resolve stay ``"auto"``
        (``cfg.unresolved()`` lists them).

    Raises:
        ZeroConfigError: The config is malformed or invalid, or contradicts ``training_args``
            (all problems listed in one message).

    Example::

        >>> cfg = load_config({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}})
        >>> cfg.zero_optimization.stage, cfg.compute_dtype_name
        (2, 'bf16')
    """
    cfg = source if isinstance(source, ZeroConfig) else parse_config(source, strict=strict)
    return resolve_auto(
        cfg,
        training_args=training_args,
        model_config=_model_config(model),
        world_size=world_size,
        num_training_steps=num_training_steps,
    )
