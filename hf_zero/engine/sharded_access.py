"""Using a stage 2/3 model outside its forward: a clear error, and the context that makes it work.

At stages 2 and 3 the parameters are DTensor shards between forwards; FSDP2 gathers them only
around the forward of the model (and of its blocks). Calling a submodule directly after training,
``model.get_input_embeddings()(ids)``, then fails deep in torch ("aten.embedding.default got mixed
torch.Tensor and DTensor"). :func:`guard_direct_calls` turns that into an error that says what to
do, and :func:`gathered_parameters` (DeepSpeed's ``GatheredParameters`` for hf_zero) gathers the
full parameters for a block of code.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["gathered_parameters", "guard_direct_calls", "keep_class_names", "ShardedParameterError"]


class ShardedParameterError(RuntimeError):
    """A submodule of a sharded model was called with its parameters still sharded."""


def _fsdp_modules(module: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered_parameters(model: Any) -> Iterator[nn.Module]:
    """Full (unsharded) parameters inside the block, for code that calls submodules directly.

    Every rank must enter it (gathering is a collective). Costs the full model's parameters in
    the compute dtype on every rank while open. Changes made to parameters inside are not kept:
    train through the engine. A model of stages 0/1 (never sharded) is yielded as it is.

    Example::

        trainer.train()
        with hf_zero.gathered_parameters(trainer.model) as model:
            vectors = model.get_input_embeddings()(ids)

    Args:
        model: the model (or a ``ZeroEngine``: NVMe-swapped parameter shards are read back too).
    """
    from hf_zero.checkpoint.export16 import params_resident, unwrap_model

    with params_resident(model):
        module = unwrap_model(model)
        units = _fsdp_modules(module)
        for unit in units:
            unit.unshard()
        try:
            yield module
        finally:
            for unit in reversed(units):
                unit.reshard()


def guard_direct_calls(model: nn.Module, stage: int) -> None:
    """Make a direct call to a submodule whose parameters are sharded fail with what to do.

    A forward pre-hook on each module that owns parameters itself; it only looks at whether they
    are DTensors (inside the model's forward FSDP2 has swapped in full tensors, so it passes).
    A parametrization's list is left alone: calling it is reading the parameter
    (``model.logit_scale``), which works on shards (engine/scalar_params.py gathers a lifted scalar).
    """
    from torch.distributed.tensor import DTensor
    from torch.nn.utils.parametrize import ParametrizationList

    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if not own or isinstance(module, ParametrizationList):
            continue

        def check(mod: nn.Module, args: Any, _name: str = name or "the model") -> None:
            if any(isinstance(p, DTensor) for p in mod.parameters(recurse=False)):
                raise ShardedParameterError(
                    f"{type(mod).__name__} ({_name}) was called outside the model's forward, where ZeRO "
                    f"stage {stage} keeps its parameters sharded across ranks. Call the model itself "
                    "(model(...), model.generate(...)), or gather them for the block: "
                    "`with hf_zero.gathered_parameters(model): ...` (every rank must enter it)."
                )

        module.register_forward_pre_hook(check)


def _class_name(name: str) -> str:
    return name


def keep_class_names(model: nn.Module) -> None:
    """Give each module ``fully_shard`` re-classed its own class name back in ``_get_name()``.

    FSDP2 changes the class of every module it wraps to ``FSDP<Name>``. Code that decides by name
    then takes another branch without a word: the Trainer's label smoothing looks up
    ``model._get_name()`` among the causal LM classes to shift the labels, and with
    ``FSDPQwen2ForCausalLM`` it smoothed unshifted labels (a different loss from step 1). The module's
    ``repr`` reads the same method, so it shows the model's own class again.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            original = next(c for c in type(module).__mro__[1:] if not issubclass(c, FSDPModule))
            # a partial of a module-level function, not a lambda: the model stays picklable
            module._get_name = functools.partial(_class_name, original.__name__)
