"""Memory per GPU, per node (host RAM) and per node (NVMe) for every ZeRO stage and offload choice.

Pure integer arithmetic on named constants; no torch, no torch.distributed. The model-state terms
are those of the ZeRO paper (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", section 5; source 004 of the design notes). For Ψ parameters, N ranks
and K bytes of optimizer state per parameter (K = 12 for mixed-precision Adam), the bytes per GPU are::

    stage 0 (data parallel)   (2 + 2 + K) Ψ
    stage 1 (P_os)            2Ψ + 2Ψ + KΨ/N
    stage 2 (P_os+g)          2Ψ + (2 + K)Ψ/N
    stage 3 (P_os+g+p)        (2 + 2 + K)Ψ/N

A rank's shard of ``n`` elements is ``ceil(n / N)`` (flat buffers are padded to a multiple of N), so
the formulas are exact integers whenever N divides Ψ. Offload moves some of those terms to host RAM
or NVMe (see :func:`model_state_bytes`), LoRA shrinks the gradient and optimizer terms to the
trainable parameters, and, unless switched off, a working-memory term (activations, gathered
parameters, unsharded gradients) and hf_zero's own layout terms (fp32 replicas at stages 0/1,
fp32 gradient reduction; :func:`implementation_terms`) are added per GPU. ``docs/estimator.md``
lists every assumption.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from hf_zero.estimator.errors import EstimatorError
from hf_zero.estimator.model_spec import ALL_LINEAR, ModelSpec, load_model_spec, lora_param_count, lora_target_layers
from hf_zero.estimator.units import parse_memory_size

__all__ = [
    "ACTIVATION_BYTES_PER_AS2B",
    "ACTIVATION_BYTES_PER_SBH",
    "AUTOCAST_COPY_BYTES",
    "AUTOCAST_GRAD_BYTES",
    "ADAM_K",
    "ADAM_K_FP32",
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
    "PRECISIONS",
    "REPLICA_GRAD_BYTES",
    "REPLICA_PARAM_BYTES",
    "SPEED_ORDER",
    "STAGE2_SHARD_EXTRA_BYTES",
    "STAGE3_GATHERED_BLOCKS",
    "ActivationEstimate",
    "Breakdown",
    "Estimate",
    "Precision",
    "Row",
    "ZeroChoice",
    "activation_bytes",
    "estimate",
    "estimate_memory",
    "implementation_terms",
    "is_valid_choice",
    "model_state_bytes",
    "working_buffer_bytes",
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


@dataclass(frozen=True, kw_only=True, slots=True)
class Precision:
    """Bytes per parameter of one training precision."""

    name: str
    param_bytes: int
    grad_bytes: int
    optimizer_k: int
    """K: optimizer-state bytes per trainable parameter (fp32 master included when there is one)."""
    activation_factor: int
    """Multiplier on the 16-bit activation formula."""


PRECISIONS: dict[str, Precision] = {
    "bf16": Precision(name="bf16", param_bytes=BYTES_PER_PARAM_16BIT, grad_bytes=BYTES_PER_GRAD_16BIT, optimizer_k=ADAM_K, activation_factor=1),
    "fp16": Precision(name="fp16", param_bytes=BYTES_PER_PARAM_16BIT, grad_bytes=BYTES_PER_GRAD_16BIT, optimizer_k=ADAM_K, activation_factor=1),
    "fp32": Precision(name="fp32", param_bytes=BYTES_PER_PARAM_FP32, grad_bytes=BYTES_PER_GRAD_FP32, optimizer_k=ADAM_K_FP32, activation_factor=FP32_ACTIVATION_FACTOR),
}
"""Training precisions by ``--dtype`` name; bf16 and fp16 are the paper's mixed precision."""


