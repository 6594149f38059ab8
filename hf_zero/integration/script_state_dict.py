"""``model.state_dict()`` called by a script at stages 2/3: whole tensors on rank 0, as FSDP gave.

Alpaca's ``train.py`` (and the many scripts derived from it) saves with
``state_dict = trainer.model.state_dict()`` on every rank, then ``trainer._save(dir,
state_dict=cpu_state_dict)`` on the saving rank. It was written for the Trainer's FSDP, whose
full-state-dict setting (``offload_to_cpu=True, rank0_only=True``) made that call gather the model
onto rank 0's CPU. Under hf_zero the parameters of stages 2/3 are DTensor shards, and the saved file
would hold one rank's slices. So, for calls that come from a script (the caller rules of
``hf_zero.deepspeed_api.zero3_answer``: not torch, transformers, peft, accelerate, TRL or hf_zero
itself), a post-hook gathers each sharded entry, one tensor at a time, and keeps it on rank 0's CPU;
the other ranks keep their shards (they only take part in the gathers). Library calls, hf_zero's
checkpoints among them, still see the shards.

Every rank must make the call, as under FSDP: the gathers are collectives.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

__all__ = ["gather_state_dicts_for_scripts"]

_HOOKED = "_hf_zero_script_state_dict"


def _caller_module() -> str:
    """The module whose code called ``model.state_dict()`` (``nn.Module``'s own frames skipped)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") == "torch.nn.modules.module":
        frame = frame.f_back
    return (frame.f_globals.get("__name__", "") or "") if frame is not None else ""


def _gather_for_scripts(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    from torch.distributed.tensor import DTensor

    from hf_zero.deepspeed_api.zero3_answer import rule_for

    caller = _caller_module()
    # torch (DCP's get_model_state_dict...) and hf_zero's own checkpoints want the shards.
    if prefix or caller == "torch" or caller.startswith("torch.") or rule_for(caller).answer != "sharded":
        return
    import torch.distributed as dist

    is_main = not dist.is_initialized() or dist.get_rank() == 0
    for key, value in list(state_dict.items()):
        if isinstance(value, DTensor):
            full = value.full_tensor()  # collective: every rank walks the same keys in the same order
            if is_main:
                state_dict[key] = full.detach().cpu()
            del full


def gather_state_dicts_for_scripts(model: nn.Module) -> None:
    """Install the post-hook on ``model`` (the root the Trainer holds) once."""
    if getattr(model, _HOOKED, False):
        return
    model.register_state_dict_post_hook(_gather_for_scripts)
    setattr(model, _HOOKED, True)
