"""Frozen dataclasses for a DeepSpeed-style config: the only config type hf_zero's engine reads.

The JSON/YAML/dict a user writes is parsed once (``config/parse.py``), its ``"auto"`` values are
resolved (``config/auto.py``), and the result is a tree of these frozen objects. Field names follow
DeepSpeed's keys except where DeepSpeed's name carries history (``stage3_*`` keys drop the prefix
here; the parser maps the DeepSpeed names, old aliases included).

A field may still hold :data:`AUTO` (the string ``"auto"``) after parsing when no TrainingArguments
or model were given to resolve it; ``ZeroConfig.unresolved()`` lists those keys and the engine
refuses to start while any remain.

Defaults follow DeepSpeed's *code* (``deepspeed/runtime/...``), not its docs, where the two differ;
``docs/config_reference.md`` lists each such choice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Union

AUTO = "auto"
"""Marker left in a field whose ``"auto"`` value has not been resolved yet."""

Auto = Literal["auto"]
OffloadDevice = Literal["none", "cpu", "nvme"]

_frozen = dict(frozen=True, kw_only=True, slots=True)


@dataclass(**_frozen)
class OffloadOptimizerConfig:
    """``zero_optimization.offload_optimizer``: where fp32 master weights and optimizer state live."""

    device: OffloadDevice = "none"
    """``none`` (accelerator), ``cpu`` (host memory) or ``nvme`` (files under ``nvme_path``)."""
    nvme_path: str | None = None
    """Folder on a fast disk for swap files; required when ``device`` is ``nvme``."""
    pin_memory: bool = False
    """Page-lock the host buffers (only has an effect when a GPU is present)."""
    buffer_count: int = 4
    """Number of host buffers in the NVMe swap pool."""
    fast_init: bool = False
    """Accepted for compatibility; no effect (see the no-effect table)."""
    ratio: float = 1.0
    """Fraction of the optimizer state offloaded (0 < ratio <= 1; partial offload at stage 3)."""


@dataclass(**_frozen)
class OffloadParamConfig:
    """``zero_optimization.offload_param``: where sharded 16-bit parameters live between uses (stage 3)."""

    device: OffloadDevice = "none"
    """``none``, ``cpu`` or ``nvme``."""
    nvme_path: str | None = None
    """Folder on a fast disk for swap files; required when ``device`` is ``nvme``."""
    pin_memory: bool = False
    """Page-lock the host copies (only has an effect when a GPU is present)."""
    buffer_count: int = 5
    """Number of host buffers for parameter swapping."""
    buffer_size: int = 100_000_000
    """Elements per parameter swap buffer."""
    max_in_cpu: int = 1_000_000_000
    """Parameter elements kept in host memory when ``device`` is ``nvme``."""


@dataclass(**_frozen)
class ZeroOptimizationConfig:
    """``zero_optimization``: the ZeRO stage and its tuning knobs."""

    stage: int = 0
    """0 = DDP, 1 = sharded optimizer state, 2 = + sharded gradients, 3 = + sharded parameters."""
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    overlap_comm: bool = False
    """Overlap gradient reduction with backward. DeepSpeed's code defaults it to true at stage 3
    and false below (its docs say false); the parser applies that rule when the key is absent."""
    contiguous_gradients: bool = True
    """Accepted; FSDP2 always reduces into contiguous buffers."""
    reduce_scatter: bool = True
    """Accepted; stages 2/3 always reduce-scatter gradients."""
    reduce_bucket_size: int | Auto = 500_000_000
    """Elements per gradient-reduction bucket (``auto`` = hidden_size**2)."""
    allgather_partitions: bool = True
    """Accepted; stages 2/3 always all-gather parameters."""
    allgather_bucket_size: int = 500_000_000
    """Elements per parameter all-gather bucket."""
    round_robin_gradients: bool = False
    """Accepted for compatibility; no effect."""
    sub_group_size: int = 1_000_000_000
    """Parameter elements stepped at a time by an offloaded optimizer."""
    prefetch_bucket_size: int | Auto = 50_000_000
    """``stage3_prefetch_bucket_size`` (``auto`` = 0.9 * hidden_size**2). DeepSpeed's code default
    is 5e7 (its docs say 5e8)."""
    param_persistence_threshold: int | Auto = 100_000
    """``stage3_param_persistence_threshold`` (``auto`` = 10 * hidden_size): parameters with fewer
    elements stay unsharded."""
    max_live_parameters: int = 1_000_000_000
    """``stage3_max_live_parameters``."""
    max_reuse_distance: int = 1_000_000_000
    """``stage3_max_reuse_distance``."""
    mics_shard_size: int = -1
    """MiCS: shard parameters, gradients and optimizer state inside groups of this many ranks and
    replicate across the groups (FSDP2 over a 2-D replicate x shard mesh); -1 (or 0): over all ranks."""
    hpz_partition_size: int = 1
    """``zero_hpz_partition_size`` (ZeRO++ hpZ): after the forward, keep the parameters sharded over
    groups of this many ranks (FSDP2 ``reshard_after_forward=N``), so the backward's all-gathers
    stay inside a group, usually a node; 1: off. Stage 3."""
    gather_16bit_weights_on_model_save: bool | Auto = True
    """``stage3_gather_16bit_weights_on_model_save`` (old name ``stage3_gather_fp16_weights_on_model_save``).
    hf_zero defaults it to true (DeepSpeed: false) because an empty ZeRO-3 save is the common pain.
    ``"auto"`` (accelerate's ZeRO-3 templates) = ``ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL`` when
    ``accelerate launch`` set it, else true."""


@dataclass(**_frozen)
class FP16Config:
    """``fp16``: half precision with a loss scaler."""

    enabled: bool | Auto = False
    auto_cast: bool = False
    """Cast forward inputs to fp16 (accepted; hf_zero always casts floating inputs at stages 2/3)."""
    loss_scale: float = 0.0
    """0 = dynamic loss scaling; > 0 = this static scale."""
    initial_scale_power: int = 16
    """Dynamic scaler starts at 2**initial_scale_power (DeepSpeed's engine default is 16)."""
    loss_scale_window: int = 1000
    """Steps without overflow before the scale doubles."""
    hysteresis: int = 2
    """Overflows tolerated before the scale backs off."""
    consecutive_hysteresis: bool = False
    """Refill hysteresis on every non-overflow step (instead of only when the scale grows)."""
    min_loss_scale: float = 1.0
    """The scale never drops below this."""


@dataclass(**_frozen)
class BF16Config:
    """``bf16``: bfloat16 compute, fp32 master weights, no loss scaling."""

    enabled: bool | Auto = False


@dataclass(**_frozen)
class OptimizerConfig:
    """``optimizer``: a DeepSpeed optimizer section. ``type`` is canonical lower case
    (``adam``, ``adamw``, ``sgd``, ``lion``, ``lamb``, ``muon``). For ``muon`` the parser fills
    absent keys with DeepSpeed's Muon defaults (``config/fields.py`` ``MUON_DEFAULTS``)."""

    type: str
    lr: float | Auto = 1e-3
    betas: tuple[float, float] | Auto = (0.9, 0.999)
    eps: float | Auto = 1e-8
    weight_decay: float | Auto = 0.0
    adam_w_mode: bool = True
    """For ``type: Adam``: true (DeepSpeed's default) means decoupled weight decay, i.e. AdamW."""
    torch_adam: bool = False
    """Accepted; hf_zero always uses torch's Adam/AdamW."""
    amsgrad: bool = False
    bias_correction: bool = True
    momentum: float = 0.0
    """SGD momentum; Muon's momentum (beta, DeepSpeed's default 0.95)."""
    dampening: float = 0.0
    nesterov: bool = False
    max_coeff: float = 10.0
    """Lamb: upper bound of the trust ratio."""
    min_coeff: float = 0.01
    """Lamb: lower bound of the trust ratio."""
    muon_lr: float | None = None
    """Muon: learning rate of the matrices (the Muon half); None = ``lr``."""
    adam_lr: float | None = None
    """Muon: learning rate of the other parameters (the Adam half); None = ``lr``."""
    ns_method: Literal["gram", "standard"] = "gram"
    """Muon: Newton-Schulz on the Gram matrix (DeepSpeed's default) or the plain iteration."""


@dataclass(**_frozen)
class WarmupLRParams:
    warmup_min_lr: float | Auto = 0.0
    warmup_max_lr: float | Auto = 0.001
    warmup_num_steps: int | Auto = 1000
    warmup_type: Literal["log", "linear"] = "log"


@dataclass(**_frozen)
class WarmupDecayLRParams(WarmupLRParams):
    total_num_steps: int | Auto = AUTO


@dataclass(**_frozen)
class WarmupCosineLRParams:
    total_num_steps: int | Auto = AUTO
    warmup_min_ratio: float = 0.0
    warmup_num_steps: int | Auto = 1000
    cos_min_ratio: float = 0.0001
    warmup_type: Literal["log", "linear"] = "log"


@dataclass(**_frozen)
class OneCycleParams:
    cycle_min_lr: float = 0.0
    cycle_max_lr: float = 0.0
    decay_lr_rate: float = 0.0
    cycle_first_step_size: int = 2000
    cycle_second_step_size: int | None = None
    cycle_first_stair_count: int = 0
    cycle_second_stair_count: int | None = None
    decay_step_size: int = 0
    cycle_momentum: bool = True
    cycle_min_mom: float = 0.8
    cycle_max_mom: float = 0.9
    decay_mom_rate: float = 0.0


@dataclass(**_frozen)
class LRRangeTestParams:
    lr_range_test_min_lr: float = 0.001
    lr_range_test_step_size: int = 2000
    lr_range_test_step_rate: float = 1.0
    lr_range_test_staircase: bool = False


SchedulerParams = Union[
    WarmupLRParams, WarmupDecayLRParams, WarmupCosineLRParams, OneCycleParams, LRRangeTestParams
]


@dataclass(**_frozen)
class SchedulerConfig:
    """``scheduler``: ``type`` is DeepSpeed's class name (``WarmupLR``, ``WarmupDecayLR``,
    ``WarmupCosineLR``, ``OneCycle``, ``LRRangeTest``); ``params`` the matching dataclass."""

    type: str
    params: SchedulerParams


@dataclass(**_frozen)
class AioConfig:
    """``aio``: asynchronous I/O settings for NVMe offload (honoured by the pure-Python swapper
    as far as it can: block size and thread count; the rest is accepted)."""

    block_size: int = 1_048_576
    queue_depth: int = 8
    thread_count: int = 1
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False


@dataclass(**_frozen)
class ActivationCheckpointingConfig:
    """``activation_checkpointing``: accepted; use ``--gradient_checkpointing`` in the Trainer."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


@dataclass(**_frozen)
class MonitorConfig:
    """``tensorboard`` / ``wandb`` / ``csv_monitor``: accepted; the Trainer's ``report_to`` logs."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"
    team: str | None = None
    group: str | None = None
    project: str = "deepspeed"


@dataclass(**_frozen)
class CheckpointConfig:
    """``checkpoint``: accepted; hf_zero's sharded checkpoints always reshard on load."""

    tag_validation: str = "Warn"
    load_universal: bool = False
    use_node_local_storage: bool = False
    parallel_write: dict[str, Any] | None = None


@dataclass(**_frozen)
class ZeroConfig:
    """A whole resolved (or partly resolved) hf_zero / DeepSpeed config.

    Build it with :func:`hf_zero.load_config`, never by hand from a dict.

    Example::

        >>> cfg = load_config({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}})
        >>> cfg.zero_optimization.stage, cfg.compute_dtype_name
        (2, 'bf16')
    """

    train_batch_size: int | Auto | None = None
    train_micro_batch_size_per_gpu: int | Auto | None = None
    gradient_accumulation_steps: int | Auto = 1
    """Micro-batches per optimizer step. When absent from the file, ``resolve_auto`` takes it from
    TrainingArguments or derives it from train_batch_size (DeepSpeed's rule); 1 otherwise."""
    gradient_clipping: float | Auto = 0.0
    """Max global gradient norm; 0 disables clipping (DeepSpeed's code default; its docs say 1.0)."""
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    """dtype gradients are reduced in. None = fp32 (see docs/config_reference.md)."""
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_optimization: ZeroOptimizationConfig = field(default_factory=ZeroOptimizationConfig)
    aio: AioConfig = field(default_factory=AioConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig
    )
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tensorboard: MonitorConfig = field(default_factory=MonitorConfig)
    wandb: MonitorConfig = field(default_factory=MonitorConfig)
    csv_monitor: MonitorConfig = field(default_factory=MonitorConfig)
    source: str = "<dict>"
    """Where the config came from (file path, ``<dict>`` or ``<json string>``), for messages."""
    no_effect_keys: tuple[str, ...] = ()
    """Dotted keys the user set that hf_zero accepts but that change nothing (reported once)."""
    explicit_keys: tuple[str, ...] = ()
    """Dotted field paths (``optimizer.lr``, ``zero_optimization.prefetch_bucket_size``) the user
    wrote, after alias mapping. ``resolve_auto`` compares only these with TrainingArguments and
    derives absent batch sizes the way DeepSpeed does; a field not listed holds its default."""

    @property
    def stage(self) -> int:
        return self.zero_optimization.stage

    @property
    def compute_dtype_name(self) -> str:
        """``fp16``, ``bf16`` or ``fp32``."""
        if self.fp16.enabled is True:
            return "fp16"
        if self.bf16.enabled is True:
            return "bf16"
        return "fp32"

    def unresolved(self) -> list[str]:
        """Dotted keys still holding ``"auto"``."""
        found: list[str] = []

        def walk(obj: Any, prefix: str) -> None:
            for f in dataclasses.fields(obj):
                value = getattr(obj, f.name)
                key = f"{prefix}{f.name}"
                if value == AUTO and isinstance(value, str):
                    found.append(key)
                elif dataclasses.is_dataclass(value):
                    walk(value, key + ".")

        walk(self, "")
        return found
