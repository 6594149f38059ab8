"""``deepspeed.ops.adam.FusedAdam`` and ``DeepSpeedCPUAdam``: DeepSpeed's compiled Adam kernels,
here torch's Adam/AdamW built exactly as the config's ``optimizer: {type: Adam}`` section
(``hf_zero/optim/optimizers.py``): same update (``eps`` outside the square root of the
bias-corrected second moment), ``adam_w_mode``/``adamw_mode`` choosing decoupled decay.

Each returns a plain ``torch.optim.Adam``/``AdamW``, so ``Trainer(optimizers=(opt, None))``, the
engine's re-building of the optimizer on the shards and checkpoints treat it like any torch
optimizer. ``isinstance(opt, FusedAdam)`` is therefore false.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["FusedAdam", "DeepSpeedCPUAdam"]


def _adam(params: Any, lr: float, bias_correction: bool, betas: tuple, eps: float, weight_decay: float,
          amsgrad: bool, adam_w_mode: bool, name: str) -> torch.optim.Optimizer:
    from hf_zero.config.schema import OptimizerConfig
    from hf_zero.optim.optimizers import build_optimizer

    if not bias_correction:
        raise ValueError(f"{name}(bias_correction=False) is not supported under hf_zero: torch's Adam/AdamW always "
                         "bias-correct; drop the argument")
    cfg = OptimizerConfig(type="adam", lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                          adam_w_mode=adam_w_mode, amsgrad=amsgrad)
    return build_optimizer(cfg, params)


class FusedAdam:
    """DeepSpeed's ``FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay,
    amsgrad, set_grad_none)``; returns torch's AdamW (``adam_w_mode=True``, the default) or Adam."""

    def __new__(cls, params: Any, lr: float = 1e-3, bias_correction: bool = True, betas: tuple = (0.9, 0.999),
                eps: float = 1e-8, adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                set_grad_none: bool = True) -> Any:
        return _adam(params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adam_w_mode, "FusedAdam")


class DeepSpeedCPUAdam:
    """DeepSpeed's ``DeepSpeedCPUAdam(model_params, lr, bias_correction, betas, eps, weight_decay,
    amsgrad, adamw_mode, fp32_optimizer_states)``; returns torch's AdamW (``adamw_mode=True``) or
    Adam. For a CPU optimizer step under hf_zero, set ``offload_optimizer`` in the config: the
    engine then keeps fp32 masters and this optimizer's state on the host."""

    def __new__(cls, model_params: Any, lr: float = 1e-3, bias_correction: bool = True,
                betas: tuple = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False,
                adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> Any:
        return _adam(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adamw_mode,
                     "DeepSpeedCPUAdam")
