"""The estimator's named constants: bytes per parameter, per activation, per buffer, and defaults.

Each is a number a formula in :mod:`hf_zero.estimator.terms` multiplies; the comments say where it
comes from (the ZeRO paper, Korthikanti et al., FSDP2's layout as hf_zero uses it, DeepSpeed's
offload defaults). When measurements drift from the estimate (``hf_zero.estimator.calibration``),
these are the numbers to revisit.
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "ACTIVATION_BYTES_PER_AS2B",
    "ACTIVATION_BYTES_PER_SBH",
    "ADAM_K",
    "ADAM_K_FP32",
    "AUTOCAST_COPY_BYTES",
    "AUTOCAST_GRAD_BYTES",
    "BYTES_PER_GRAD_16BIT",
    "BYTES_PER_GRAD_FP32",
    "BYTES_PER_PARAM_16BIT",
    "BYTES_PER_PARAM_FP32",
    "CHECKPOINT_BYTES_PER_SBH",
    "DEFAULT_GPU_RESERVE_BYTES",
    "DEFAULT_MICRO_BATCH_SIZE",
    "DEFAULT_SEQ_LEN",
    "DEFAULT_SUB_GROUP_SIZE",
    "FP32_ACTIVATION_FACTOR",
    "FP32_GRAD_COPY_BYTES",
    "FP32_REDUCE_BYTES",
    "LOGITS_BYTES_PER_ELEMENT",
    "OFFLOAD_DEVICES",
    "OPTIMIZER_NVME_BUFFER_COUNT",
    "PARAM_NVME_BUFFER_COUNT",
    "PARAM_NVME_BUFFER_SIZE",
    "REPLICA_GRAD_BYTES",
    "REPLICA_PARAM_BYTES",
    "STAGE2_SHARD_EXTRA_BYTES",
    "STAGE3_GATHERED_BLOCKS",
]

OffloadDevice = Literal["none", "cpu", "nvme"]
OFFLOAD_DEVICES: tuple[OffloadDevice, ...] = ("none", "cpu", "nvme")

# --- model states: bytes per parameter (ZeRO paper, section 3.1) ----------------------------------
BYTES_PER_PARAM_16BIT = 2
"""bf16/fp16 parameter used in forward and backward: the paper's first 2Ψ."""
BYTES_PER_GRAD_16BIT = 2
"""bf16/fp16 gradient: the paper's second 2Ψ."""
BYTES_PER_PARAM_FP32 = 4
"""fp32 parameter (``dtype="fp32"`` training, no mixed precision)."""
BYTES_PER_GRAD_FP32 = 4
"""fp32 gradient (``dtype="fp32"``)."""
ADAM_K = 12
"""K of the ZeRO paper for mixed-precision Adam: fp32 master weights, momentum and variance, 4 bytes each."""
ADAM_K_FP32 = 8
"""Adam state in pure fp32 training: the parameters are the master copy, so only momentum and variance."""
FP32_GRAD_COPY_BYTES = 4
"""An offloaded optimizer steps on an fp32 copy of its gradient shard, kept in host RAM beside the
state (DeepSpeed's ZeRO-Offload layout: 12 + 4 = 16 host bytes per parameter). hf_zero keeps it in
host RAM with NVMe optimizer offload too (it never swaps gradients)."""

# --- activations (Korthikanti et al., 2022) -----------------------------------------------------
ACTIVATION_BYTES_PER_SBH = 34
"""Bytes per (sequence x batch x hidden) element stored by one transformer layer with 16-bit
activations and no recompute: attention 11, MLP 19, layer norms 4 (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", section 4.1, eq. 1)."""
ACTIVATION_BYTES_PER_AS2B = 5
"""Bytes per (heads x seq x seq x batch) element of the same layer: softmax output 2, its dropout
mask 1, dropout output 2. Memory-efficient attention kernels (flash, SDPA) do not store them."""
CHECKPOINT_BYTES_PER_SBH = 2
"""With activation checkpointing a layer keeps only its 16-bit input (2 bytes x s x b x h)."""
LOGITS_BYTES_PER_ELEMENT = 4
"""Logits upcast to fp32 for the loss: 4 bytes x batch x seq x vocab."""
FP32_ACTIVATION_FACTOR = 2
"""fp32 activations take twice the 16-bit bytes (approximately: dropout masks stay 1 byte)."""

