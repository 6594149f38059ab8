"""Mixed precision: fp16 loss scaling (a pure state machine) and the overflow check."""

from hf_zero.precision.loss_scaler import (
    DynamicLossScaler,
    LossScaler,
    StaticLossScaler,
    build_loss_scaler,
    grads_have_inf_or_nan,
)

__all__ = [
    "LossScaler",
    "DynamicLossScaler",
    "StaticLossScaler",
    "build_loss_scaler",
    "grads_have_inf_or_nan",
]
