"""Turn a DeepSpeed ``optimizer`` section into a ``torch.optim.Optimizer``.

The mapping follows ``DeepSpeedEngine._configure_basic_optimizer`` (``deepspeed/runtime/engine.py``
in microsoft/DeepSpeed):

========  ==========================================================================================
type      optimizer
========  ==========================================================================================
adam      ``adam_w_mode`` true (DeepSpeed's default): ``torch.optim.AdamW`` (decoupled decay);
          false: ``torch.optim.Adam`` (L2 decay added to the gradient), as FusedAdam/CPUAdam do.
adamw     ``torch.optim.AdamW`` whatever ``adam_w_mode`` says (DeepSpeed: ``name == adamw or
          adam_w_mode``).
sgd       ``torch.optim.SGD`` (momentum, dampening, nesterov, weight_decay).
lion      :class:`hf_zero.optim.lion.Lion` (FusedLion math).
lamb      :class:`hf_zero.optim.lamb.Lamb` (FusedLamb math: trust-ratio clamp, folded bias correction).
muon      :class:`hf_zero.optim.muon.MuonWithAuxAdam` (DeepSpeed's ``MuonWithAuxAdam``): Muon for the
          matrices, AdamW for the rest. The param groups must say ``use_muon``; the engine splits
          them by name and shape (:func:`hf_zero.optim.muon.muon_param_groups`). ``muon_lr`` /
          ``adam_lr`` set each half's lr, ``lr`` both.
========  ==========================================================================================

``torch_adam`` is accepted and changes nothing: hf_zero always uses torch's Adam/AdamW, whose
update is the same as DeepSpeed's FusedAdam and CPUAdam (``eps`` outside the square root of the
bias-corrected second moment).

Fused and foreach kernels: Adam/AdamW are built with ``fused=True`` (one kernel per dtype/device,
available on CPU and CUDA, and it also runs on FSDP2 DTensor parameters); SGD uses ``fused=True`` on
plain tensors and ``foreach=True`` when any parameter is a DTensor, because DTensor has no
sharding rule for ``aten._fused_sgd_`` (torch 2.13). Lion and Lamb use ``torch._foreach_*`` ops.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hf_zero.config.schema import AUTO, OptimizerConfig
from hf_zero.optim.fused_kernels import fused_supported as _fused_supported
from hf_zero.optim.lamb import Lamb
from hf_zero.optim.lion import Lion
from hf_zero.optim.muon import MuonWithAuxAdam

__all__ = ["build_optimizer", "optimizer_state_bytes", "SUPPORTED_OPTIMIZERS"]

SUPPORTED_OPTIMIZERS = ("adam", "adamw", "sgd", "lion", "lamb", "muon")
"""Canonical (lower-case) ``optimizer.type`` values that :func:`build_optimizer` understands."""

# Fields that "auto" may stand for in a DeepSpeed optimizer section (transformers fills these from
# TrainingArguments); any other field is typed and cannot hold "auto".
_AUTO_FIELDS = ("lr", "betas", "eps", "weight_decay")


def _is_dtensor(t: Any) -> bool:
    # By attribute, so that this module imports no torch.distributed code.
    return hasattr(t, "full_tensor") and hasattr(t, "device_mesh")


def _check_resolved(cfg: OptimizerConfig) -> None:
    unresolved = [f"optimizer.params.{name}" for name in _AUTO_FIELDS if _is_auto(getattr(cfg, name))]
    if unresolved:
        raise ValueError(
            f"{', '.join(unresolved)} still 'auto'; resolve the config from TrainingArguments "
            "(config/auto.py) or give numbers before building the optimizer"
        )


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


def _materialize(params: Iterable[torch.Tensor] | Iterable[dict[str, Any]]) -> tuple[list, list[torch.Tensor]]:
    """Copy ``params`` into a list (it may be a generator) and list every tensor in it."""
    items: list = []
    tensors: list[torch.Tensor] = []
    for item in params:
        if isinstance(item, dict):
            # A copy, so the caller's dict is not changed; a generator inside it is read once here.
            group = dict(item)
            group_params = group["params"]
            group["params"] = [group_params] if isinstance(group_params, torch.Tensor) else list(group_params)
            tensors.extend(group["params"])
            items.append(group)
        else:
            tensors.append(item)
            items.append(item)
    return items, tensors


def build_optimizer(
    cfg: OptimizerConfig, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]]
) -> torch.optim.Optimizer:
    """Build the optimizer that a resolved DeepSpeed ``optimizer`` section describes.

    Args:
        cfg: The ``optimizer`` section; ``cfg.type`` is canonical lower case and ``lr``, ``betas``,
            ``eps`` and ``weight_decay`` must be numbers (not ``"auto"``).
        params: Tensors, or param-group dicts (``{"params": [...], "weight_decay": 0.0, ...}``).
            Keys a group sets override the section's values for that group, as in torch. For
            Muon, dicts with ``use_muon`` (see :func:`hf_zero.optim.muon.muon_param_groups`).

    Returns:
        A ``torch.optim.Optimizer`` whose ``param_groups`` follow ``params``.

    Raises:
        ValueError: ``cfg.type`` is unknown, a field is still ``"auto"``, or the section asks for
            something the chosen optimizer cannot do (``bias_correction: false`` with Adam,
            ``amsgrad`` with Lion/Lamb/Muon, Muon groups without ``use_muon``).

    Example::

        >>> cfg = OptimizerConfig(type="adamw", lr=3e-4, weight_decay=0.1)
        >>> opt = build_optimizer(cfg, [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}])
    """
    _check_resolved(cfg)
    kind = cfg.type.lower()
    betas = (float(cfg.betas[0]), float(cfg.betas[1]))
    items, tensors = _materialize(params)
    has_dtensor = any(_is_dtensor(t) for t in tensors)

    if kind in ("adam", "adamw"):
        if not cfg.bias_correction:
            raise ValueError(
                f"optimizer.params.bias_correction=false is not supported for {cfg.type}: torch's "
                "Adam/AdamW always bias-correct; remove the key"
            )
        # DeepSpeed: "Optimizer name of Adam forces AdamW logic unless adam_w_mode is explicitly set".
        decoupled = kind == "adamw" or cfg.adam_w_mode
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        # The fused kernel takes any floating dtype on CPU and CUDA, DTensor shards included;
        # elsewhere (other devices) torch picks its default implementation.
        fast = dict(fused=True) if _fused_supported(tensors) else {}
        return cls(
            items,
            lr=cfg.lr,
            betas=betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            amsgrad=cfg.amsgrad,
            **fast,
        )
    if kind == "sgd":
        if has_dtensor:
            fast = dict(foreach=True)  # no DTensor sharding rule for aten._fused_sgd_
        else:
            fast = dict(fused=True) if _fused_supported(tensors) else {}
        return torch.optim.SGD(
            items,
            lr=cfg.lr,
            momentum=cfg.momentum,
            dampening=cfg.dampening,
            weight_decay=cfg.weight_decay,
            nesterov=cfg.nesterov,
            **fast,
        )
    if kind in ("lion", "lamb") and cfg.amsgrad:
        raise ValueError(f"optimizer.params.amsgrad=true is not supported for {cfg.type}")
    if kind == "lion":
        return Lion(items, lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay)
    if kind == "lamb":
        return Lamb(
            items,
            lr=cfg.lr,
            betas=betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            bias_correction=cfg.bias_correction,
            max_coeff=cfg.max_coeff,
            min_coeff=cfg.min_coeff,
        )
    if kind == "muon":
        if cfg.amsgrad or not cfg.bias_correction:
            raise ValueError("optimizer.params.amsgrad / bias_correction are not settings of Muon's Adam half "
                             "(DeepSpeed runs it bias-corrected, without AMSGrad); remove them")
        return MuonWithAuxAdam(
            items,
            lr=cfg.lr if cfg.muon_lr is None else cfg.muon_lr,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            ns_method=cfg.ns_method,
            adam_lr=cfg.lr if cfg.adam_lr is None else cfg.adam_lr,
            betas=betas,
            eps=cfg.eps,
            adam_w_mode=cfg.adam_w_mode,
        )
    raise ValueError(
        f"optimizer.type={cfg.type!r} is not supported; use one of {', '.join(SUPPORTED_OPTIMIZERS)}"
    )


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state held by *this* rank.

    Counts every tensor in ``optimizer.state`` (moments, momentum buffers, step counters); for a
    DTensor only its local shard counts, which is what shows ZeRO's sharding of the state.

    Args:
        optimizer: Any torch optimizer.

    Returns:
        The total size in bytes.
    """
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if not isinstance(value, torch.Tensor):
                continue
            local = value.to_local() if _is_dtensor(value) else value
            total += local.numel() * local.element_size()
    return total
