"""Turn an :class:`~hf_zero.estimator.memory.Estimate` into text: the table, the ready config, the verdict."""

from __future__ import annotations

import json
from typing import Any

from hf_zero.config.auto import trainer_auto_config
from hf_zero.estimator.choices import ZeroChoice
from hf_zero.estimator.constants import DEFAULT_SUB_GROUP_SIZE, PARAM_NVME_BUFFER_SIZE
from hf_zero.estimator.memory import Estimate, Row
from hf_zero.estimator.units import format_bytes, format_count

__all__ = ["DEFAULT_NVME_PATH", "nothing_fits_message", "render_report", "zero_config_for"]

DEFAULT_NVME_PATH = "/local_nvme"
"""Placeholder ``nvme_path`` in printed configs; the report tells the user to point it at a fast disk."""

# DeepSpeed's documented stage-3 defaults, as in the HF ds_config_zero3.json examples.
_STAGE3_KEYS: dict[str, Any] = {
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "stage3_gather_16bit_weights_on_model_save": True,
}


def zero_config_for(
    choice: Row | ZeroChoice,
    *,
    nvme_path: str = DEFAULT_NVME_PATH,
    sub_group_size: int = DEFAULT_SUB_GROUP_SIZE,
    largest_tensor: int | None = None,
) -> dict[str, Any]:
    """A complete ``--zero_config`` dict (DeepSpeed key names) for one configuration.

    Batch sizes, learning rate, Adam betas/eps, weight decay, clipping and bf16/fp16 are ``"auto"``,
    filled from TrainingArguments; bucket sizes are ``"auto"`` (from the model's hidden size).

    Args:
        choice: the row (or bare choice) to configure.
        nvme_path: folder on a fast local disk, used when something is offloaded to NVMe.
        sub_group_size: written for stage 3 and NVMe optimizer offload (it sizes the NVMe host
            buffers the estimate assumed).
        largest_tensor: elements of the largest parameter; raises ``offload_param.buffer_size`` so
            that tensor fits one swap buffer (DeepSpeed's 1e8 default is smaller than most LM heads).

    Example:
        >>> cfg = zero_config_for(ZeroChoice(2, "cpu"))
        >>> cfg["zero_optimization"]["stage"], cfg["zero_optimization"]["offload_optimizer"]["device"]
        (2, 'cpu')
    """
    choice = choice.choice if isinstance(choice, Row) else choice
    zero: dict[str, Any] = {"stage": choice.stage}
    if choice.stage > 0:
        zero.update(overlap_comm=True, contiguous_gradients=True, reduce_bucket_size="auto")
    if choice.offload_optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    elif choice.offload_optimizer == "nvme":
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True, "buffer_count": 4}
    if choice.offload_param == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    elif choice.offload_param == "nvme":
        zero["offload_param"] = {
            "device": "nvme",
            "nvme_path": nvme_path,
            "pin_memory": False,  # swapped shards are freed by resizing, which pinned storage refuses
            "buffer_count": 5,
            "buffer_size": max(PARAM_NVME_BUFFER_SIZE, largest_tensor or 0),
        }
    if choice.stage == 3 or choice.offload_optimizer == "nvme":
        zero["sub_group_size"] = sub_group_size  # the NVMe host buffers were sized from it
    if choice.stage == 3:
        zero.update(_STAGE3_KEYS)
    return trainer_auto_config(zero)


def _config_json(est: Estimate, row: Row, nvme_path: str) -> str:
    cfg = zero_config_for(row, nvme_path=nvme_path, sub_group_size=est.sub_group_size, largest_tensor=est.model.largest_tensor)
    return json.dumps(cfg, indent=2)


def nothing_fits_message(est: Estimate) -> str:
    """Why nothing fits and the smallest requirement, with what to change."""
    smallest = est.smallest_gpu_row
    lines = [
        "Nothing fits.",
        f"Smallest GPU requirement: {format_bytes(smallest.gpu_bytes)} per GPU with {smallest.choice.label()}"
        f" (plus {format_bytes(est.gpu_reserve)} kept free), which also needs {format_bytes(smallest.cpu_bytes)} CPU"
        f" and {format_bytes(smallest.nvme_bytes)} NVMe per node.",
    ]
    gpu_ok = [row for row in est.rows if "gpu" not in row.over]
    if gpu_ok:
        least_cpu = min(gpu_ok, key=lambda row: (row.cpu_bytes, row.speed_rank))
        lines.append(
            f"Within the GPU limit, the least host memory is {format_bytes(least_cpu.cpu_bytes)} per node"
            f" ({least_cpu.choice.label()}, also {format_bytes(least_cpu.nvme_bytes)} NVMe per node)."
        )
    hints = ["more GPUs (--num_gpus / --num_nodes)"]
    if est.activations is not None and not est.activations.gradient_checkpointing:
        hints.append("--gradient_checkpointing")
    if est.activations is not None and est.activations.store_attention_scores:
        hints.append("--flash_attention (if the model runs with SDPA/flash attention)")
    if est.activations is not None:
        hints.append("a smaller --micro_batch_size or --seq_len")
    if est.lora_rank is None:
        hints.append("LoRA (--lora-rank)")
    lines.append("To reduce it, try " + ", ".join(hints) + ".")
    return "\n".join(lines)


