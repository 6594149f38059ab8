"""The no-effect table: DeepSpeed keys hf_zero accepts without acting on them, each with the reason.

A key listed here is accepted (any value, unless :data:`hf_zero.config.refused.UNSUPPORTED`
rejects the value); a section key (``flops_profiler``) accepts the whole sub-tree. Keys the user
actually set end up in ``ZeroConfig.no_effect_keys`` and are reported once at start-up
(:func:`describe_no_effect`). ``docs/config_reference.md`` lists every key here (a test checks).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hf_zero.config.schema import ZeroConfig

__all__ = ["NO_EFFECT_KEYS", "STAGE_NO_EFFECT", "describe_no_effect", "stage_no_effect_keys"]

NO_EFFECT_KEYS: dict[str, str] = {
    # top level
    "steps_per_print": "progress is logged by the Trainer (--logging_steps)",
    "wall_clock_breakdown": "hf_zero has no DeepSpeed timers; use the Trainer's logs or torch.profiler",
    "memory_breakdown": "hf_zero has no DeepSpeed memory logger; use memory_summary() from torch's cuda module",
    "dump_state": "hf_zero has no DeepSpeed state dump",
    "zero_allow_untested_optimizer": "hf_zero accepts any torch optimizer the Trainer builds",
    "zero_force_ds_cpu_optimizer": "there is no DeepSpeed CPU Adam; offloaded steps run torch optimizers on CPU",
    "flops_profiler": "hf_zero has no DeepSpeed flops profiler; use torch.profiler",
    "comms_logger": "hf_zero has no DeepSpeed comms logger; use TORCH_DISTRIBUTED_DEBUG=DETAIL or torch.profiler",
    "autotuning": "hf_zero has no DeepSpeed autotuner",
    "elasticity": "disabled elasticity changes nothing (enabled elasticity is rejected)",
    "amp": "disabled Apex AMP changes nothing (enabled AMP is rejected)",
    "data_types": "the gradient accumulation dtype follows hf_zero's precision policy",
    "fp32_allreduce": "gradients are reduced in fp32 unless communication_data_type says otherwise",
    "disable_allgather": "parameters are always all-gathered by torch's FSDP2",
    "sparse_gradients": "gradients are reduced as dense tensors",
    "vocabulary_size": "DeepSpeed only uses it for a tensor-core alignment warning",
    "dataloader_drop_last": "the Trainer's --dataloader_drop_last controls this",
    "nebula": "no Nebula service; checkpoints use torch.distributed.checkpoint",
    "eigenvalue": "only used by DeepSpeed's MoQ quantizer",
    "progressive_layer_drop": "disabled PLD changes nothing (enabled PLD is rejected)",
    "curriculum_learning": "disabled curriculum learning changes nothing (enabled is rejected)",
    "data_efficiency": "disabled data efficiency changes nothing (enabled is rejected)",
    "quantize_training": "disabled MoQ changes nothing (enabled is rejected)",
    "hybrid_engine": "disabled hybrid engine changes nothing (enabled is rejected)",
    "compression_training": "an empty section changes nothing (compression settings are rejected)",
    "weight_quantization": "an empty section changes nothing (quantized weights are rejected)",
    "sparse_attention": "only applies to models built from DeepSpeed's SparseSelfAttention modules",
    "pipeline": "hf_zero is data parallel only; pipeline settings apply to DeepSpeed's PipelineModule",
    "tensor_parallel": "tensor parallel size 1 changes nothing (autotp_size > 1 is rejected)",
    "sequence_parallel_size": "size 1 changes nothing (sequence parallelism is rejected)",
    "seq_parallel_communication_data_type": "hf_zero has no sequence parallelism",
    "compile": "use the Trainer's --torch_compile",
    "torch_autocast": "disabled torch_autocast changes nothing (use bf16/fp16 sections to enable mixed precision)",
    "timers": "hf_zero has no DeepSpeed throughput timers",
    "comet": "use the Trainer's --report_to comet_ml",
    "tensorboard": "use the Trainer's --report_to tensorboard",
    "wandb": "use the Trainer's --report_to wandb",
    "csv_monitor": "use the Trainer's --report_to (CSV logs are not written by hf_zero)",
    "activation_checkpointing": "use the Trainer's --gradient_checkpointing",
    "log_level": "hf_zero logs through the Python logger \"hf_zero\"; set its level with logging.getLogger(\"hf_zero\").setLevel(...)",
    "disable_python_gc": "hf_zero leaves Python's garbage collector alone",
    "datastates_ckpt": "checkpoints are written with torch.distributed.checkpoint (no DataStates engine)",
    "expert_parallel": "disabled expert parallelism changes nothing (enabled is rejected)",
    "use_data_before_expert_parallelism": "hf_zero has no expert parallelism (MoE experts shard like any parameter)",
    "gradient_allreduce_op": '"mean" is what hf_zero does (gradients are averaged over ranks); "sum" is rejected',
    "managed_gradient_accumulation": "true is what hf_zero does (step() updates at accumulation boundaries); false is rejected",
    # checkpoint
    "checkpoint.checkpoint_serialization": "checkpoints are written with torch.distributed.checkpoint",
    "checkpoint.writer": "checkpoints are written with torch.distributed.checkpoint (no DeepSpeed fast writer)",
    "checkpoint.tag_validation": "sharded checkpoints carry no DeepSpeed tag to validate",
    "checkpoint.load_universal": "hf_zero checkpoints always reshard on load (any world size)",
    "checkpoint.parallel_write": "applies to DeepSpeed's pipeline-parallel checkpoint writer",
    # precision
    "fp16.auto_cast": "floating-point inputs are always cast to the compute dtype",
    "fp16.fp16_master_weights_and_grads": "false changes nothing (true is rejected: master weights stay fp32)",
    "bf16.immediate_grad_update": "DeepSpeed bf16-optimizer detail; gradients are applied at the optimizer step",
    "bf16.check_grad_overflow": "bf16 needs no overflow check (no loss scaling)",
    "bf16.loss_scale": "bf16 uses no loss scaling",
    "bf16.loss_scale_window": "bf16 uses no loss scaling",
    "bf16.initial_scale_power": "bf16 uses no loss scaling",
    "bf16.hysteresis": "bf16 uses no loss scaling",
    "bf16.consecutive_hysteresis": "bf16 uses no loss scaling",
    "bf16.min_loss_scale": "bf16 uses no loss scaling",
    "bf16.auto_cast": "floating-point inputs are always cast to the compute dtype",
    "bf16.bf16_master_weights_and_grads": "false changes nothing (true is rejected: master weights and gradients stay fp32)",
    "bf16.bf16_optimizer_states": "false changes nothing (true is rejected: optimizer states stay fp32)",
    # optimizer / scheduler
    "optimizer.legacy_fusion": "DeepSpeed fp16-optimizer detail",
    "optimizer.params.torch_adam": "hf_zero always uses torch's Adam/AdamW",
    "optimizer.params.set_grad_none": "gradients are always set to None by zero_grad",
    "optimizer.params.eps_inside_sqrt": "false changes nothing (true is rejected)",
    "optimizer.params.per_head_muon": "false changes nothing (true is rejected)",
    "scheduler.params.last_batch_iteration": "resuming restores the scheduler state from the checkpoint",
    # aio (NVMe)
    "aio.use_gds": "no GPUDirect Storage; NVMe swaps go through pinned host memory",
    # zero_optimization: knobs DeepSpeed's bucketing and fetching read that FSDP2 and DDP have no
    # setting for. hf_zero parses them (they are checked, "auto" is filled) and reports them. The
    # prefetch, persistence and live-parameter knobs are FSDP2 settings (engine/fsdp_knobs.py).
    "zero_optimization.overlap_comm": "gradient reduction always overlaps the backward (DDP buckets; FSDP2 reduce-scatters each block on its own stream); there is nothing to switch",
    "zero_optimization.allgather_bucket_size": "FSDP2 all-gathers each unit (a transformer block, or the root) in one collective; it has no bucket size",
    "zero_optimization.stage3_max_reuse_distance": "FSDP2 decides per block, when the model is sharded, whether a block is freed after its forward; DeepSpeed's rule (keep a parameter whose next use is within this many elements) would, with its 1e9 default, keep every block of a model under ~0.5B parameters gathered, i.e. turn stage 3 into stage 2. Stage 3 frees every block; stage3_param_persistence_threshold keeps small blocks gathered",
    "zero_optimization.compute_grad_norm": "the global gradient norm is always computed (the Trainer logs it)",
    "zero_optimization.stage3_allgather_sequential": "FSDP2 issues one all-gather per block",
    "zero_optimization.allgather_sequential": "FSDP2 issues one all-gather per block",
    "zero_optimization.enable_sanity_checks": "DeepSpeed stage-3 debugging checks; FSDP2 has its own",
    "zero_optimization.leaf_module": "FSDP2 units are transformer blocks (_no_split_modules); MoE blocks are gathered whole",
    "zero_optimization.parameter_alignment": "FSDP2 pads shards itself",
    "zero_optimization.save_muon_momentum_buffer_in_memory": "Muon's momentum always stays in memory, sharded with the parameters (hf_zero does not offload a Muon optimizer, so there is no NVMe swap to keep it out of)",
    "zero_optimization.zenflow": "an empty section changes nothing (ZenFlow settings are rejected)",
    "zero_optimization.offload_optimizer.super_offload": "the offloaded step runs hf_zero's CPU optimizer (no Superchip-specific path)",
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": "the CPU step uses torch's threads; set OMP_NUM_THREADS to choose the cores",
    "zero_optimization.contiguous_gradients": "FSDP2 always reduces into contiguous buffers",
    "zero_optimization.reduce_scatter": "stages 2/3 always reduce-scatter gradients",
    "zero_optimization.allgather_partitions": "stages 2/3 always all-gather parameters",
    "zero_optimization.round_robin_gradients": "DeepSpeed stage 1/2 CPU-offload copy detail",
    "zero_optimization.load_from_fp32_weights": "fp32 master weights are always restored from checkpoints",
    "zero_optimization.elastic_checkpoint": "checkpoints always reshard on load",
    "zero_optimization.ignore_unused_parameters": "unused parameters are always tolerated",
    "zero_optimization.legacy_stage1": "there is one stage-1 implementation",
    "zero_optimization.zero_quantized_weights": "false changes nothing (true is rejected)",
    "zero_optimization.zero_quantized_nontrainable_weights": "false changes nothing (true is rejected)",
    "zero_optimization.zero_quantized_gradients": "false changes nothing (true is rejected)",
    "zero_optimization.zeropp_loco_param": "only used with ZeRO++ quantized gradients",
    "zero_optimization.mics_hierarchical_params_gather": (
        "FSDP2 all-gathers over the whole shard group in one collective; a mics_shard_size of the ranks of "
        "one node keeps that collective inside the node"),
    "zero_optimization.memory_efficient_linear": "DeepSpeed stage-3 linear-layer patch; FSDP2 needs none",
    "zero_optimization.pipeline_loading_checkpoint": "DeepSpeed pipeline-parallel loading detail",
    "zero_optimization.override_module_apply": "DeepSpeed stage-3 nn.Module.apply patch; FSDP2 needs none",
    "zero_optimization.use_multi_rank_bucket_allreduce": "DeepSpeed stage 1/2 bucketing detail",
    "zero_optimization.stage3_model_persistence_threshold": "persistence is decided per parameter (param_persistence_threshold)",
    "zero_optimization.model_persistence_threshold": "persistence is decided per parameter (param_persistence_threshold)",
    "zero_optimization.stage3_module_granularity_threshold": "FSDP2 units are transformer blocks (_no_split_modules)",
    "zero_optimization.module_granularity_threshold": "FSDP2 units are transformer blocks (_no_split_modules)",
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": "parameters are fetched with FSDP2's all-gather",
    "zero_optimization.use_all_reduce_for_fetch_params": "parameters are fetched with FSDP2's all-gather",
    "zero_optimization.log_trace_cache_warnings": "hf_zero has no DeepSpeed stage-3 trace cache",
    "zero_optimization.offload_optimizer.fast_init": "DeepSpeed NVMe init detail",
    "zero_optimization.offload_param.buffer_size": "NVMe parameter swaps move whole FSDP units; buffer_count sets the read-ahead depth",
    "zero_optimization.offload_optimizer.pipeline_read": "the NVMe swapper always reads ahead",
    "zero_optimization.offload_optimizer.pipeline_write": "the NVMe swapper always writes behind",
    "zero_optimization.offload_optimizer.pipeline": "the NVMe swapper always reads ahead and writes behind",
}


_ALWAYS = object()

STAGE_NO_EFFECT: dict[str, tuple[str, frozenset[int], str, object]] = {
    # DeepSpeed key: (field path in ZeroConfig.explicit_keys, stages where it changes nothing, why,
    # a value not worth reporting there because it asks for what happens anyway). Elsewhere the key
    # is an FSDP2 setting (engine/fsdp_knobs.py; docs/config_reference.md).
    "zero_optimization.stage3_prefetch_bucket_size": (
        "zero_optimization.prefetch_bucket_size", frozenset({0, 1, 2}),
        "only stage 3 gathers parameters per block (as in DeepSpeed, stage3_* keys apply at stage 3)", _ALWAYS),
    "zero_optimization.stage3_param_persistence_threshold": (
        "zero_optimization.param_persistence_threshold", frozenset({0, 1, 2}),
        "only stage 3 frees blocks after their forward (as in DeepSpeed, stage3_* keys apply at stage 3)", _ALWAYS),
    "zero_optimization.stage3_max_live_parameters": (
        "zero_optimization.max_live_parameters", frozenset({0, 1, 2}),
        "only stage 3 gathers parameters per block (as in DeepSpeed, stage3_* keys apply at stage 3)", _ALWAYS),
    "zero_optimization.mics_shard_size": (
        "zero_optimization.mics_shard_size", frozenset({0, 1}),
        "stages 0/1 replicate the parameters on every rank; shard groups apply at stages 2 and 3", -1),
    "zero_optimization.zero_hpz_partition_size": (
        "zero_optimization.hpz_partition_size", frozenset({0, 1, 2}),
        "only stage 3 reshards parameters after the forward (as in DeepSpeed, hpZ is a stage-3 feature)", 1),
    "prescale_gradients": (
        "prescale_gradients", frozenset({0, 1}),
        "at stages 0/1 DDP divides every gradient bucket by the world size before its all-reduce (what "
        "prescale_gradients=true asks for) and takes no other factor; stages 2/3 apply it", False),
    "gradient_predivide_factor": (
        "gradient_predivide_factor", frozenset({0, 1}),
        "at stages 0/1 DDP divides every gradient bucket by the world size before its all-reduce and takes "
        "no other factor; stages 2/3 apply it", 1.0),
}
"""Keys that act at some ZeRO stages only; set at another stage they are reported like the table
above (:func:`stage_no_effect_keys`)."""


def stage_no_effect_keys(stage: int, explicit: Mapping[str, Any]) -> list[str]:
    """The keys of :data:`STAGE_NO_EFFECT` that the config sets (``explicit``: field path ->
    value) and that change nothing at ``stage``."""
    out = []
    for key, (path, stages, _, quiet) in STAGE_NO_EFFECT.items():
        if stage in stages and path in explicit and (quiet is _ALWAYS or explicit[path] != quiet):
            out.append(key)
    return out


def describe_no_effect(cfg: ZeroConfig) -> list[str]:
    """One line per accepted key that changes nothing in hf_zero, for the engine to log once.

    Args:
        cfg: A parsed config.

    Returns:
        Lines such as ``"zero_optimization.round_robin_gradients: no effect in hf_zero (DeepSpeed
        stage 1/2 CPU-offload copy detail)"``, in the order the keys appeared.
    """
    def why(key: str) -> str:
        if key in NO_EFFECT_KEYS:
            return NO_EFFECT_KEYS[key]
        if key in STAGE_NO_EFFECT:
            return f"at stage {cfg.stage}: {STAGE_NO_EFFECT[key][2]}"
        return "accepted for compatibility"

    return [f"{key}: no effect in hf_zero ({why(key)})" for key in cfg.no_effect_keys]
