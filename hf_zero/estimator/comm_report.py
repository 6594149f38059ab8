"""The communication plan of ``hf-zero estimate --num_nodes K --gpus_per_node G --plan``.

For each layout (stages 1-3; at stages 2/3 flat, ``mics_shard_size`` and, at stage 3,
``zero_hpz_partition_size``) it gives the bytes each GPU sends per optimizer step inside its node and
across nodes (``comm_plan.py``: exact collective sizes from the model's shapes, split by the
two-level algorithm), and a predicted step time from a **model**:

    compute = flops_per_token x tokens per GPU per step / compute rate
    flops_per_token = 6 N (full fine-tuning; 4 N with LoRA, whose frozen weights get no
                      gradient; + 2 N with gradient checkpointing), N = all parameters
    comm    = intra bytes / intra-node bandwidth + inter bytes / inter-node bandwidth
    step    = max(compute, comm)   (FSDP2 prefetches the next unit's all-gather during this one's
                                    compute; latency, stragglers and PCIe are not modelled)

A layout is compute-bound when comm <= compute. The recommendation is the compute-bound stage-3
layout with the smallest model states per GPU; when none is, the fastest, with the tokens per GPU
per step that would make it compute-bound.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from hf_zero.estimator.comm_plan import (
    Sent,
    UnitShapes,
    bytes_sent,
    group_ranks,
    group_shape,
    step_collectives,
)
from hf_zero.estimator.errors import EstimatorError
from hf_zero.estimator.model_spec import ModelSpec, lora_target_layers
from hf_zero.estimator.units import format_bytes

__all__ = ["DEFAULT_COMPUTE_TFLOPS", "DEFAULT_INTER_NODE_GBPS", "DEFAULT_INTRA_NODE_GBPS", "NODE_SWEEP", "Layout",
           "Links", "PlanRow", "Workload", "plan_layouts", "plan_row", "plan_units", "recommend", "render_plan",
           "sweep", "workload"]

DEFAULT_INTRA_NODE_GBPS = 450.0
"""GB/s one GPU sends to the others of its node: H100 SXM's NVLink 4 through NVSwitch (18 links x 25 GB/s
per direction)."""
DEFAULT_INTER_NODE_GBPS = 50.0
"""GB/s one GPU sends to other nodes: one 400 Gb/s InfiniBand NDR (or RoCE) NIC per GPU."""
DEFAULT_COMPUTE_TFLOPS = 400.0
"""Achieved bf16 TFLOP/s per GPU: about 40% of an H100's 989 dense peak, usual for fine-tuning."""
NODE_SWEEP = (1, 2, 4, 8, 16, 32, 64, 128)
"""Node counts of ``--plan``'s sweep."""
STATE_BYTES_PER_TRAINABLE = 16
"""hf_zero's fp32 master (4) + fp32 gradient (4) + Adam moments (8) per trainable parameter."""


@dataclass(frozen=True)
class Links:
    """Per-GPU bandwidths (bytes/s) and compute rate (FLOP/s) of the step-time model."""

    intra: float = DEFAULT_INTRA_NODE_GBPS * 1e9
    inter: float = DEFAULT_INTER_NODE_GBPS * 1e9
    flops: float = DEFAULT_COMPUTE_TFLOPS * 1e12


@dataclass(frozen=True)
class Layout:
    stage: int
    shard: int | None = None
    """``mics_shard_size`` (None: the world)."""
    hpz: int = 1

    def label(self) -> str:
        parts = [f"ZeRO-{self.stage}"]
        if self.shard is not None:
            parts.append(f"MiCS {self.shard}")
        if self.hpz > 1:
            parts.append(f"hpZ {self.hpz}")
        return " + ".join(parts) if len(parts) > 1 else parts[0] + " flat" * (self.stage >= 2)

    def config(self) -> dict:
        """The ``zero_optimization`` keys that give this layout."""
        cfg: dict = {"stage": self.stage}
        if self.shard is not None:
            cfg["mics_shard_size"] = self.shard
        if self.hpz > 1:
            cfg["zero_hpz_partition_size"] = self.hpz
        return cfg


