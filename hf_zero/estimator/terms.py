"""The byte formulas of one ZeRO configuration, per rank: model states (the ZeRO paper's terms,
with offload), the transient buffers of the sharded stages, hf_zero's own layout terms, and
activations. Pure integer arithmetic on :mod:`hf_zero.estimator.constants`; :func:`estimate` in
:mod:`hf_zero.estimator.memory` adds them up for every configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_zero.estimator.choices import PRECISIONS, Precision, ZeroChoice, is_valid_choice
from hf_zero.estimator.constants import (
    ACTIVATION_BYTES_PER_AS2B,
    ACTIVATION_BYTES_PER_SBH,
    AUTOCAST_COPY_BYTES,
    AUTOCAST_GRAD_BYTES,
    BYTES_PER_PARAM_16BIT,
    CHECKPOINT_BYTES_PER_SBH,
    DEFAULT_MICRO_BATCH_SIZE,
    DEFAULT_SEQ_LEN,
    DEFAULT_SUB_GROUP_SIZE,
    FP32_GRAD_COPY_BYTES,
    FP32_REDUCE_BYTES,
    LOGITS_BYTES_PER_ELEMENT,
    OPTIMIZER_NVME_BUFFER_COUNT,
    PARAM_NVME_BUFFER_COUNT,
    PARAM_NVME_BUFFER_SIZE,
    REPLICA_GRAD_BYTES,
    REPLICA_PARAM_BYTES,
    STAGE2_SHARD_EXTRA_BYTES,
    STAGE3_GATHERED_BLOCKS,
)
from hf_zero.estimator.errors import EstimatorError

__all__ = [
    "ActivationEstimate",
    "Breakdown",
    "activation_bytes",
    "implementation_terms",
    "model_state_bytes",
    "shard_elements",
    "working_buffer_bytes",
]


@dataclass(frozen=True, slots=True)
class Breakdown:
    """Bytes in one memory tier, by what they hold."""

    params: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    buffers: int = 0
    """Transient GPU buffers (gathered parameters, unsharded gradients) or host swap buffers for NVMe."""
    layout: int = 0
    """hf_zero's implementation terms beyond the paper's model states (:func:`implementation_terms`)."""

    @property
    def total(self) -> int:
        return self.params + self.gradients + self.optimizer + self.activations + self.buffers + self.layout

    def scaled(self, factor: int) -> Breakdown:
        """Every term times ``factor`` (per rank -> per node)."""
        return Breakdown(*(factor * getattr(self, name) for name in self.__slots__))

    def plus(self, **terms: int) -> Breakdown:
        """A copy with ``terms`` added to the named fields."""
        return Breakdown(*(getattr(self, name) + terms.get(name, 0) for name in self.__slots__))


@dataclass(frozen=True, kw_only=True, slots=True)
class ActivationEstimate:
    """Activation memory of one GPU for one micro-batch."""

    per_layer_bytes: int
    """One layer's stored activations without recompute."""
    layers_bytes: int
    """All layers: every layer's activations, or with checkpointing the layer inputs plus one layer."""
    logits_bytes: int
    micro_batch_size: int
    seq_len: int
    gradient_checkpointing: bool
    store_attention_scores: bool

    @property
    def total(self) -> int:
        return self.layers_bytes + self.logits_bytes