@dataclass(frozen=True, slots=True)
class ZeroChoice:
    """One ZeRO configuration: a stage and where optimizer state and parameters live."""

    stage: int
    offload_optimizer: OffloadDevice = "none"
    offload_param: OffloadDevice = "none"

    def label(self) -> str:
        """Short name for tables, e.g. ``ZeRO-3 + optimizer cpu + params nvme``."""
        parts = [f"ZeRO-{self.stage}"]
        if self.offload_optimizer != "none":
            parts.append(f"optimizer {self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"params {self.offload_param}")
        return " + ".join(parts)


def is_valid_choice(choice: ZeroChoice) -> bool:
    """Whether DeepSpeed's config allows it: optimizer offload at stages 1-3, parameter offload at stage 3.

    DeepSpeed itself runs NVMe optimizer offload only at stage 3 (ZeRO-Infinity); hf_zero's own
    offload backend is per optimizer shard, so stages 1 and 2 are listed with NVMe too.
    """
    if choice.stage not in (0, 1, 2, 3):
        return False
    if choice.offload_optimizer not in OFFLOAD_DEVICES or choice.offload_param not in OFFLOAD_DEVICES:
        return False
    if choice.stage == 0 and choice.offload_optimizer != "none":
        return False
    return choice.stage == 3 or choice.offload_param == "none"


SPEED_ORDER: tuple[ZeroChoice, ...] = (
    # No offload: higher stages add communication (stage 3 moves 1.5x the data of stages 0-2).
    ZeroChoice(0),
    ZeroChoice(1),
    ZeroChoice(2),
    ZeroChoice(3),
    # Optimizer on the host: a CPU Adam step and gradient copies over PCIe every step.
    ZeroChoice(1, "cpu"),
    ZeroChoice(2, "cpu"),
    ZeroChoice(3, "cpu"),
    # Parameters on the host too: every forward and backward fetches every shard over PCIe.
    ZeroChoice(3, "none", "cpu"),
    ZeroChoice(3, "cpu", "cpu"),
    # NVMe: disk bandwidth (a few GB/s) is below PCIe, so anything on NVMe comes last.
    ZeroChoice(1, "nvme"),
    ZeroChoice(2, "nvme"),
    ZeroChoice(3, "nvme"),
    ZeroChoice(3, "none", "nvme"),
    ZeroChoice(3, "nvme", "cpu"),
    ZeroChoice(3, "cpu", "nvme"),
    ZeroChoice(3, "nvme", "nvme"),
)
"""Every valid configuration, fastest first: the order in which "the fastest that fits" is chosen.
The order is a rule of thumb (no measurement); see docs/estimator.md."""


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
class Row:
    """One configuration's memory: per GPU, per node of host RAM, per node of NVMe."""

    choice: ZeroChoice
    speed_rank: int
    """Position in :data:`SPEED_ORDER` (0 = fastest)."""
    gpu: Breakdown
    """Per GPU."""
    cpu: Breakdown
    """Per node: the sum over the node's GPUs (``num_gpus`` ranks)."""
    nvme: Breakdown
    """Per node, like ``cpu``."""
    fits: bool
    over: tuple[str, ...] = ()
    """Tiers that exceed their limit (``"gpu"``, ``"cpu"``, ``"nvme"``); empty when it fits."""
    layout_terms: tuple[tuple[str, int], ...] = ()
    """The named terms summed in ``gpu.layout`` (per GPU); empty with ``include_activations=False``."""

    @property
    def stage(self) -> int:
        return self.choice.stage

    @property
    def offload_optimizer(self) -> str:
        return self.choice.offload_optimizer

    @property
    def offload_param(self) -> str:
        return self.choice.offload_param

    @property
    def gpu_bytes(self) -> int:
        return self.gpu.total

    @property
    def cpu_bytes(self) -> int:
        return self.cpu.total

    @property
    def nvme_bytes(self) -> int:
        return self.nvme.total

    def as_dict(self) -> dict[str, Any]:
        """The row as ``--json`` prints it (and :func:`estimate_memory` returns it)."""
        return {
            "stage": self.stage,
            "offload_optimizer": self.offload_optimizer,
            "offload_param": self.offload_param,
            "gpu_bytes": self.gpu_bytes,
            "cpu_bytes": self.cpu_bytes,
            "nvme_bytes": self.nvme_bytes,
            "fits": self.fits,
        }


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


@dataclass(frozen=True, kw_only=True, slots=True)
class Estimate:
    """Everything :func:`estimate` worked out; ``rows`` are in :data:`SPEED_ORDER`."""

    model: ModelSpec
    total_params: int
    """Parameters held in memory: the model's plus LoRA adapters."""
    trainable_params: int
    lora_rank: int | None
    lora_targets: tuple[str, ...]
    """Module names LoRA adapts (empty without LoRA)."""
    num_gpus: int
    num_nodes: int
    precision: Precision
    include_activations: bool
    activations: ActivationEstimate | None
    gpu_memory: int | None
    cpu_memory: int | None
    nvme_memory: int | None
    gpu_reserve: int
    sub_group_size: int
    rows: tuple[Row, ...]
    notes: tuple[str, ...] = field(default=())

    @property
    def ranks(self) -> int:
        """N of the formulas: every GPU of every node."""
        return self.num_gpus * self.num_nodes

    @property
    def fastest_fit(self) -> Row | None:
        """The first row in speed order that fits, or ``None``."""
        return next((row for row in self.rows if row.fits), None)

    @property
    def smallest_gpu_row(self) -> Row:
        """The row needing the least memory per GPU (the fastest of equals)."""
        return min(self.rows, key=lambda row: (row.gpu_bytes, row.speed_rank))

    def as_rows(self) -> list[dict[str, Any]]:
        """The rows as plain dicts, as ``--json`` prints them."""
        return [row.as_dict() for row in self.rows]


def _shard(count: int, ranks: int) -> int:
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
    shard = lambda count: _shard(count, ranks)  # noqa: E731 -- a one-line helper reads best inline
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
        opt_elements = trainable_params if choice.stage == 0 else _shard(trainable_params, ranks)
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
        terms["stage-2 parameter shard beside the gathered copy"] = STAGE2_SHARD_EXTRA_BYTES * _shard(total_params, ranks)
    if largest_unit_trainable:
        terms["fp32 gradient reduction (largest unit)"] = FP32_REDUCE_BYTES * (
            largest_unit_trainable + _shard(largest_unit_trainable, ranks)
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


def _size_or_none(value: int | str | None, what: str) -> int | None:
    return None if value is None else parse_memory_size(value, what=what)


def _positive(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EstimatorError(f"{what} must be a positive integer, got {value!r}")
    return value


def estimate(
    model: Any,
    *,
    num_gpus: int = 1,
    num_nodes: int = 1,
    gpu_memory: int | str | None = None,
    cpu_memory: int | str | None = None,
    nvme_memory: int | str | None = None,
    gpu_reserve: int | str = DEFAULT_GPU_RESERVE_BYTES,
    dtype: str = "bf16",
    lora_rank: int | None = None,
    lora_target_modules: str | Sequence[str] = ALL_LINEAR,
    micro_batch_size: int = DEFAULT_MICRO_BATCH_SIZE,
    seq_len: int = DEFAULT_SEQ_LEN,
    gradient_checkpointing: bool = False,
    flash_attention: bool = False,
    include_activations: bool = True,
    sub_group_size: int = DEFAULT_SUB_GROUP_SIZE,
    hidden_size: int | None = None,
    num_layers: int | None = None,
    num_heads: int | None = None,
    vocab_size: int | None = None,
    intermediate_size: int | None = None,
    num_kv_heads: int | None = None,
    trust_remote_code: bool = False,
) -> Estimate:
    """Memory of every ZeRO stage / offload configuration, with the details behind each number.

    Same arguments as :func:`estimate_memory`, which returns only the rows; this returns an
    :class:`Estimate` (model counts, activation estimate, breakdowns per tier, notes).
    """
    num_gpus = _positive(num_gpus, "num_gpus")
    num_nodes = _positive(num_nodes, "num_nodes")
    micro_batch_size = _positive(micro_batch_size, "micro_batch_size")
    seq_len = _positive(seq_len, "seq_len")
    sub_group_size = _positive(sub_group_size, "sub_group_size")
    if dtype not in PRECISIONS:
        raise EstimatorError(f"dtype {dtype!r} is not one of {sorted(PRECISIONS)}")
    precision = PRECISIONS[dtype]
    gpu_limit = _size_or_none(gpu_memory, "gpu_memory")
    cpu_limit = _size_or_none(cpu_memory, "cpu_memory")
    nvme_limit = _size_or_none(nvme_memory, "nvme_memory")
    reserve = 0 if gpu_reserve in (0, "0") else parse_memory_size(gpu_reserve, what="gpu_reserve")

    spec = load_model_spec(
        model,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        vocab_size=vocab_size,
        intermediate_size=intermediate_size,
        num_kv_heads=num_kv_heads,
        trust_remote_code=trust_remote_code,
    )
    notes = list(spec.notes)

    # Trainable parameters, and their split into blocks / root for the gradient buffers.
    if lora_rank is None:
        lora_targets: tuple[str, ...] = ()
        total_params = trainable = spec.total_params
        block_trainable, root_trainable = spec.block_params, spec.root_params
        block_total, root_total = spec.block_params, spec.root_params
    else:
        lora_rank = _positive(lora_rank, "lora_rank")
        layers = lora_target_layers(spec, lora_target_modules)
        lora_targets = tuple(layer.name for layer in layers)
        if spec.source != "meta-device count":  # layers were synthesized, not read from the model
            notes.append("LoRA layers assumed Llama-style (separate q/k/v/o and gate/up/down projections)")
        trainable = lora_param_count(layers, lora_rank)
        total_params = spec.total_params + trainable
        per_block: dict[int | None, int] = {}
        for layer in layers:
            per_block[layer.block] = per_block.get(layer.block, 0) + lora_param_count([layer], lora_rank)
        block_trainable = max((v for k, v in per_block.items() if k is not None), default=0)
        root_trainable = per_block.get(None, 0)
        block_total = None if spec.block_params is None else spec.block_params + block_trainable
        root_total = None if spec.root_params is None else spec.root_params + root_trainable

    activations = None
    if include_activations:
        if spec.hidden_size and spec.num_layers and spec.num_heads:
            activations = activation_bytes(
                hidden_size=spec.hidden_size,
                num_layers=spec.num_layers,
                num_heads=spec.num_heads,
                vocab_size=spec.vocab_size,
                micro_batch_size=micro_batch_size,
                seq_len=seq_len,
                gradient_checkpointing=gradient_checkpointing,
                store_attention_scores=not flash_attention,
                precision=precision,
            )
            if not spec.vocab_size:
                notes.append("vocabulary size unknown: logits not counted (give --vocab_size)")
        else:
            notes.append("activations skipped: hidden size / layers / heads unknown (give a config or --hidden_size and --num_layers)")
        if block_total is None or root_total is None:
            notes.append("stage 2/3 gathered-parameter and gradient buffers skipped: block sizes unknown")

    ranks = num_gpus * num_nodes
    rows = []
    for speed_rank, choice in enumerate(SPEED_ORDER):
        gpu, cpu, nvme = model_state_bytes(
            choice,
            total_params=total_params,
            trainable_params=trainable,
            ranks=ranks,
            precision=precision,
            sub_group_size=sub_group_size,
            largest_tensor=spec.largest_tensor or 0,
        )
        if include_activations:
            buffers = 0
            if block_total is not None and root_total is not None:
                buffers = working_buffer_bytes(
                    choice,
                    block_params=block_total,
                    root_params=root_total,
                    block_trainable=block_trainable or 0,
                    root_trainable=root_trainable or 0,
                    precision=precision,
                )
            unit = max(block_trainable or 0, root_trainable or 0)
            terms = implementation_terms(
                choice,
                total_params=total_params,
                trainable_params=trainable,
                ranks=ranks,
                largest_unit_trainable=unit,
                precision=precision,
            )
            layout_terms = tuple(terms.items())
            gpu = gpu.plus(activations=activations.total if activations else 0, buffers=buffers,
                           layout=sum(terms.values()))
        else:
            layout_terms = ()
        cpu, nvme = cpu.scaled(num_gpus), nvme.scaled(num_gpus)  # per rank -> per node
        over = tuple(
            tier
            for tier, need, limit in (("gpu", gpu.total + reserve, gpu_limit), ("cpu", cpu.total, cpu_limit), ("nvme", nvme.total, nvme_limit))
            if limit is not None and need > limit
        )
        rows.append(Row(choice=choice, speed_rank=speed_rank, gpu=gpu, cpu=cpu, nvme=nvme, fits=not over, over=over,
                        layout_terms=layout_terms))

    if _shard(trainable, ranks) <= sub_group_size:
        # DeepSpeed's swapper steps one sub-group at a time through OPTIMIZER_NVME_BUFFER_COUNT fp32
        # buffers; when the whole shard is one sub-group those buffers are as large as CPU offload.
        notes.append(
            "NVMe optimizer offload: the host buffers hold a whole optimizer shard because sub_group_size "
            f"({sub_group_size:,}) >= the shard ({_shard(trainable, ranks):,}); a smaller sub_group_size "
            "(e.g. 1e8) shrinks them, at some speed"
        )
    for what, limit in (("GPU", gpu_limit), ("CPU", cpu_limit), ("NVMe", nvme_limit)):
        if limit is None:
            notes.append(f"{what} memory not given: not checked")
    return Estimate(
        model=spec,
        total_params=total_params,
        trainable_params=trainable,
        lora_rank=lora_rank,
        lora_targets=lora_targets,
        num_gpus=num_gpus,
        num_nodes=num_nodes,
        precision=precision,
        include_activations=include_activations,
        activations=activations,
        gpu_memory=gpu_limit,
        cpu_memory=cpu_limit,
        nvme_memory=nvme_limit,
        gpu_reserve=reserve,
        sub_group_size=sub_group_size,
        rows=tuple(rows),
        notes=tuple(notes),
    )


def estimate_memory(model: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """Memory per GPU, per node (host) and per node (NVMe) for ZeRO stages 0-3 and their offloads.

    One row per valid configuration, fastest first (:data:`SPEED_ORDER`), each a dict with
    ``stage``, ``offload_optimizer``, ``offload_param`` (``"none"``/``"cpu"``/``"nvme"``),
    ``gpu_bytes`` (per GPU), ``cpu_bytes`` (per node), ``nvme_bytes`` (per node) and ``fits``,
    exactly as ``hf-zero estimate --json`` prints them.

    Args:
        model: a directory with ``config.json``, a ``config.json`` path, a transformers config or
            dict, or a parameter count (``7_500_000_000``, ``"7.5e9"``, ``"6.7B"``). Weights are
            never read: a config is built on the meta device.
        num_gpus: GPUs per node. num_nodes: nodes. N = num_gpus x num_nodes ranks.
        gpu_memory: memory of one GPU (``"24GB"`` = 24 GiB, binary units; bytes if a number).
        cpu_memory: host RAM of one node. nvme_memory: NVMe space of one node. ``None``: not checked.
        gpu_reserve: kept free per GPU when judging fit (default 1 GiB: CUDA context, NCCL).
        dtype: ``"bf16"``/``"fp16"`` (mixed precision: 2 + 2 + K=12 bytes) or ``"fp32"`` (4 + 4 + 8).
        lora_rank: LoRA rank; trainable parameters become the adapters on ``lora_target_modules``
            (``"all-linear"``, peft's default set: every linear layer but the LM head).
        micro_batch_size, seq_len, gradient_checkpointing, flash_attention: activation estimate.
        include_activations: ``False`` leaves the model states only, which are exactly the ZeRO
            paper's formulas: ``(2+2+K)Ψ``, ``2Ψ+2Ψ+KΨ/N``, ``2Ψ+(2+K)Ψ/N``, ``(2+2+K)Ψ/N``.
        sub_group_size: optimizer sub-group (sizes NVMe host buffers).
        hidden_size, num_layers, num_heads, vocab_size, intermediate_size, num_kv_heads: shape of
            a model given as a bare count (activations need the first three; LoRA needs
            ``intermediate_size`` too).
        trust_remote_code: allow a local model's own code when building it on the meta device.

    Returns:
        The rows (list of dicts).

    Raises:
        EstimatorError (a ``ValueError``): unreadable model, malformed size, bad option. The
        message names the value.

    Example (the ZeRO paper's 7.5B-parameter model on 64 GPUs):
        >>> rows = estimate_memory(7_500_000_000, num_gpus=8, num_nodes=8, include_activations=False)
        >>> [(r["stage"], r["gpu_bytes"]) for r in rows if r["offload_optimizer"] == "none"
        ...  and r["offload_param"] == "none"]
        [(0, 120000000000), (1, 31406250000), (2, 16640625000), (3, 1875000000)]
    """
    return estimate(model, **kwargs).as_rows()
