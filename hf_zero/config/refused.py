"""Settings hf_zero refuses: values that would change numerics (or batch semantics) in ways it does
not implement, and DeepSpeed optimizer types it does not have. Each entry says what to do instead.

A refused key whose benign value (``false``, ``enabled: false``) changes nothing is also in the
no-effect table (:mod:`hf_zero.config.no_effect`); the parser checks this table first.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Callable

__all__ = ["UNSUPPORTED", "UNSUPPORTED_OPTIMIZERS", "UNSUPPORTED_WITH_OPTIMIZER"]

def _when(text: str):
    """Attach the docs' "rejected when" text to a predicate."""

    def attach(predicate: Callable[[Any], bool]) -> Callable[[Any], bool]:
        predicate.when = text  # type: ignore[attr-defined]
        return predicate

    return attach


@_when('`"enabled": true`')
def _enabled(value: Any) -> bool:
    return isinstance(value, Mapping) and value.get("enabled") is True


@_when("`true`")
def _true(value: Any) -> bool:
    return value is True


@_when("present and not empty")
def _nonempty(value: Any) -> bool:
    return bool(value)


@_when("always")
def _always(value: Any) -> bool:
    return True


def _not(expected: Any) -> Callable[[Any], bool]:
    @_when(f"other than `{json.dumps(expected)}`")
    def check(value: Any) -> bool:
        if isinstance(expected, str) and isinstance(value, str):
            return value.lower() != expected
        return value != expected

    return check


def _gt1(field: str | None = None) -> Callable[[Any], bool]:
    @_when(f"`{field}` > 1" if field else "greater than 1")
    def check(value: Any) -> bool:
        v = value.get(field) if (field and isinstance(value, Mapping)) else value
        try:
            return v is not None and not isinstance(v, bool) and float(v) > 1
        except (TypeError, ValueError):
            return False

    return check


# Settings that would change numerics (or batch semantics) in ways hf_zero does not implement:
# dotted key -> (predicate on the value, what to do instead). Checked before NO_EFFECT_KEYS, so a
# benign value (``false``, ``enabled: false``) is merely a no-effect key.
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "amp": (_enabled, 'Apex AMP is not available; remove "amp" and use "bf16": {"enabled": true} or "fp16": {"enabled": true}'),
    "elasticity": (_enabled, "elastic batch sizing is not implemented; remove it and set train_micro_batch_size_per_gpu / gradient_accumulation_steps"),
    "progressive_layer_drop": (_enabled, "progressive layer drop is not implemented; remove it"),
    "curriculum_learning": (_enabled, "curriculum learning is not implemented; remove it (or schedule sequence length in your data collator)"),
    "data_efficiency": (_enabled, "DeepSpeed data efficiency is not implemented; remove it"),
    "quantize_training": (_enabled, "MoQ quantized training is not implemented; remove it"),
    "hybrid_engine": (_enabled, "the DeepSpeed-Chat hybrid engine is not implemented; remove it"),
    "torch_autocast": (_enabled, 'use "bf16": {"enabled": true} or "fp16": {"enabled": true} instead'),
    "compression_training": (_nonempty, "DeepSpeed Compression is not implemented; remove compression_training"),
    "weight_quantization": (_nonempty, "quantized weights are not implemented; remove weight_quantization"),
    "tensor_parallel": (_gt1("autotp_size"), "hf_zero is data parallel only; remove tensor_parallel (or set autotp_size to 1)"),
    "sequence_parallel_size": (_gt1(), "hf_zero is data parallel only; set sequence_parallel_size to 1"),
    "bf16.bf16_master_weights_and_grads": (_true, "hf_zero keeps fp32 master weights and gradients (updates below a bf16 ulp would be lost); set it to false or remove it"),
    "bf16.bf16_optimizer_states": (_true, "hf_zero keeps optimizer states in fp32; set it to false or remove it"),
    "expert_parallel": (_enabled, "hf_zero is data parallel only (MoE experts shard like other parameters); remove expert_parallel"),
    "gradient_allreduce_op": (_not("mean"), 'hf_zero averages gradients over ranks; set "gradient_allreduce_op": "mean" or remove it (for a sum, scale the loss)'),
    "managed_gradient_accumulation": (_not(True), "hf_zero's step() updates at accumulation boundaries; remove it and call engine.set_gradient_accumulation_boundary(True) before step() to update every call"),
    "zero_optimization.zenflow": (_nonempty, "ZenFlow updates with delayed gradients, which hf_zero does not implement; remove zenflow"),
    "fp16.fp16_master_weights_and_grads": (_true, "hf_zero keeps fp32 master weights; set it to false or remove it"),
    "optimizer.params.max_grad_norm": (_always, 'gradient clipping is a top-level setting: use "gradient_clipping" instead (DeepSpeed rejects it here too)'),
    "optimizer.params.eps_inside_sqrt": (_true, "the Lamb eps-inside-sqrt variant is not implemented; remove it"),
    "optimizer.params.per_head_muon": (_true, "per-head Newton-Schulz (DeepSpeed's opt-in for attention projections) is not implemented; remove per_head_muon to orthogonalize each matrix whole (DeepSpeed's default)"),
    "zero_optimization.zero_quantized_weights": (_true, "ZeRO++ quantized weights change numerics and are not implemented; set it to false"),
    "zero_optimization.zero_quantized_nontrainable_weights": (_true, "quantized frozen weights are not implemented; set it to false (for QLoRA load the model with bitsandbytes instead)"),
    "zero_optimization.zero_quantized_gradients": (_true, "ZeRO++ quantized gradients change numerics and are not implemented; set it to false"),
}


# DeepSpeed optimizer names hf_zero knows but does not implement (deepspeed/runtime/config.py
# DEEPSPEED_OPTIMIZERS): compressed-communication or MuP variants would change the update rule.
UNSUPPORTED_OPTIMIZERS = {
    "onebitadam": "1-bit Adam compresses the update",
    "zerooneadam": "0/1 Adam compresses the update",
    "onebitlamb": "1-bit Lamb compresses the update",
    "adagrad": "Adagrad is not implemented",
    "muadam": "MuP optimizers are not implemented",
    "muadamw": "MuP optimizers are not implemented",
    "musgd": "MuP optimizers are not implemented",
}


# Settings refused only together with one optimizer type: type -> {dotted key -> (predicate on the
# parsed value, what to do instead)}. DeepSpeed 0.19 runs Muon with offload_optimizer (it gathers
# each matrix's gradient from the host partitions); hf_zero's offloaded optimizer steps flat host
# chunks of each rank's shard, where Muon has no matrix to orthogonalize.
UNSUPPORTED_WITH_OPTIMIZER: dict[str, dict[str, tuple[Callable[[Any], bool], str]]] = {
    "muon": {
        "zero_optimization.offload_optimizer.device": (
            _not("none"),
            'hf_zero\'s offloaded optimizer steps flat chunks of each shard, and Muon needs whole matrices; set '
            'offload_optimizer.device to "none" (at stage 3, offload_param with device "cpu" still keeps the '
            'parameters in host memory), or use AdamW with offload',
        ),
    },
}