@dataclass(frozen=True)
class PlanRow:
    layout: Layout
    nodes: int
    gpus_per_node: int
    intra_bytes: int
    """Bytes one GPU sends to GPUs of its node per optimizer step."""
    inter_bytes: int
    """Bytes one GPU sends to other nodes per optimizer step."""
    state_bytes: int
    """Model states per GPU of the layout (parameters, gradients, Adam; no activations, no buffers)."""
    compute_s: float
    comm_s: float

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.comm_s)

    @property
    def compute_bound(self) -> bool:
        return self.comm_s <= self.compute_s

    def as_dict(self) -> dict:
        return {"layout": self.layout.label(), "zero_optimization": self.layout.config(), "nodes": self.nodes,
                "gpus_per_node": self.gpus_per_node, "intra_node_bytes": self.intra_bytes,
                "inter_node_bytes": self.inter_bytes, "model_state_bytes": self.state_bytes,
                "compute_s": self.compute_s, "comm_s": self.comm_s, "step_s": self.step_s,
                "compute_bound": self.compute_bound}


@dataclass(frozen=True)
class Workload:
    units: tuple[UnitShapes, ...]
    total_params: int
    trainable_params: int
    param_bytes: int
    reduce_bytes: int
    tokens_per_gpu: int
    gas: int
    flops_per_token: int
    notes: tuple[str, ...] = field(default=())


def plan_units(spec: ModelSpec, lora_rank: int | None = None,
               lora_target_modules: str | Sequence[str] = "all-linear") -> tuple[tuple[UnitShapes, ...], tuple[str, ...]]:
    """The FSDP2 units of ``spec`` with LoRA's adapters added (base weights frozen), and notes."""
    notes: list[str] = []
    units = list(spec.fsdp_units)
    if not units:
        if spec.block_params and spec.root_params is not None and spec.num_layers:
            units = [UnitShapes(f"block {i}", ((spec.block_params,),)) for i in range(spec.num_layers)]
            units.append(UnitShapes("", ((spec.root_params,),)))
        else:
            units = [UnitShapes("", ((spec.total_params,),))]
        notes.append("no meta-device model (a bare count or the closed form): units from block sizes, per-tensor "
                     "padding to the shard group not counted")
    if lora_rank:
        layers = lora_target_layers(spec, lora_target_modules)
        if not layers:
            raise EstimatorError("LoRA needs the model's linear layers (a config, or --hidden_size --num_layers "
                                 "--intermediate_size with a bare count)")
        extra: dict[str, list[tuple[int, ...]]] = {}
        names = sorted((u.name for u in units if u.name), key=len, reverse=True)
        for layer in layers:
            owner = next((n for n in names if layer.name.startswith(n + ".")), "")
            extra.setdefault(owner, []).extend([(lora_rank, layer.in_features), (layer.out_features, lora_rank)])
        units = [UnitShapes(u.name, u.shapes + tuple(extra.get(u.name, ())),
                            (False,) * len(u.shapes) + (True,) * len(extra.get(u.name, ()))) for u in units]
    return tuple(units), tuple(notes)


def plan_layouts(nodes: int, gpus_per_node: int) -> list[Layout]:
    """Stage 1, stage 2 flat and MiCS, stage 3 flat, hpZ and MiCS over 1, 2, 4... nodes."""
    world = nodes * gpus_per_node
    out = [Layout(1), Layout(2), Layout(3)]
    if nodes > 1:
        if gpus_per_node > 1:
            out.append(Layout(3, hpz=gpus_per_node))
        shard = max(2, gpus_per_node)
        while shard < world:
            if world % shard == 0:
                out.append(Layout(2, shard=shard))
                out.append(Layout(3, shard=shard))
                if shard > gpus_per_node:
                    out.append(Layout(3, shard=shard, hpz=gpus_per_node))
            shard *= 2
    return out


def _state_bytes(w: Workload, layout: Layout, world: int) -> int:
    shard = layout.shard or world
    frozen = w.total_params - w.trainable_params
    states = STATE_BYTES_PER_TRAINABLE * w.trainable_params
    if layout.stage == 1:  # fp32 parameters and gradients whole, Adam sharded
        return 8 * w.trainable_params + 8 * w.trainable_params // world + w.param_bytes * frozen
    sharded = (states + w.param_bytes * frozen) // shard
    if layout.stage == 2:  # gathered in the compute dtype from forward to backward
        return sharded + w.param_bytes * w.total_params
    if layout.hpz > 1:  # hpZ's secondary copy, between a unit's forward and its backward
        return sharded + w.param_bytes * w.total_params // layout.hpz
    return sharded


