"""LAMB, computed as DeepSpeed's ``FusedLamb`` kernel computes it.

Per parameter tensor ``p`` with gradient ``g`` (already unscaled), at step ``t``::

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    update = m / (sqrt(v) + eps) + weight_decay * p        # no bias correction inside
    w_norm = ||p||,  u_norm = ||update||                    # L2 over the whole tensor, p before the step
    coeff = clamp(w_norm / u_norm, min_coeff, max_coeff)    # 1.0 if either norm is 0
    step_size = lr * sqrt(1 - beta2**t) / (1 - beta1**t)    # lr when bias_correction is off
    p = p - step_size * coeff * update

(``csrc/lamb/fused_lamb_cuda_kernel.cu`` ``lamb_cuda_kernel_part1/2/3`` and ``fused_lamb_cuda`` in
microsoft/DeepSpeed, ``eps_inside_sqrt=False``, i.e. ``ADAM_MODE_1``.) Two things differ from the
LAMB paper and from most other implementations, and are kept here on purpose: bias correction is
folded into the step size rather than applied to ``m`` and ``v``, so the trust ratio is computed on
the *uncorrected* Adam update; and the ratio is clamped to ``[min_coeff, max_coeff]``.

Sharded parameters: the trust ratio needs the norm of the *whole* parameter and of its whole update.
For an FSDP2 DTensor, ``torch.linalg.vector_norm`` / ``torch._foreach_norm`` return a DTensor with a
partial placement; ``full_tensor()`` reduces it across the mesh, giving the global norm. The
norms of one group that live on the same mesh are stacked first so that one all-reduce serves them
all. Shards in host memory (``offload_param: cpu``, FSDP2's ``CPUOffloadPolicy``) give host norms:
they are reduced on the mesh's device (an NCCL group refuses host tensors) and come back to the
shards' device for the update. Everything else is element-wise ``_foreach`` math, which DTensor runs
shard by shard.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["Lamb"]


def _is_dtensor(t: torch.Tensor) -> bool:
    # Checked by attribute so this module imports no torch.distributed code.
    return hasattr(t, "full_tensor") and hasattr(t, "device_mesh")


def global_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """L2 norm of each tensor, reduced over its mesh when it is a sharded DTensor.

    Args:
        tensors: Plain tensors and/or DTensors.

    Returns:
        One 0-dim plain tensor per input: the norm of the full (unsharded) tensor. For DTensors
        this is a collective, so every rank of the mesh must call it with the same tensors.
    """
    out: list[torch.Tensor | None] = [None] * len(tensors)
    plain = [i for i, t in enumerate(tensors) if not _is_dtensor(t)]
    if plain:
        for i, n in zip(plain, torch._foreach_norm([tensors[i] for i in plain])):
            out[i] = n
    by_mesh: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        if _is_dtensor(t):
            by_mesh.setdefault(id(t.device_mesh), []).append(i)
    for idx in by_mesh.values():
        norms = torch._foreach_norm([tensors[i] for i in idx])
        # One reduction for the whole bucket instead of one per parameter.
        stacked = torch.stack(norms)
        if _is_dtensor(stacked):
            from hf_zero.distributed.collectives import on_mesh_device

            # Reduced where the collective runs (review N2: host shards' norms went into NCCL),
            # then back beside the shards, which the update reads them with.
            stacked = on_mesh_device(stacked).full_tensor().to(stacked.device)
        for i, n in zip(idx, stacked.unbind(0)):
            out[i] = n
    return out  # type: ignore[return-value]


class Lamb(torch.optim.Optimizer):
    """LAMB with DeepSpeed ``FusedLamb`` semantics (trust-ratio clamp, folded bias correction).

    Args:
        params: Tensors to optimize, or param-group dicts.
        lr: Learning rate.
        betas: Decay rates of the first and second moment.
        eps: Added to ``sqrt(v)`` (outside the square root).
        weight_decay: L2 term added to the update before the trust ratio (``update += wd * p``).
        bias_correction: Fold Adam's bias correction into the step size.
        max_coeff: Upper bound of the trust ratio.
        min_coeff: Lower bound of the trust ratio.

    Example::

        >>> opt = Lamb(model.parameters(), lr=1e-3, weight_decay=0.01)
        >>> loss.backward(); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"Lamb: lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Lamb: betas must be in [0, 1), got {betas}")
        if eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"Lamb: eps and weight_decay must be >= 0, got {eps}, {weight_decay}")
        if not 0.0 <= min_coeff <= max_coeff:
            raise ValueError(f"Lamb: need 0 <= min_coeff <= max_coeff, got {min_coeff}, {max_coeff}")
        # defaults' keys are exactly __init__'s keyword arguments (see Lion for why).
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Update every parameter that has a gradient.

        With DTensor parameters this all-reduces the per-parameter norms, so all ranks must call it.

        Args:
            closure: Re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                # Per-parameter step, as FusedLamb keeps it (a parameter may miss a step).
                state["step"] += 1
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(int(state["step"].item()))  # a CPU scalar: no device sync
            if not params:
                continue

            beta1, beta2 = group["betas"]
            eps, wd = group["eps"], group["weight_decay"]

            torch._foreach_mul_(exp_avgs, beta1)
            torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta1)
            torch._foreach_mul_(exp_avg_sqs, beta2)
            torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)

            # m / (sqrt(v) + eps) built in one group-sized buffer (as m * (1 / denom), which can
            # differ from a true division in the last bit).
            updates = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_add_(updates, eps)
            torch._foreach_reciprocal_(updates)
            torch._foreach_mul_(updates, exp_avgs)
            if wd != 0.0:
                torch._foreach_add_(updates, params, alpha=wd)

            # Norms of p before it is changed, and of the update (both global for DTensors).
            w_norms = global_norms(params)
            u_norms = global_norms(updates)
            for p, u, w_norm, u_norm, t in zip(params, updates, w_norms, u_norms, steps):
                ratio = (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"])
                # Kept as a tensor so that no device sync happens here.
                coeff = torch.where((w_norm != 0) & (u_norm != 0), ratio, torch.ones_like(ratio))
                if group["bias_correction"]:
                    step_size = group["lr"] * math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t)
                else:
                    step_size = group["lr"]
                p.sub_(u.mul_(coeff.to(u.dtype) * step_size))
        return loss
