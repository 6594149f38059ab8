"""hf_zero: ZeRO stages 0-3 for the Hugging Face Trainer from a DeepSpeed config, no DeepSpeed needed.

Public API::

    import hf_zero
    cfg = hf_zero.load_config("ds_config.json", training_args=args, model=model)
    engine = hf_zero.initialize(model, "ds_config.json", training_args=args)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hf_zero.version import __version__

__all__ = [
    "ZeroConfig",
    "ZeroConfigError",
    "ZeroEngine",
    "ZeroSeq2SeqTrainer",
    "ZeroSeq2SeqTrainingArguments",
    "ZeroTrainer",
    "ZeroTrainingArguments",
    "enable_deepspeed_compat",
    "estimate_memory",
    "gathered_parameters",
    "initialize",
    "load_config",
    "prepare_frozen_model",
    "__version__",
]

# Lazy attributes keep `import hf_zero` (and `hf-zero config check`) fast: no torch import until needed.
_LAZY = {
    "ZeroConfig": ("hf_zero.config.schema", "ZeroConfig"),
    "ZeroConfigError": ("hf_zero.config.errors", "ZeroConfigError"),
    "load_config": ("hf_zero.config", "load_config"),
    "ZeroEngine": ("hf_zero.engine.engine", "ZeroEngine"),
    "initialize": ("hf_zero.engine.initialize", "initialize"),
    "gathered_parameters": ("hf_zero.engine.sharded_access", "gathered_parameters"),
    "prepare_frozen_model": ("hf_zero.engine.frozen", "prepare_frozen_model"),
    "estimate_memory": ("hf_zero.estimator", "estimate_memory"),
    "enable_deepspeed_compat": ("hf_zero.deepspeed_api.install", "enable_deepspeed_compat"),
    "ZeroTrainer": ("hf_zero.integration.trainer", "ZeroTrainer"),
    "ZeroSeq2SeqTrainer": ("hf_zero.integration.trainer", "ZeroSeq2SeqTrainer"),
    "ZeroTrainingArguments": ("hf_zero.integration.arguments", "ZeroTrainingArguments"),
    "ZeroSeq2SeqTrainingArguments": ("hf_zero.integration.arguments", "ZeroSeq2SeqTrainingArguments"),
}

if TYPE_CHECKING:
    from hf_zero.config import load_config
    from hf_zero.config.errors import ZeroConfigError
    from hf_zero.config.schema import ZeroConfig
    from hf_zero.deepspeed_api.install import enable_deepspeed_compat
    from hf_zero.engine.engine import ZeroEngine
    from hf_zero.engine.frozen import prepare_frozen_model
    from hf_zero.engine.initialize import initialize
    from hf_zero.estimator import estimate_memory
    from hf_zero.integration.arguments import ZeroSeq2SeqTrainingArguments, ZeroTrainingArguments
    from hf_zero.integration.trainer import ZeroSeq2SeqTrainer, ZeroTrainer


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'hf_zero' has no attribute {name!r}")
