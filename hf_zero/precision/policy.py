"""Turn the config's precision sections into the dtypes and contexts the stages use.

Two ways of computing in 16 bit, one per sharding family, both with fp32 master weights:

- stages 0/1 (replicated parameters) keep fp32 parameters and run the forward under
  ``torch.autocast``; gradients arrive in fp32 and are all-reduced in ``reduce_dtype``.
- stages 2/3 (FSDP2) keep fp32 *sharded* parameters (the master copy) and let FSDP2's
  ``MixedPrecisionPolicy`` all-gather them cast to the 16-bit dtype; gradients are reduce-scattered
  in ``reduce_dtype`` into fp32 shards.

Which parameters become fp32 masters (trainable ones, also from a 16-bit checkpoint) and which keep
their dtype (frozen ones) is decided in ``precision/masters.py``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from hf_zero.config.schema import ZeroConfig

__all__ = ["PrecisionPolicy", "DTYPES"]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class PrecisionPolicy:
    """Compute and reduce dtypes of one run."""

    compute_dtype: torch.dtype
    """dtype of the forward/backward math (fp32, fp16 or bf16)."""
    reduce_dtype: torch.dtype
    """dtype gradients are reduced in (``communication_data_type``; fp32 when unset)."""

    @classmethod
    def from_config(cls, config: ZeroConfig) -> PrecisionPolicy:
        compute = DTYPES[config.compute_dtype_name]
        # DeepSpeed reduces in the 16-bit dtype when communication_data_type is unset; we reduce in
        # fp32 so that averaging over many ranks does not lose gradient bits (FSDP2/torchtitan default).
        reduce = DTYPES[config.communication_data_type or "fp32"]
        return cls(compute_dtype=compute, reduce_dtype=reduce)

    @property
    def is_16bit(self) -> bool:
        return self.compute_dtype != torch.float32

    def fsdp_mp_policy(self) -> MixedPrecisionPolicy:
        """The FSDP2 policy for stages 2/3 (all-gather in the compute dtype, reduce in reduce_dtype)."""
        if not self.is_16bit and self.reduce_dtype == torch.float32:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(
            param_dtype=self.compute_dtype if self.is_16bit else None,
            reduce_dtype=self.reduce_dtype,
            cast_forward_inputs=True,
        )

    def autocast(self, device: torch.device):
        """The forward context for stages 0/1 (a no-op in fp32)."""
        if not self.is_16bit:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.compute_dtype)
