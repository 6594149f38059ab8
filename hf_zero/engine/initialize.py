"""``hf_zero.initialize``: the DeepSpeed-style entry point that returns a :class:`ZeroEngine`."""

from __future__ import annotations

from typing import Any

from torch import nn

from hf_zero.config.schema import ZeroConfig
from hf_zero.distributed.env import init_distributed
from hf_zero.engine.engine import OptimizerArg, SchedulerArg, ZeroEngine
from hf_zero.engine.sharded_access import keep_class_names

__all__ = ["initialize"]


def initialize(
    model: nn.Module,
    config: ZeroConfig | str | dict[str, Any],
    optimizer: OptimizerArg = None,
    lr_scheduler: SchedulerArg = None,
    training_args: Any = None,
    *,
    num_training_steps: int | None = None,
) -> ZeroEngine:
    """Wrap ``model`` for ZeRO training as ``config`` says and return the engine.

    Creates a process group when none exists (one process in a notebook needs no environment
    variables) and uses the existing one under ``torchrun``.

    Args:
        model: the model (e.g. from ``AutoModelForCausalLM``), on CPU or on its device.
        config: a DeepSpeed-style config: path (.json/.yaml), dict, JSON string, or ``ZeroConfig``.
        optimizer: an optimizer over ``model``'s parameters (rebuilt on the sharded ones), a
            callable ``param_groups -> optimizer``, or None to use the config's optimizer section.
        lr_scheduler: a scheduler for ``optimizer``, a callable ``optimizer -> scheduler``, or None
            to use the config's scheduler section.
        training_args: ``transformers.TrainingArguments`` to resolve ``"auto"`` values from.
        num_training_steps: total optimizer steps, for ``"auto"`` scheduler lengths.

    Returns:
        The :class:`ZeroEngine`.

    Raises:
        ZeroConfigError: the config is invalid, contradicts ``training_args``, or keeps ``"auto"``
            values that nothing given here can resolve.

    Example::

        >>> engine = hf_zero.initialize(model, {"zero_optimization": {"stage": 3},
        ...     "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "bf16": {"enabled": True}})
        >>> loss = engine(**batch).loss; engine.backward(loss); engine.step()
    """
    from hf_zero.config import ZeroConfigError, load_config

    env = init_distributed()
    if num_training_steps is None and training_args is not None and getattr(training_args, "max_steps", -1) > 0:
        num_training_steps = int(training_args.max_steps)
    resolved = load_config(
        config,
        training_args=training_args,
        model=model,
        world_size=env.world_size,
        num_training_steps=num_training_steps,
    )
    left = resolved.unresolved()
    if left:
        raise ZeroConfigError(
            f"{resolved.source}: these values are still \"auto\": {', '.join(left)}. Pass "
            "training_args= (and num_training_steps= for scheduler lengths) to hf_zero.initialize(), "
            "or write the numbers in the config"
        )
    engine = ZeroEngine(model, resolved, env, optimizer=optimizer, lr_scheduler=lr_scheduler)
    keep_class_names(engine.forward_module)  # transformers decides by _get_name() (label smoothing)
    return engine