def plan_row(w: Workload, layout: Layout, nodes: int, gpus_per_node: int, links: Links) -> PlanRow:
    world = nodes * gpus_per_node
    cols = step_collectives(w.units, stage=layout.stage, world=world, gas=w.gas, param_bytes=w.param_bytes,
                            reduce_bytes=w.reduce_bytes, shard=layout.shard, hpz=layout.hpz)
    sent = Sent(Fraction(0), Fraction(0))
    for c in cols:
        shape = group_shape(group_ranks(c.group, 0, world, layout.shard, layout.hpz), gpus_per_node)
        sent = sent + bytes_sent(c.op, c.nbytes, shape)
    compute = w.flops_per_token * w.tokens_per_gpu / links.flops
    comm = float(sent.intra) / links.intra + float(sent.inter) / links.inter
    return PlanRow(layout, nodes, gpus_per_node, round(sent.intra), round(sent.inter), _state_bytes(w, layout, world),
                   compute, comm)


def sweep(w: Workload, gpus_per_node: int, links: Links, node_counts: Sequence[int]) -> dict[int, list[PlanRow]]:
    return {k: [plan_row(w, lay, k, gpus_per_node, links) for lay in plan_layouts(k, gpus_per_node)] for k in node_counts}


def recommend(rows: Sequence[PlanRow]) -> tuple[PlanRow, str]:
    """The stage-3 layout to use and why (see the module docstring)."""
    stage3 = [r for r in rows if r.layout.stage == 3]
    bound = [r for r in stage3 if r.compute_bound]
    if bound:
        best = min(bound, key=lambda r: (r.state_bytes, r.inter_bytes))
        return best, (f"{best.layout.label()} keeps the step compute-bound (communication {best.comm_s * 1e3:.0f} ms "
                      f"<= compute {best.compute_s * 1e3:.0f} ms) with the least model-state memory per GPU "
                      f"({format_bytes(best.state_bytes)})")
    best = min(stage3, key=lambda r: r.step_s)
    need = best.comm_s / best.compute_s
    return best, (f"no stage-3 layout is compute-bound here: the fastest, {best.layout.label()}, communicates "
                  f"{best.comm_s * 1e3:.0f} ms per step against {best.compute_s * 1e3:.0f} ms of compute; "
                  f"about {need:.1f}x the tokens per GPU per step (gradient_accumulation_steps or the micro "
                  "batch) would make it compute-bound")


def workload(spec: ModelSpec, *, dtype: str, tokens_per_gpu: int, gas: int, lora_rank: int | None = None,
             lora_target_modules: str | Sequence[str] = "all-linear", gradient_checkpointing: bool = False,
             reduce_dtype: str = "fp32") -> Workload:
    """What a step of this model moves and computes; ``tokens_per_gpu`` counts every micro-step."""
    units, notes = plan_units(spec, lora_rank, lora_target_modules)
    trainable = sum(_numel(s) for u in units for i, s in enumerate(u.shapes) if u.is_trainable(i))
    total = sum(_numel(s) for u in units for s in u.shapes)
    flops = (4 if lora_rank else 6) * total + (2 * total if gradient_checkpointing else 0)
    return Workload(units, total, trainable, 4 if dtype == "fp32" else 2, 4 if reduce_dtype == "fp32" else 2,
                    tokens_per_gpu, gas, flops, notes)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def render_plan(w: Workload, table: dict[int, list[PlanRow]], gpus_per_node: int, links: Links) -> str:
    """The plan as text: per node count of ``table`` (:func:`sweep`), its layouts and the recommendation."""
    lines = [f"Communication per optimizer step ({w.tokens_per_gpu} tokens per GPU, {w.gas} micro-step(s); "
             f"links {links.intra / 1e9:g} GB/s in a node, {links.inter / 1e9:g} GB/s across nodes per GPU; "
             f"{links.flops / 1e12:g} TFLOP/s per GPU)",
             "Bytes each GPU sends (two-level collectives); time is a model: step = max(compute, comm), docs/estimator.md"]
    node_counts = sorted(table)
    header = f"{'nodes':>5} {'layout':<28} {'in node':>10} {'across':>10} {'states/GPU':>10} {'comm ms':>8} {'step ms':>8}  bound"
    for k in node_counts:
        lines.append("")
        lines.append(f"{k} node(s) x {gpus_per_node} GPUs:")
        lines.append(header)
        for r in table[k]:
            lines.append(f"{k:>5} {r.layout.label():<28} {format_bytes(r.intra_bytes):>10} {format_bytes(r.inter_bytes):>10} "
                         f"{format_bytes(r.state_bytes):>10} {r.comm_s * 1e3:>8.1f} {r.step_s * 1e3:>8.1f}  "
                         f"{'compute' if r.compute_bound else 'comm'}")
        best, why = recommend(table[k])
        lines.append(f"  recommended: {why}: \"zero_optimization\": {json.dumps(best.layout.config())}")
    lines.extend(f"note: {n}" for n in w.notes)
    return "\n".join(lines)
