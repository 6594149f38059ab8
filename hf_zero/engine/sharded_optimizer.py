"""An optimizer that cannot step on ZeRO-2/3's sharded parameters: an error that says so.

At stages 2 and 3 every parameter is a DTensor shard (FSDP2), and the optimizer steps those. An
element-wise optimizer written with torch ops works unchanged (DTensor runs each op on the local
shard). Others fail deep inside their step: transformers' Adafactor builds its factored statistics
as plain tensors ("got mixed torch.Tensor and DTensor"), bitsandbytes' kernels have no DTensor
rule ("does not have a sharding strategy registered"), torchao's compiled low-bit steps assert on
shapes. Those messages do not say that the stage is the cause or what to do, so the first step of
each optimizer runs under :func:`explain_sharded_step`, which re-raises with both. Errors that
cannot be about the layout (hf_zero's and torch's own optimizers, collectives, offload backends)
pass through unchanged.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

__all__ = ["ShardedOptimizerError", "explain_sharded_step"]

# Optimizers that have completed a step: later failures are not about the parameters' layout.
_STEPPED: weakref.WeakSet = weakref.WeakSet()


class ShardedOptimizerError(RuntimeError):
    """The optimizer's step does not work on sharded (DTensor) parameters."""


def _steps_dtensors(optimizer: torch.optim.Optimizer) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"])


# Optimizers written for DTensor shards: a failure of theirs is not about the layout (review N2:
# LAMB's norms on host shards failed inside a collective and were relabelled, which misled).
_SHARD_AWARE_MODULES = ("hf_zero.", "torch.optim.")


def _may_be_about_the_layout(optimizer: torch.optim.Optimizer, err: BaseException) -> bool:
    """Whether ``err`` can be the optimizer not working on DTensor shards (else it is re-raised as is):
    not for hf_zero's and torch's own optimizers, nor for a collective's or an offload backend's error."""
    import torch.distributed as dist

    if type(optimizer).__module__.startswith(_SHARD_AWARE_MODULES):
        return False
    backend_error = getattr(dist, "DistError", None)
    return not (backend_error is not None and isinstance(err, backend_error))


@contextlib.contextmanager
def explain_sharded_step(optimizer: torch.optim.Optimizer, stage: int) -> Iterator[None]:
    """Run an optimizer step; on sharded parameters, a failure of an optimizer's first step becomes a
    :class:`ShardedOptimizerError` naming the optimizer, the stage and the alternatives (the
    original error is chained as its cause)."""
    if optimizer in _STEPPED or not _steps_dtensors(optimizer):  # offloaded optimizers step plain CPU tensors
        yield
        return
    try:
        yield
    except (RuntimeError, NotImplementedError, AssertionError, TypeError, ValueError) as err:
        from hf_zero.offload.base import OffloadError

        if isinstance(err, OffloadError) or not _may_be_about_the_layout(optimizer, err):
            raise
        name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ShardedOptimizerError(
            f"the optimizer {name} failed at its first step on ZeRO stage {stage}'s sharded parameters "
            f"(each is a DTensor shard; it raised {type(err).__name__}: {first_line[:200]}). It steps "
            "whole parameters at stages 0 and 1: use zero_optimization.stage 1 (optimizer states still "
            "partitioned), or at stages 2/3 an element-wise optimizer written with torch ops (--optim "
            "adamw_torch, adamw_torch_fused, sgd, rmsprop, or a type of the config's optimizer section)"
        ) from err
    _STEPPED.add(optimizer)