# --- transient GPU buffers of sharded stages (FSDP2, per DESIGN.md) -----------------------------
STAGE3_GATHERED_BLOCKS = 2
"""Stage 3 holds two transformer blocks gathered at once: the one computing and the one prefetched."""

# --- hf_zero's implementation terms beyond the paper (on by default, off with --no_activations) ----
# Measured on CPU (integration_tests/test_estimator_vs_measured.py, docs/benchmarks.md); each applies
# to 16-bit mixed precision only (fp32 training has no 16-bit copies and reduces in its own dtype).
REPLICA_PARAM_BYTES = 4
"""Stages 0/1 replicate the **fp32** parameters (DDP; they are the optimizer's master copy, so
Adam's state is only 8 of the paper's K = 12 bytes), against the paper's 16-bit replica (2)."""
AUTOCAST_COPY_BYTES = 2
"""Stages 0/1 run forward under ``torch.autocast``: a 16-bit copy of each weight is made and kept,
saved for backward, until that layer's backward has run (all of them at the start of backward)."""
AUTOCAST_GRAD_BYTES = 2
"""Stages 0/1: backward produces each weight's gradient in 16 bits (for autocast's copy) before it
is cast and accumulated into the fp32 ``.grad``; with the copies' release lag this adds about
2 bytes per parameter at the backward peak (measured: 1.5-2)."""
REPLICA_GRAD_BYTES = 4
"""Stages 0/1 keep fp32 gradients (the DDP buckets, which the gradients are views of), against the
paper's 16-bit gradients (2)."""
STAGE2_SHARD_EXTRA_BYTES = 2
"""Stage 2 keeps the parameters gathered in 16 bits (the paper's 2Ψ) *and* each rank's shard: the
fp32 master shard with fp32 gradient shards (4 + 4 + 8 = 16 bytes against the paper's 2 + 12), or,
with optimizer offload, a 16-bit shard. Either way 2Ψ/N more than the paper."""
FP32_REDUCE_BYTES = 4
"""Stages 2/3 reduce-scatter gradients in fp32 (hf_zero's default when ``communication_data_type``
is unset): FSDP2 casts a unit's unsharded 16-bit gradients to an fp32 buffer and reduce-scatters
it into an fp32 output shard. At the peak that is 4 bytes x (the largest unit's trainable
parameters) + 4 x (the same) / N; the root unit (embeddings, head) is normally the largest."""

# --- offload buffers (deepspeed/runtime/zero/offload_config.py defaults) ---------------------------
OPTIMIZER_NVME_BUFFER_COUNT = 4
"""``offload_optimizer.buffer_count``: hf_zero allocates ``min(buffer_count, sub-groups)`` host
buffers, each holding one sub-group's fp32 master and state (K bytes per element)."""
PARAM_NVME_BUFFER_COUNT = 5
"""``offload_param.buffer_count``: host buffers for parameters read from NVMe."""
PARAM_NVME_BUFFER_SIZE = 100_000_000
"""``offload_param.buffer_size`` in elements (raised to the largest tensor, which must fit in one)."""
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000
"""``sub_group_size``: elements the offloaded optimizer steps at once."""

# --- estimate defaults ----------------------------------------------------------------------------
DEFAULT_GPU_RESERVE_BYTES = 2**30
"""Kept free on each GPU when judging fit: CUDA context, NCCL buffers, allocator fragmentation."""
DEFAULT_MICRO_BATCH_SIZE = 1
DEFAULT_SEQ_LEN = 2048
