"""What scripts written for DeepSpeed read from the Trainer, answered for a ZeroTrainer.

Such scripts decide how to save by asking the Trainer: ``trainer.is_deepspeed_enabled`` (FastChat
saves with ``trainer.save_model()`` when it is true, else takes an FSDP1 branch that fails on
current torch), ``trainer.deepspeed`` (LLaVA), and they gather a ZeRO-3 model with
``trainer.model_wrapped._zero3_consolidated_16bit_state_dict()`` (Qwen). Under hf_zero the model
is sharded by a ZeRO engine, so for the *script* these answer as DeepSpeed's would.

Library code asks the same questions and must keep its own answers: the Trainer checks
``self.is_deepspeed_enabled`` in about thirty places to call DeepSpeed itself (``deepspeed_init``,
the DeepSpeed dtype cast of inputs, ``self.deepspeed.config``), TRL to wrap reference models with
``deepspeed.initialize``. hf_zero has no DeepSpeed plugin, so there the answer stays accelerate's
(false) and ZeroTrainer's own hooks do the work. :func:`called_from_library` tells the two apart by
the module of the calling code.

This module does not import the ``deepspeed`` namespace (``hf_zero/deepspeed_api``): these answers
hold with or without it.
"""

from __future__ import annotations

import sys
import weakref
from collections import OrderedDict
from typing import Any

from torch import nn

__all__ = [
    "LIBRARY_PACKAGES",
    "called_from_library",
    "is_library_module",
    "attach_consolidated_state_dict",
    "check_whole_state_dict",
]

LIBRARY_PACKAGES = frozenset({"transformers", "accelerate", "peft", "trl", "torch", "hf_zero", "llamafactory"})
"""Top-level packages whose code gets the libraries' answers (their DeepSpeed branches stay off).
LLaMA-Factory is one: its DPO/KTO trainers hand the reference model to TRL's ``prepare_deepspeed``
(``deepspeed.initialize``) when ``self.is_deepspeed_enabled``, else to
``accelerator.prepare_model(evaluation_mode=True)``, which hf_zero routes to ``prepare_frozen_model``."""


def is_library_module(module_name: str) -> bool:
    """Whether code of the module ``module_name`` belongs to one of :data:`LIBRARY_PACKAGES`."""
    return module_name.split(".", 1)[0] in LIBRARY_PACKAGES


def called_from_library(depth: int = 2) -> bool:
    """True when the code ``depth`` frames above this call lives in one of :data:`LIBRARY_PACKAGES`.

    ``depth=2`` is the caller of the function that calls this one (a property getter asks about
    the code that read the property). A script run as ``__main__`` and the user's own modules are
    not libraries.
    """
    try:
        frame = sys._getframe(depth)
    except ValueError:  # fewer frames than asked for: the interpreter itself called
        return True
    return is_library_module(frame.f_globals.get("__name__", "") or "")


def attach_consolidated_state_dict(module: nn.Module, engine: Any) -> None:
    """Give ``module`` (what the Trainer calls ``model_wrapped``) DeepSpeed's
    ``_zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=False)``.

    As DeepSpeed's: every rank must call it (stages 2 and 3 gather with collectives); rank 0 gets
    an ``OrderedDict`` of full CPU tensors in the compute dtype (bf16/fp16, or fp32 when training in
    fp32) keyed as ``model.state_dict()``, tied weights sharing one tensor; other ranks get None.
    ``exclude_frozen_parameters=True`` leaves out parameters with ``requires_grad=False`` (buffers
    stay). It works at every stage, not only 3. The engine is held weakly: the method does not keep
    a closed engine alive.
    """
    engine_ref = weakref.ref(engine)

    def _zero3_consolidated_16bit_state_dict(exclude_frozen_parameters: bool = False) -> OrderedDict | None:
        import torch.distributed as dist

        from hf_zero.checkpoint.export16 import gather_full_state_dict, unwrap_model

        live = engine_ref()
        if live is None:
            raise RuntimeError(
                "_zero3_consolidated_16bit_state_dict: the hf_zero engine of this model was closed; call "
                "it while the trainer that trained the model is alive (or use trainer.save_model(DIR))"
            )
        key_filter = None
        if exclude_frozen_parameters:
            frozen = {n for n, p in unwrap_model(live).named_parameters() if not p.requires_grad}
            key_filter = lambda key: key not in frozen  # noqa: E731
        state = gather_full_state_dict(live, dtype=live.precision.compute_dtype, state_dict_filter=key_filter)
        rank = dist.get_rank() if dist.is_initialized() else 0
        return OrderedDict(state) if rank == 0 else None

    # A plain attribute (nn.Module.__setattr__ keeps non-tensor values in __dict__); the signature
    # is DeepSpeed's, which some trainers inspect.
    module._zero3_consolidated_16bit_state_dict = _zero3_consolidated_16bit_state_dict


def check_whole_state_dict(state_dict: dict, where: str) -> None:
    """Refuse a state dict that holds hf_zero's parameter shards (DTensors) where whole tensors
    are needed (``Trainer._save(dir, state_dict=model.state_dict())`` at stage 2/3 would write
    one rank's slices).

    Raises:
        ValueError: naming the first sharded key and the ways to gather.
    """
    from torch.distributed.tensor import DTensor

    for key, value in state_dict.items():
        if isinstance(value, DTensor):
            raise ValueError(
                f"{where}: state_dict[{key!r}] is a shard of an hf_zero ZeRO-2/3 model (a DTensor), not the "
                "whole tensor. Gather on every rank first: state_dict = "
                "trainer.model_wrapped._zero3_consolidated_16bit_state_dict() (full tensors on rank 0), or "
                "save with trainer.save_model(output_dir)."
            )