def shard_elements(count: int, ranks: int) -> int:
    """Elements one rank holds of ``count`` sharded over ``ranks`` (padded: ceil)."""
    return -(-count // ranks)


def model_state_bytes(
    choice: ZeroChoice,
    *,
    total_params: int,
    trainable_params: int,
    ranks: int,
    precision: Precision = PRECISIONS["bf16"],
    sub_group_size: int = DEFAULT_SUB_GROUP_SIZE,
    largest_tensor: int = 0,
) -> tuple[Breakdown, Breakdown, Breakdown]:
    """Parameter, gradient and optimizer bytes of **one rank**, as (GPU, host, NVMe).

    Without offload these are the ZeRO paper's terms: 16-bit parameters (all ``total_params``,
    frozen ones included), 16-bit gradients and K bytes of optimizer state (trainable parameters
    only); stage 1 shards the optimizer state, stage 2 also the gradients, stage 3 also the
    parameters, each over ``ranks``.

    Offload (DeepSpeed ZeRO-Offload / ZeRO-Infinity semantics):

    * ``offload_optimizer`` cpu/nvme moves the K bytes of the rank's optimizer shard to that tier
      and adds an fp32 copy of its gradient shard (:data:`FP32_GRAD_COPY_BYTES`) in host RAM (for
      NVMe too: hf_zero does not swap gradients). At stages 2 and 3 the reduced gradient shard goes
      straight there, so the GPU keeps no gradient shard; at stage 1 the full 16-bit gradients stay
      on the GPU (they are reduced after backward).
    * ``offload_param`` cpu/nvme (stage 3 only) moves the rank's 16-bit parameter shard.
    * NVMe needs host buffers: ``min(OPTIMIZER_NVME_BUFFER_COUNT, sub-groups)`` buffers of one
      sub-group's master and state (K bytes per element) for the optimizer,
      :data:`PARAM_NVME_BUFFER_COUNT` 16-bit buffers of ``max(PARAM_NVME_BUFFER_SIZE, largest_tensor)``
      elements for parameters.

    Args:
        choice: stage and offload devices.
        total_params: parameters in memory (base model + LoRA adapters).
        trainable_params: parameters with gradients and optimizer state.
        ranks: N, GPUs over all nodes.
        precision: bytes per parameter (``PRECISIONS["bf16"]``: 2, 2, K = 12).
        sub_group_size: elements per optimizer sub-group (NVMe host buffers).
        largest_tensor: elements of the largest parameter (NVMe parameter buffers).

    Returns:
        ``(gpu, host, nvme)`` breakdowns for one rank (multiply host and NVMe by GPUs per node).

    Example (the ZeRO paper's 7.5B model on 64 GPUs, stage 2: 2Ψ + (2 + K)Ψ/N = 16.6 GB):
        >>> gpu, host, nvme = model_state_bytes(ZeroChoice(2), total_params=7_500_000_000,
        ...     trainable_params=7_500_000_000, ranks=64)
        >>> gpu.total
        16640625000
    """
    if not is_valid_choice(choice):
        raise EstimatorError(f"invalid configuration {choice}: optimizer offload needs stage 1-3, parameter offload stage 3")
    shard = lambda count: shard_elements(count, ranks)  # noqa: E731 -- a one-line helper reads best inline
    tiers = {"gpu": Breakdown(), "cpu": Breakdown(), "nvme": Breakdown()}

    def put(device: str, **terms: int) -> None:
        tier = "gpu" if device == "none" else device
        tiers[tier] = tiers[tier].plus(**terms)

    # Parameters: replicated below stage 3; at stage 3 each rank keeps its shard where offload_param says.
    if choice.stage < 3:
        put("none", params=precision.param_bytes * total_params)
    else:
        put(choice.offload_param, params=precision.param_bytes * shard(total_params))

    # Gradients: full below stage 2; sharded from stage 2, and off the GPU when the optimizer is.
    if choice.stage < 2:
        put("none", gradients=precision.grad_bytes * trainable_params)
    elif choice.offload_optimizer == "none":
        put("none", gradients=precision.grad_bytes * shard(trainable_params))
    if choice.offload_optimizer != "none":
        put("cpu", gradients=FP32_GRAD_COPY_BYTES * shard(trainable_params))

    # Optimizer state: replicated at stage 0, sharded from stage 1, on the offload device if any.
    optimizer_elements = trainable_params if choice.stage == 0 else shard(trainable_params)
    put(choice.offload_optimizer, optimizer=precision.optimizer_k * optimizer_elements)

    # NVMe tiers stream through pinned host buffers.
    if choice.offload_optimizer == "nvme":
        sub_group = min(sub_group_size, shard(trainable_params))
        sub_groups = max(1, -(-shard(trainable_params) // sub_group)) if sub_group else 1
        count = min(OPTIMIZER_NVME_BUFFER_COUNT, sub_groups)
        put("cpu", buffers=count * sub_group * precision.optimizer_k)
    if choice.offload_param == "nvme":
        buffer_elements = max(PARAM_NVME_BUFFER_SIZE, largest_tensor)
        put("cpu", buffers=PARAM_NVME_BUFFER_COUNT * buffer_elements * precision.param_bytes)
    return tiers["gpu"], tiers["cpu"], tiers["nvme"]


def working_buffer_bytes(
    choice: ZeroChoice,
    *,
    block_params: int,
    root_params: int,
    block_trainable: int,
    root_trainable: int,
    precision: Precision = PRECISIONS["bf16"],
) -> int:
    """Transient GPU bytes of the sharded stages, beyond the model states (per GPU).

    hf_zero shards with FSDP2 (DESIGN.md): each transformer block is one unit, the root unit holds
    the rest (embeddings, final norm, LM head).

    * Stage 2: a unit's gradients exist unsharded, in 16 bits, until they are reduce-scattered; the
      root's stay so through backward (the head's gradient comes first, the embedding's last), plus
      one block's at a time.
    * Stage 3: the root unit stays gathered from forward to the end of backward (FSDP2 does not
      reshard the root after forward), :data:`STAGE3_GATHERED_BLOCKS` blocks are gathered at a
      time, plus the stage-2 gradient term. Parameter offload does not change this: shards are
      fetched to the GPU to be gathered.
    * Stages 0 and 1: nothing beyond the full gradients already counted.

    Example:
        >>> working_buffer_bytes(ZeroChoice(3), block_params=100, root_params=50, block_trainable=100,
        ...     root_trainable=50)  # 2 x (50 + 2 x 100) + 2 x (50 + 100)
        800
    """
    if choice.stage < 2:
        return 0
    unsharded_grads = precision.grad_bytes * (root_trainable + block_trainable)
    if choice.stage == 2:
        return unsharded_grads
    gathered = precision.param_bytes * (root_params + STAGE3_GATHERED_BLOCKS * block_params)
    return gathered + unsharded_grads


def implementation_terms(
    choice: ZeroChoice,
    *,
    total_params: int,
    trainable_params: int,
    ranks: int,
    largest_unit_trainable: int,
    precision: Precision = PRECISIONS["bf16"],
) -> dict[str, int]:
    """GPU bytes per rank that hf_zero's layout holds beyond the ZeRO paper's model states, by name.

    The paper (:func:`model_state_bytes`) describes 16-bit parameters and gradients plus K bytes of
    optimizer state; hf_zero differs where noted below (16-bit mixed precision only; with
    ``dtype="fp32"`` every term is 0). With Ψ = ``total_params``, T = ``trainable_params``,
    N' = 1 at stage 0 and N at stage 1, U = ``largest_unit_trainable``:

    * stages 0/1, "replicated fp32 layout": fp32 parameters (:data:`REPLICA_PARAM_BYTES`) + autocast's
      16-bit copies (:data:`AUTOCAST_COPY_BYTES`) and their 16-bit gradients
      (:data:`AUTOCAST_GRAD_BYTES`) + fp32 gradients (:data:`REPLICA_GRAD_BYTES`) + Adam moments
      (K - 4 per trainable element, over N'; none on the GPU with optimizer offload), minus the
      paper's 2Ψ + 2T + KT/N' (KT/N' is on the host with offload). For a full fine-tune that is
      8Ψ - 4Ψ/N' without offload (4Ψ at stage 0, 6Ψ at stage 1 on 2 GPUs) and 8Ψ with offload.
    * stage 2, "parameter shard beside the gathered copy": :data:`STAGE2_SHARD_EXTRA_BYTES` x Ψ/N.
    * stages 2/3, "fp32 gradient reduction": :data:`FP32_REDUCE_BYTES` x (U + U/N).

    Example (stage 0, 1000 parameters, one unit of 400):
        >>> implementation_terms(ZeroChoice(0), total_params=1000, trainable_params=1000, ranks=1,
        ...     largest_unit_trainable=400)
        {'replicated fp32 layout (fp32 params, autocast copies, fp32 grads)': 4000}
    """
    if precision.param_bytes != BYTES_PER_PARAM_16BIT:
        return {}
    terms: dict[str, int] = {}
    if choice.stage < 2:
        opt_elements = trainable_params if choice.stage == 0 else shard_elements(trainable_params, ranks)
        on_gpu = choice.offload_optimizer == "none"
        hf_zero = (REPLICA_PARAM_BYTES + AUTOCAST_COPY_BYTES + AUTOCAST_GRAD_BYTES) * total_params
        hf_zero += REPLICA_GRAD_BYTES * trainable_params
        paper = precision.param_bytes * total_params + precision.grad_bytes * trainable_params
        if on_gpu:
            hf_zero += (precision.optimizer_k - REPLICA_PARAM_BYTES) * opt_elements
            paper += precision.optimizer_k * opt_elements
        terms["replicated fp32 layout (fp32 params, autocast copies, fp32 grads)"] = hf_zero - paper
        return terms
    if choice.stage == 2:
        terms["stage-2 parameter shard beside the gathered copy"] = STAGE2_SHARD_EXTRA_BYTES * shard_elements(total_params, ranks)
    if largest_unit_trainable:
        terms["fp32 gradient reduction (largest unit)"] = FP32_REDUCE_BYTES * (
            largest_unit_trainable + shard_elements(largest_unit_trainable, ranks)
        )
    return terms


def activation_bytes(
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    vocab_size: int | None,
    micro_batch_size: int = DEFAULT_MICRO_BATCH_SIZE,
    seq_len: int = DEFAULT_SEQ_LEN,
    gradient_checkpointing: bool = False,
    store_attention_scores: bool = True,
    precision: Precision = PRECISIONS["bf16"],
) -> ActivationEstimate:
    """Activation bytes of one GPU for one micro-batch of a decoder-only transformer.

    Per layer, without recompute (Korthikanti et al. 2022, "Reducing Activation Recomputation in
    Large Transformer Models", eq. 1, no tensor/sequence parallelism), with s = ``seq_len``,
    b = ``micro_batch_size``, h = ``hidden_size``, a = ``num_heads``::

        s * b * h * (34 + 5 * a * s / h)  bytes  =  34 sbh + 5 a s^2 b

    The ``5 a s^2 b`` term (attention scores, softmax, dropout) is dropped with
    ``store_attention_scores=False``: flash / memory-efficient SDPA kernels recompute it.

    * No checkpointing: ``num_layers`` x the per-layer bytes.
    * Gradient checkpointing: each layer keeps its 16-bit input, ``2 sbh``, and backward recomputes
      one layer at a time, so ``num_layers x 2 sbh + one layer``.
    * Logits for the loss, upcast to fp32: ``4 x b x s x vocab`` (0 if the vocabulary is unknown).

    fp32 training multiplies the layer terms by :data:`FP32_ACTIVATION_FACTOR`. The formula
    describes a GPT block (4h MLP, dropout); for SwiGLU blocks without dropout it is an estimate of
    the same order, to be checked against measurement (see ``hf_zero.estimator.calibration``).

    Example (h=4096, 32 layers, 32 heads, b=1, s=2048, checkpointing, flash attention):
        >>> act = activation_bytes(hidden_size=4096, num_layers=32, num_heads=32, vocab_size=32000,
        ...     gradient_checkpointing=True, store_attention_scores=False)
        >>> act.layers_bytes == 32 * 2 * 2048 * 4096 + 34 * 2048 * 4096, act.logits_bytes == 4 * 2048 * 32000
        (True, True)
    """
    sbh = seq_len * micro_batch_size * hidden_size
    factor = precision.activation_factor
    per_layer = factor * ACTIVATION_BYTES_PER_SBH * sbh
    if store_attention_scores:
        per_layer += factor * ACTIVATION_BYTES_PER_AS2B * num_heads * seq_len * seq_len * micro_batch_size
    if gradient_checkpointing:
        layers = num_layers * factor * CHECKPOINT_BYTES_PER_SBH * sbh + per_layer
    else:
        layers = num_layers * per_layer
    logits = LOGITS_BYTES_PER_ELEMENT * micro_batch_size * seq_len * vocab_size if vocab_size else 0
    return ActivationEstimate(
        per_layer_bytes=per_layer,
        layers_bytes=layers,
        logits_bytes=logits,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        gradient_checkpointing=gradient_checkpointing,
        store_attention_scores=store_attention_scores,
    )