def render_report(est: Estimate, *, nvme_path: str = DEFAULT_NVME_PATH) -> str:
    """The human-readable report: model summary, table (fastest first), verdict, config, notes."""
    spec = est.model
    out = [f"hf-zero estimate: {spec.name}"]
    out.append(f"  model        {format_count(spec.total_params)} parameters ({spec.source})")
    if est.lora_rank is None:
        out.append(f"  training     full fine-tuning, {format_count(est.trainable_params)} trainable")
    else:
        kinds = sorted({name.rsplit('.', 1)[-1] for name in est.lora_targets})
        out.append(
            f"  training     LoRA r={est.lora_rank} on {len(est.lora_targets)} linear layers ({', '.join(kinds)}):"
            f" {format_count(est.trainable_params)} trainable; base weights frozen in 16 bits"
        )
    p = est.precision
    out.append(
        f"  precision    {p.name}: {p.param_bytes} B per parameter, {p.grad_bytes} B per gradient,"
        f" K={p.optimizer_k} B Adam state per trainable parameter"
    )
    out.append(f"  ranks        N = {est.ranks} ({est.num_gpus} GPU(s) per node x {est.num_nodes} node(s))")
    if not est.include_activations:
        out.append("  activations  off: model states only (the ZeRO paper's formulas)")
    elif est.activations is not None:
        a = est.activations
        how = ["gradient checkpointing" if a.gradient_checkpointing else "no recompute"]
        how.append("attention scores stored" if a.store_attention_scores else "flash attention")
        out.append(
            f"  activations  {format_bytes(a.total)} per GPU: layers {format_bytes(a.layers_bytes)} +"
            f" fp32 logits {format_bytes(a.logits_bytes)} (micro batch {a.micro_batch_size}, seq {a.seq_len},"
            f" {', '.join(how)})"
        )
    out.append(f"  limits       {_limits(est)}")
    out.append("")

    header = ("#", "stage", "offload_optimizer", "offload_param", "GPU (per GPU)", "CPU (per node)", "NVMe (per node)", "fits")
    table = [header]
    for row in est.rows:
        fits = "yes" if row.fits else "no: " + ", ".join(tier.upper() if tier != "nvme" else "NVMe" for tier in row.over)
        table.append(
            (
                str(row.speed_rank + 1),
                str(row.stage),
                row.offload_optimizer,
                row.offload_param,
                format_bytes(row.gpu_bytes),
                format_bytes(row.cpu_bytes),
                format_bytes(row.nvme_bytes),
                fits,
            )
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    numeric = {0, 4, 5, 6}  # right-align numbers so magnitudes line up
    for line in table:
        cells = [cell.rjust(widths[i]) if i in numeric else cell.ljust(widths[i]) for i, cell in enumerate(line)]
        out.append("  " + "  ".join(cells).rstrip())
    out.append("  (rows fastest first; GPU includes activations, transient buffers and hf_zero's layout terms unless --no_activations)")
    out.append("")

    best = est.fastest_fit
    if best is None:
        out.append(nothing_fits_message(est))
    else:
        g = best.gpu
        out.append(f"Fastest configuration that fits: #{best.speed_rank + 1} {best.choice.label()}")
        out.append(
            f"  per GPU {format_bytes(g.total)} = params {format_bytes(g.params)} + gradients {format_bytes(g.gradients)}"
            f" + optimizer {format_bytes(g.optimizer)} + activations {format_bytes(g.activations)}"
            f" + buffers {format_bytes(g.buffers)} + hf_zero layout {format_bytes(g.layout)}"
        )
        for name, value in best.layout_terms:
            out.append(f"    hf_zero layout: {name} {format_bytes(value)}")
        out.append("Save this as ds_config.json and pass --zero_config ds_config.json:")
        if "nvme" in (best.offload_optimizer, best.offload_param):
            out.append(f"(set nvme_path to a folder on a fast local NVMe disk; {nvme_path!r} is a placeholder)")
        out.append(_config_json(est, best, nvme_path))
    if est.notes:
        out.append("")
        out.append("Notes:")
        out.extend(f"  - {note}" for note in est.notes)
    return "\n".join(out)


def _limits(est: Estimate) -> str:
    gpu = "not checked" if est.gpu_memory is None else f"{format_bytes(est.gpu_memory)} (keeping {format_bytes(est.gpu_reserve)} free)"
    cpu = "not checked" if est.cpu_memory is None else f"{format_bytes(est.cpu_memory)} per node"
    nvme = "not checked" if est.nvme_memory is None else f"{format_bytes(est.nvme_memory)} per node"
    return f"GPU {gpu}; CPU {cpu}; NVMe {nvme}"
