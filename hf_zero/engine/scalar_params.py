"""0-dim parameters (CLIP/SigLIP ``logit_scale``, small regression heads) under FSDP2.

FSDP2 refuses scalar parameters ("fully_shard doesn't support scalar parameters"): a shard needs a
dimension. DeepSpeed trains such models, so hf_zero stores each scalar as a 1-element parameter
behind a ``torch.nn.utils.parametrize`` parametrization that gives the module its 0-dim view back:
the model's code still reads ``self.logit_scale`` as a scalar, gradients flow to the stored
element, and FSDP2 shards the 1-element tensor like any other.

Read outside the forward (``trainer.model.logit_scale.item()`` after ``train()``), the stored
element is a DTensor shard that only rank 0 holds; the parametrization then gathers it (a
1-element all-gather: every rank must read it, as with ``full_tensor()``) and gives every rank the
plain 0-dim value, which ``.item()``, ``.tolist()`` and ``float()`` read. Inside the forward FSDP2
has already gathered it, and nothing is communicated.

The parametrization renames the state-dict key (``logit_scale`` becomes
``parametrizations.logit_scale.original``, shape ``(1,)``); :func:`restore_scalar_keys` maps a
gathered state dict back to the original names and shapes, so saved weights load into the
unwrapped model with ``from_pretrained``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

__all__ = ["lift_scalar_params", "lifted_keys", "restore_scalar_keys"]

class _AsScalar(nn.Module):
    """Stored as shape ``(1,)``, seen as ``()``."""

    def forward(self, stored: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if isinstance(stored, DTensor):  # outside the forward: the shard; gather it (differentiably)
            from hf_zero.distributed.collectives import on_mesh_device

            # on the mesh's device: an offload_param host shard cannot enter an NCCL collective
            stored = on_mesh_device(stored).full_tensor().to(stored.device)
        return stored.reshape(())

    def right_inverse(self, value: torch.Tensor) -> torch.Tensor:
        return value.reshape(1)


def lift_scalar_params(model: nn.Module) -> list[str]:
    """Give every 0-dim parameter of ``model`` a 1-element storage FSDP2 can shard.

    Returns the lifted parameters' original names (empty for most models, which have none).

    >>> m = nn.Module(); m.scale = nn.Parameter(torch.tensor(2.0))
    >>> lift_scalar_params(m), m.scale.shape, m.parametrizations.scale.original.shape
    (['scale'], torch.Size([]), torch.Size([1]))
    """
    lifted = []
    for module_name, module in list(model.named_modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dim() == 0:
                parametrize.register_parametrization(module, name, _AsScalar(), unsafe=True)
                lifted.append(f"{module_name}.{name}" if module_name else name)
    return lifted


def lifted_keys(model: nn.Module) -> dict[str, str]:
    """``{stored state-dict key: original key}`` for the parameters :func:`lift_scalar_params`
    lifted (found by their parametrization, so other parametrizations are left alone)."""
    out = {}
    for module_name, module in model.named_modules():
        plists = getattr(module, "parametrizations", None)
        if not isinstance(plists, nn.ModuleDict):
            continue
        for name, plist in plists.items():
            if any(isinstance(p, _AsScalar) for p in plist):
                prefix = f"{module_name}." if module_name else ""
                out[f"{prefix}parametrizations.{name}.original"] = f"{prefix}{name}"
    return out


def restore_scalar_keys(state: dict[str, torch.Tensor], keys: dict[str, str]) -> dict[str, torch.Tensor]:
    """``state`` with the lifted entries (``keys`` from :func:`lifted_keys`) back under their original
    names as 0-dim tensors, in the same order; everything else unchanged."""
    if not keys:
        return state
    return {keys.get(k, k): (v.reshape(()) if k in keys else v) for k, v in state.items()}
