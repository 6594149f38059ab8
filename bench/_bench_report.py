"""Output of bench/run_bench.py: the Markdown report and the plot of one run's payload.

Split from run_bench.py (which launches and aggregates the runs) so that the driver stays short;
bench/gpu_session.py reuses the same rendering for its combined report. Imports only the pure
``_bench_lib`` (and matplotlib, lazily, for the plot).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import _bench_lib as lib

def render_markdown(payload: dict[str, Any]) -> str:
    s = payload["settings"]
    m = payload["machine"]
    shape = s["shape"]
    lines = [
        f"Model: Qwen2-shaped, random weights, {s['params'] / 1e6:.1f}M parameters (hidden {shape['hidden']}, "
        f"{shape['layers']} layers, {shape['heads']} heads / {shape['kv_heads']} kv, MLP {shape['intermediate']}, "
        f"vocab {shape['vocab']}, {'tied' if shape.get('tie', True) else 'untied'} head)"
        + (f", LoRA rank {s['lora_rank']}" if s.get("lora_rank") else "") + ".",
        f"Workload: {s['nproc_per_node']} ranks x micro batch {s['micro_batch']} x seq {s['seq_len']} x accumulation "
        f"{s['grad_accum']} = {s['tokens_per_step']} tokens per optimizer step; {s['steps']} steps, first "
        f"{s['warmup_steps']} not timed; {s['dtype']}"
        + (f"; {payload['repeat']} rounds, each row from its fastest round" if payload.get("repeat", 1) > 1 else "")
        + (f"; MALLOC_MMAP_THRESHOLD_={payload['malloc_mmap_threshold']}" if payload.get("malloc_mmap_threshold") else "") + (", gradient checkpointing" if s.get("gradient_checkpointing") else "")
        + (f"; GPU memory capped at {lib.fmt_bytes(s['gpu_memory_cap_bytes'])} per rank" if s.get("gpu_memory_cap_bytes") else "") + ".",
        f"Machine: {m.get('cpu', '?')}, {m.get('cpu_count')} CPUs, {lib.fmt_bytes(m.get('ram_bytes'))} RAM"
        + (", " + ", ".join(g["name"] for g in m.get("gpus", [])) if m.get("gpus") else ", no GPU")
        + f"; torch {m.get('torch')}, transformers {m.get('transformers')}, accelerate {m.get('accelerate')}"
        + (f", DeepSpeed {payload['deepspeed_version']}" if payload.get("deepspeed_version") else "")
        + f"; hf_zero {m.get('hf_zero_commit')}"
        + (f"; load average {m['loadavg_start'][0]:.1f} at start, {m['loadavg_end'][0]:.1f} at end" if m.get("loadavg_end") else "")
        + ".",
        "",
        lib.results_table(payload["results"]),
        "",
        "Ratios (speed = tokens/s over the alternative's, > 1 is faster; mem = "
        + ("peak accelerator memory" if m.get("cuda") else "peak host RSS above the import baseline")
        + " over the alternative's, < 1 is less):",
        "",
        lib.ratio_table(payload["results"]),
    ]
    cap = s.get("gpu_memory_cap_bytes")
    if cap and m.get("cuda"):
        lines += [
            "",
            f"Does it fit a {lib.fmt_bytes(cap)} card? (rows in --uncapped ran without the cap; their peak answers):",
            "",
            lib.markdown_table(
                ["configuration", "cap applied", "peak accel mem", "fits"],
                [[r["label"], "yes" if r.get("gpu_memory_cap_bytes") else "no", lib.fmt_bytes(r.get("peak_accel_bytes")),
                  r.get("fits_cap") or "-"] for r in payload["results"]],
            ),
        ]
    est = [r for r in payload["results"] if r.get("estimate_bytes") is not None and r.get("status") == "ok"]
    if est:
        measured_key = "peak_accel_bytes" if m.get("cuda") else "rss_over_baseline_bytes"
        lines += [
            "",
            "hf-zero estimate vs measured (" + ("per GPU, max_memory_allocated" if m.get("cuda") else "node, all tiers, vs RSS above baseline") + "):",
            "",
            lib.markdown_table(
                ["configuration", "estimate", "measured", "estimate / measured"],
                [[r["label"], lib.fmt_bytes(r["estimate_bytes"]), lib.fmt_bytes(r[measured_key]),
                  lib.fmt_ratio(lib.ratio(r["estimate_bytes"], r[measured_key]))] for r in est],
            ),
        ]
        if not m.get("cuda"):
            lines += [
                "",
                "On a CPU the measured figure also holds what training loads lazily (gloo, FSDP2, oneDNN: "
                "~100 MiB per rank) and the allocator's slack, which dominate for a small model; "
                "integration_tests/test_estimator_vs_measured.py measures without them (docs/benchmarks.md).",
            ]
    phased = [r for r in payload["results"] if r.get("memory_phases") and r.get("status") == "ok"]
    if phased:
        host = phased[0]["memory_phases"]["host"]
        heads = ["configuration", "setup (after the load)", "forward", "backward", "optimizer step"]
        keys = ["setup", "forward", "backward", "step"]
        if host:
            heads.append("malloc in use after the step")
            keys.append("in_use_after_step")
        lines += [
            "",
            "Memory by phase (--memory_profile; the last step's peaks; "
            + ("host RSS above the import baseline, summed over the node's ranks; 'malloc in use' leaves out the "
               "heap's free pages" if host else "peak accelerator memory of the busiest rank") + "):",
            "",
            lib.markdown_table(heads, [[r["label"], *(lib.fmt_bytes(r["memory_phases"]["bytes"].get(k)) for k in keys)]
                                       for r in phased]),
        ]
    for r in payload["results"]:
        for key in ("warning", "exit_note"):
            if r.get(key):
                lines += ["", f"Note ({r['label']}): {r[key]}"]
    if payload.get("notes"):
        lines += ["", *[f"Note: {n}" for n in payload["notes"]]]
    return "\n".join(lines) + "\n"


_COLORS = {"ddp": "#7f7f7f", "fsdp2": "#1f77b4", "deepspeed": "#d62728", "hf_zero": "#2ca02c"}


def save_plot(payload: dict[str, Any], path: Path) -> Path | None:
    """Two bar charts: tokens/s, and memory (accelerator peak, or host RSS with its baseline part)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot", file=sys.stderr)
        return None
    results = [r for r in payload["results"] if r.get("status") == "ok"]
    if not results:
        return None
    cuda = bool(payload["machine"].get("cuda"))
    labels = [r["label"] for r in results]
    colors = [_COLORS.get(r["kind"], "#999999") for r in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.45 * len(results) + 1.8), sharey=True)
    y = list(range(len(results)))
    ax1.barh(y, [r["tokens_per_s"] for r in results], color=colors)
    for yi, r in zip(y, results):
        ax1.text(r["tokens_per_s"], yi, f" {r['tokens_per_s']:.0f}", va="center", fontsize=8)
    ax1.set_yticks(y, labels, fontsize=8)
    ax1.invert_yaxis()
    ax1.set_xlabel("tokens/s (higher is better)")
    if cuda:
        vals = [(r["peak_accel_bytes"] or 0) / lib.GiB for r in results]
        ax2.barh(y, vals, color=colors)
        ax2.set_xlabel("peak accelerator memory, busiest rank (GiB)")
        if payload["settings"].get("gpu_memory_cap_bytes"):
            ax2.axvline(payload["settings"]["gpu_memory_cap_bytes"] / lib.GiB, color="k", ls="--", lw=1)
    else:
        over = [r["rss_over_baseline_bytes"] / lib.MiB for r in results]
        basev = [r["baseline_rss_node_bytes"] / lib.MiB for r in results]
        ax2.barh(y, basev, color="#dddddd", label="import baseline")
        ax2.barh(y, over, left=basev, color=colors, label="training")
        vals = [b + o for b, o in zip(basev, over)]
        ax2.set_xlabel("peak host RSS of the node (MiB; grey: RSS after imports)")
        ax2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=2, frameon=False)
    ax1.set_xlim(0, 1.18 * max(r["tokens_per_s"] for r in results))
    ax2.set_xlim(0, 1.18 * max(max(vals), 1e-9))
    for yi, v in zip(y, vals):
        ax2.text(v, yi, f" {v:.2f}" if cuda else f" {v:.0f}", va="center", fontsize=8)
    s = payload["settings"]
    fig.suptitle(
        f"{s['params'] / 1e6:.1f}M-param Qwen2-shaped model, {s['nproc_per_node']} ranks, seq {s['seq_len']}, "
        f"micro batch {s['micro_batch']}, {s['dtype']}" + (f", LoRA r={s['lora_rank']}" if s.get("lora_rank") else "")
        + (" (" + payload["machine"]["gpus"][0]["name"] + ")" if cuda and payload["machine"].get("gpus") else " (CPU, gloo)"),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
