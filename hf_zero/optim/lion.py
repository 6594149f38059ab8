"""Lion (EvoLved Sign Momentum), as DeepSpeed's ``FusedLion`` / ``DeepSpeedCPULion`` compute it.

The update, per element, with ``m`` the momentum, ``g`` the gradient and ``p`` the parameter::

    c = beta1 * m + (1 - beta1) * g
    p = p * (1 - lr * weight_decay) - lr * sign(c)
    m = beta2 * m + (1 - beta2) * g

(``csrc/lion/multi_tensor_lion.cu`` ``LionFunctor`` and ``csrc/lion/cpu_lion_impl.cpp``
``Step_1`` in microsoft/DeepSpeed; Chen et al. 2023, https://arxiv.org/abs/2302.06675.)

One deliberate difference: where ``c`` is exactly zero this uses ``sign(0) = 0`` (the paper and
``torch.sign``) and leaves the element alone. DeepSpeed's CUDA kernel moves it by ``+lr`` and its CPU
kernel by ``-lr`` (``c > 0 ? -lr : lr`` vs ``-copysign(lr, c)``), so an embedding row that gets no
gradient would drift there every step.

The step uses ``torch._foreach_*`` ops only, which DTensor implements element-wise, so it runs
unchanged on FSDP2's sharded parameters (each rank updates its own shard; Lion needs no norms).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["Lion"]


class Lion(torch.optim.Optimizer):
    """Lion optimizer with decoupled weight decay.

    Args:
        params: Tensors to optimize, or param-group dicts.
        lr: Learning rate (Lion wants roughly 3-10x smaller than AdamW's).
        betas: ``(beta1, beta2)``: beta1 mixes the momentum into the sign, beta2 updates the
            momentum. The paper's defaults are ``(0.9, 0.99)``; DeepSpeed's ``FusedLion`` defaults to
            ``(0.9, 0.999)``, and ``build_optimizer`` always passes the config's betas.
        weight_decay: Decoupled weight decay: the parameter is multiplied by ``1 - lr * weight_decay``.

    Example::

        >>> opt = Lion(model.parameters(), lr=1e-4, weight_decay=0.1)
        >>> loss.backward(); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"Lion: lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Lion: betas must be in [0, 1), got {betas}")
        if weight_decay < 0.0:
            raise ValueError(f"Lion: weight_decay must be >= 0, got {weight_decay}")
        # defaults' keys are exactly __init__'s keyword arguments, so that wrappers which rebuild
        # the optimizer from ``defaults`` (ZeroRedundancyOptimizer at stage 1) can do so.
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Update every parameter that has a gradient.

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
            params, grads, exp_avgs = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    # A CPU float tensor, like torch's own optimizers, so checkpoint code treats it alike.
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                params.append(p)
                grads.append(p.grad)
                exp_avgs.append(state["exp_avg"])
            if not params:
                continue

            beta1, beta2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            # c = beta1*m + (1-beta1)*g, in the kernel's order of operations.
            update = torch._foreach_mul(exp_avgs, beta1)
            torch._foreach_add_(update, grads, alpha=1.0 - beta1)
            if any(isinstance(u, DTensor) for u in update):
                # Stage 2/3 shards: torch 2.11 and older have no DTensor rule for _foreach_sign_
                # ("found no DeviceMesh from dtensor args"); the pointwise sign_ has one everywhere.
                for u in update:
                    u.sign_()
            else:
                torch._foreach_sign_(update)
            if wd != 0.0:
                torch._foreach_mul_(params, 1.0 - lr * wd)
            torch._foreach_add_(params, update, alpha=-lr)
            # The momentum is updated after the parameter, with beta2.
            torch._foreach_mul_(exp_avgs, beta2)
            torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta2)
        return loss
