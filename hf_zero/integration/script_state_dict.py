"""``model.state_dict()`` called by a script at stages 2/3: whole tensors on rank 0, as FSDP gave.

Alpaca's ``train.py`` (and the many scripts derived from it, Qwen's stage-2 branch among them) saves
with ``state_dict = trainer.model.state_dict()`` on every rank, then ``trainer._save(dir,
state_dict=cpu_state_dict)`` on the saving rank. It was written for the Trainer's FSDP, whose
full-state-dict setting (``offload_to_cpu=True, rank0_only=True``) made that call gather the model
onto rank 0's CPU, and for DeepSpeed's stages 1-2, whose parameters are whole. Under hf_zero the
parameters of stages 2/3 are DTensor shards, and the saved file would hold one rank's slices. So,
for calls that come from a script (code outside the packages of
``integration.deepspeed_surface.LIBRARY_PACKAGES``), a post-hook gathers each sharded entry, one
tensor at a time, and keeps it on rank 0's CPU; the other ranks keep their shards (they only take
part in the gathers). Library calls, hf_zero's checkpoints among them, still see the shards.

This is decided by whether the parameters are sharded (stages 2 and 3), not by what
``is_deepspeed_zero3_enabled()`` tells the script (true at stage 3 only, as DeepSpeed).

Offloaded parameters (``offload_param``) are gathered as hf_zero's 16-bit export gathers them:
host shards go to the mesh's device for the collective (NCCL takes no host tensors), and NVMe-swapped
shards are read back first (their storage is empty while swapped out).

Every rank must make the call, as under FSDP: the gathers are collectives.
"""

from __future__ import annotations

import sys
import weakref
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


def _gather_hook(engine_ref: weakref.ref):
    def gather_for_scripts(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        from torch.distributed.tensor import DTensor

        from hf_zero.checkpoint.export16 import params_resident
        from hf_zero.distributed.collectives import on_mesh_device
        from hf_zero.integration.deepspeed_surface import is_library_module

        # torch (DCP's get_model_state_dict...), the libraries and hf_zero's own checkpoints want the shards.
        if prefix or is_library_module(_caller_module()):
            return
        keys = [key for key, value in state_dict.items() if isinstance(value, DTensor)]
        if not keys:
            return
        import torch.distributed as dist

        is_main = not dist.is_initialized() or dist.get_rank() == 0
        engine = engine_ref()
        # NVMe-swapped shards are empty until read back; the values here share their storage.
        with params_resident(engine) if engine is not None else _nothing():
            for key in keys:  # every rank walks the same keys in the same order: the gathers match
                full = on_mesh_device(state_dict[key]).full_tensor()
                if is_main:
                    state_dict[key] = full.detach().cpu()
                del full

    return gather_for_scripts


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def gather_state_dicts_for_scripts(model: nn.Module, engine: Any = None) -> None:
    """Install the post-hook on ``model`` (the root the Trainer holds) once. ``engine`` (the
    ``ZeroEngine`` that sharded it, held weakly) reads NVMe-swapped parameter shards back."""
    if getattr(model, _HOOKED, False):
        return
    model.register_state_dict_post_hook(_gather_hook(weakref.ref(engine) if engine is not None else lambda: None))
    setattr(model, _HOOKED, True)
