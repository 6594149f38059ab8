"""``--torch_compile`` under hf_zero: compile the trained model as accelerate would.

The plain Trainer compiles its model in ``Accelerator.prepare_model`` (the dynamo plugin built
from ``--torch_compile``, ``--torch_compile_backend``, ``--torch_compile_mode``). hf_zero's engine
takes the model instead of ``prepare_model``, so without this the flag would train uncompiled.

The compile is in place (``nn.Module.compile``), as accelerate's FSDP2 path does it
(``compile_regions_fsdp2``): ``torch.compile(model)`` would return an ``OptimizedModule`` whose
call bypasses the module's hooks, and FSDP2's all-gather/reshard hooks and the DDP wrapper at
stages 0/1 must keep seeing the user's module.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["compile_like_accelerate", "is_compiled_in_place"]


def is_compiled_in_place(model: nn.Module) -> bool:
    """True once ``model.compile()`` has run on ``model``."""
    return getattr(model, "_compiled_call_impl", None) is not None


def compile_like_accelerate(model: nn.Module, dynamo_plugin: Any) -> bool:
    """Compile ``model`` in place with the plugin's backend, mode and options (regional
    compilation too) unless the plugin says no compile or it is compiled already.

    Returns True if it compiled the model now.

    Example::

        >>> compile_like_accelerate(model, trainer.accelerator.state.dynamo_plugin)
        True
    """
    from accelerate.utils import DynamoBackend

    if dynamo_plugin is None or dynamo_plugin.backend == DynamoBackend.NO or is_compiled_in_place(model):
        return False
    kwargs = dynamo_plugin.to_kwargs()
    regional = None
    if getattr(dynamo_plugin, "use_regional_compilation", False):
        try:  # not in every accelerate the project supports
            from accelerate.utils.other import compile_regions_fsdp2 as regional
        except ImportError:
            regional = None
    if regional is not None:
        regional(model, **kwargs)
    else:
        model.compile(**kwargs)
    return True
