"""Memory per GPU, per node (host RAM) and per node (NVMe) for every ZeRO stage and offload choice:
:func:`estimate` adds up the terms of :mod:`hf_zero.estimator.terms` for every configuration of
:data:`~hf_zero.estimator.choices.SPEED_ORDER` and judges what fits.

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
or NVMe (see :func:`~hf_zero.estimator.terms.model_state_bytes`), LoRA shrinks the gradient and optimizer terms to the
trainable parameters, and, unless switched off, a working-memory term (activations, gathered
parameters, unsharded gradients) and hf_zero's own layout terms (fp32 replicas at stages 0/1,
fp32 gradient reduction; :func:`~hf_zero.estimator.terms.implementation_terms`) are added per GPU. ``docs/estimator.md``
lists every assumption.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# The constants, choices and formulas lived here before they had modules of their own: importing
# any of them from hf_zero.estimator.memory keeps working (is_valid_choice and the star import are
# here for that only).
from hf_zero.estimator.choices import PRECISIONS, SPEED_ORDER, Precision, ZeroChoice, is_valid_choice  # noqa: F401
from hf_zero.estimator.constants import *  # noqa: F403
from hf_zero.estimator.constants import (
    DEFAULT_GPU_RESERVE_BYTES,
    DEFAULT_MICRO_BATCH_SIZE,
    DEFAULT_SEQ_LEN,
    DEFAULT_SUB_GROUP_SIZE,
)
from hf_zero.estimator.errors import EstimatorError
from hf_zero.estimator.model_spec import ALL_LINEAR, ModelSpec, load_model_spec, lora_param_count, lora_target_layers
from hf_zero.estimator.terms import (
    ActivationEstimate,
    Breakdown,
    activation_bytes,
    implementation_terms,
    model_state_bytes,
    shard_elements,
    working_buffer_bytes,
)
from hf_zero.estimator.units import parse_memory_size

__all__ = ["Estimate", "Row", "estimate", "estimate_memory"]


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

    if shard_elements(trainable, ranks) <= sub_group_size:
        # DeepSpeed's swapper steps one sub-group at a time through OPTIMIZER_NVME_BUFFER_COUNT fp32
        # buffers; when the whole shard is one sub-group those buffers are as large as CPU offload.
        notes.append(
            "NVMe optimizer offload: the host buffers hold a whole optimizer shard because sub_group_size "
            f"({sub_group_size:,}) >= the shard ({shard_elements(trainable, ranks):,}); a smaller sub_group_size "
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
