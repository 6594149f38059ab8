"""The pure parts of bench/gpu_session.py: what the session runs (the plan, per device), the time
budget, and the combined report (one results table, one table of ratios against the issue's goals).

No torch import and no processes here, so that tests/unit/test_bench.py checks the plan and the
report without launching anything. The GPU plan and the CPU dry run share every step; they differ
only in the shapes, the step counts and the time limits below.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import _bench_lib as lib

FULL_CONFIGS = ("fsdp2", "zero2", "zero3", "zero3_opt_cpu", "zero3_opt_cpu_param_cpu", "ds3", "ds3_opt_cpu")
"""The full fine-tune's rows, in the order they run (the issue's order: alternatives interleaved
so that a clock cut-off loses the least useful rows last)."""

UNCAPPED = ("fsdp2", "zero2", "zero3", "ds3")
"""Rows that run without the 24 GiB cap. Without offload a full fine-tune holds 16 bytes per
parameter (fp32 master, fp32 gradient, two Adam moments) on one GPU: 1.54 B x 16 B = 23.0 GiB for
Qwen2.5-1.5B before any activation (``hf-zero estimate`` says 31-33 GiB with them), so under the
cap these rows could only report an out-of-memory error, and the issue's speed goals (ZeRO-3 vs
FSDP2 and vs DeepSpeed ZeRO-3) need their tokens/s. Their peak memory still answers whether they
fit the card (the "fits" column)."""

LORA_CONFIGS = ("zero3", "ds3")
"""LoRA rows: hf_zero against DeepSpeed, both at stage 3 (what a 7B LoRA needs on one 24 GB card)."""

DS_BUILD_NEEDED_BY = ("ds3_opt_cpu",)
"""Rows that need DeepSpeed's compiled CPU Adam (dropped, with the reason, if it does not build)."""


@dataclass(frozen=True)
class Workload:
    """One ``bench/run_bench.py`` invocation of the session."""

    name: str
    """``full`` or ``lora``; also the stem of its files (``full.json``, ``full.png``)."""
    label: str
    shape_args: tuple[str, ...]
    configs: tuple[str, ...]
    seq_len: int
    micro_batch: int
    steps: int
    warmup_steps: int
    row_timeout_s: float
    need_s: float
    """Estimated seconds for the whole invocation (model creation + every row): the clock decides
    from it whether this workload starts (see the budget table in bench/README.md)."""
    extra_args: tuple[str, ...] = ()
    uncapped: tuple[str, ...] = ()

    def bench_args(self, *, cap: str | None, nproc: int = 1) -> list[str]:
        """run_bench.py's arguments for this workload (without output, deadline and DeepSpeed options)."""
        args = [*self.shape_args, "--seq_len", str(self.seq_len), "--micro_batch", str(self.micro_batch),
                "--steps", str(self.steps), "--warmup_steps", str(self.warmup_steps), "--nproc_per_node", str(nproc),
                "--configs", ",".join(self.configs), "--timeout", str(self.row_timeout_s), *self.extra_args]
        if cap:
            args += ["--gpu_memory_cap", cap]
            uncapped = [c for c in self.uncapped if c in self.configs]
            if uncapped:
                args += ["--uncapped", ",".join(uncapped)]
        return args


@dataclass(frozen=True)
class Profile:
    """Everything that differs between the GPU session and its CPU dry run."""

    device: str
    budget_s: float
    """The whole session, start to last file; the device call's timeout_s leaves a margin above it."""
    env_limit_s: float
    doctor_limit_s: float
    doctor_args: tuple[str, ...]
    build_limit_s: float
    """DeepSpeed's CPU Adam JIT build (started first, in the background; waited for before the
    first training row so that the compiler does not share the cores with a timed run)."""
    min_run_s: float
    full: Workload
    lora: tuple[Workload, ...]
    """Candidates, largest first: the first whose ``need_s`` fits the time left runs."""
    summary_reserve_s: float = 15.0
    cap: str | None = "24GB"
    notes: tuple[str, ...] = field(default_factory=tuple)


_LORA_ARGS = ("--lora_rank", "8", "--gradient_checkpointing")

GPU = Profile(
    device="gpu",
    budget_s=520.0,
    env_limit_s=60.0,
    doctor_limit_s=120.0,
    doctor_args=(),
    build_limit_s=240.0,
    min_run_s=40.0,
    full=Workload(
        name="full", label="full fine-tune, Qwen2.5-1.5B shape", shape_args=("--preset", "1.5b"), configs=FULL_CONFIGS,
        seq_len=1024, micro_batch=1, steps=8, warmup_steps=3, row_timeout_s=150.0, need_s=330.0, uncapped=UNCAPPED,
    ),
    lora=(
        Workload(name="lora", label="LoRA r=8, Qwen2-7B shape", shape_args=("--preset", "7b"), configs=LORA_CONFIGS,
                 seq_len=1024, micro_batch=1, steps=8, warmup_steps=3, row_timeout_s=200.0, need_s=160.0,
                 extra_args=_LORA_ARGS),
        Workload(name="lora", label="LoRA r=8, Qwen2.5-3B shape", shape_args=("--preset", "3b"), configs=LORA_CONFIGS,
                 seq_len=1024, micro_batch=1, steps=8, warmup_steps=3, row_timeout_s=150.0, need_s=95.0,
                 extra_args=_LORA_ARGS),
    ),
)

_CPU_SHAPE = ("--hidden", "64", "--layers", "2", "--heads", "4", "--kv_heads", "2", "--vocab", "512")

CPU = Profile(
    device="cpu",
    budget_s=1500.0,
    env_limit_s=60.0,
    doctor_limit_s=180.0,
    doctor_args=("--nproc_per_node", "1"),  # one rank, as on the one GPU
    # DeepSpeed's first JIT build of cpu_adam and of its shared-memory collectives took 3-4 min each
    # on the 2 shared cores here; later runs load them from the cache in seconds.
    build_limit_s=720.0,
    min_run_s=20.0,
    full=Workload(
        name="full", label="full fine-tune, tiny Qwen2 shape (CPU dry run)", shape_args=_CPU_SHAPE, configs=FULL_CONFIGS,
        seq_len=32, micro_batch=1, steps=4, warmup_steps=1, row_timeout_s=240.0, need_s=300.0, uncapped=UNCAPPED,
    ),
    lora=(
        Workload(name="lora", label="LoRA r=8, tiny Qwen2 shape (CPU dry run)", shape_args=_CPU_SHAPE, configs=LORA_CONFIGS,
                 seq_len=32, micro_batch=1, steps=4, warmup_steps=1, row_timeout_s=240.0, need_s=60.0,
                 extra_args=_LORA_ARGS),
    ),
    notes=("CPU dry run: tiny shapes on gloo; the numbers say that every step ran, not how a GPU performs",),
)


def pick_lora(profile: Profile, seconds_left: float) -> Workload | None:
    """The largest LoRA workload whose estimated need fits the time left (None: none does)."""
    for workload in profile.lora:
        if workload.need_s <= seconds_left:
            return workload
    return None


def full_phase_deadline(profile: Profile, start: float, budget_s: float | None = None, lora_follows: bool = True) -> float:
    """When the full fine-tune's last row must have ended: the budget less the summary and, when
    the LoRA rows follow, the smallest LoRA workload, so that a slow full phase leaves them their turn."""
    smallest = min(w.need_s for w in profile.lora) if lora_follows else 0.0
    return start + (profile.budget_s if budget_s is None else budget_s) - smallest - profile.summary_reserve_s


def budget_rows(profile: Profile) -> list[list[str]]:
    """The planned time per step (estimates and limits, not measurements) for the README's table."""
    rows = [
        ["hf-zero env", "-", f"{profile.env_limit_s:.0f}"],
        ["hf-zero doctor", "-", f"{profile.doctor_limit_s:.0f}"],
        ["DeepSpeed cpu_adam JIT build (background)", "-", f"{profile.build_limit_s:.0f}"],
        [profile.full.label, f"{profile.full.need_s:.0f}", f"{profile.full.row_timeout_s:.0f} per row"],
    ]
    rows += [[w.label, f"{w.need_s:.0f}", f"{w.row_timeout_s:.0f} per row"] for w in profile.lora]
    rows.append(["whole session (deadline)", "-", f"{profile.budget_s:.0f}"])
    return rows


# ------------------------------------------------------------------------------------------ report
COMPARISONS: tuple[tuple[str, str, str, float | None, bool], ...] = (
    # workload, configuration, against, tokens/s goal (>=), memory goal (<= 1.0 when True)
    ("full", "zero3", "fsdp2", 0.95, False),
    ("full", "zero2", "fsdp2", None, False),
    ("full", "zero3", "ds3", 1.0, True),
    ("full", "zero3_opt_cpu", "ds3_opt_cpu", 1.0, True),
    ("full", "zero3_opt_cpu_param_cpu", "ds3_opt_cpu", None, True),
    ("lora", "zero3", "ds3", 1.0, True),
)
"""The issue's goals: hf_zero ZeRO-3 >= 0.95x Trainer FSDP2's tokens/s; >= 1.0x DeepSpeed at stage 3
with and without ``offload_optimizer: cpu``; peak GPU memory <= DeepSpeed's in every row."""


def _by_name(payload: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in (payload or {}).get("results", [])}


def comparison_rows(payloads: dict[str, dict[str, Any] | None], *, gpu: bool) -> list[dict[str, Any]]:
    """One row per comparison of :data:`COMPARISONS` whose two configurations both ran.

    Ratios: tokens/s (> 1 faster), peak GPU memory and peak host RSS of the node (< 1 less). The
    verdict is given on a GPU only: a CPU dry run's numbers do not speak to the goals.
    """
    rows = []
    for workload, name, ref, speed_goal, mem_goal in COMPARISONS:
        results = _by_name(payloads.get(workload))
        a, b = results.get(name), results.get(ref)
        if not a or not b or a.get("status") != "ok" or b.get("status") != "ok":
            continue
        speed = lib.ratio(a.get("tokens_per_s"), b.get("tokens_per_s"))
        mem = lib.ratio(a.get("peak_accel_bytes"), b.get("peak_accel_bytes"))
        rss = lib.ratio(a.get("peak_rss_node_bytes"), b.get("peak_rss_node_bytes"))
        goals, verdicts = [], []
        if speed_goal is not None:
            goals.append(f"tokens/s >= {speed_goal:.2f}x")
            if speed is not None:
                verdicts.append(f"speed {'met' if speed >= speed_goal else 'missed'} ({speed / speed_goal - 1:+.0%})")
        if mem_goal:
            goals.append("GPU memory <= 1.00x")
            if mem is not None:
                verdicts.append(f"memory {'met' if mem <= 1.0 else 'missed'} ({mem - 1:+.0%})")
        rows.append({
            "workload": workload, "configuration": a["label"], "against": b["label"],
            "speed": speed, "gpu_memory": mem, "host_rss": rss,
            "goal": "; ".join(goals) or "-",
            "verdict": ("; ".join(verdicts) or "-") if gpu else "not judged (CPU dry run)",
        })
    return rows


def result_rows(plan: dict[str, Sequence[str]], payloads: dict[str, dict[str, Any] | None],
                reasons: dict[str, str]) -> list[list[str]]:
    """The combined results table: every planned row of every workload, run or not (with why)."""
    rows = []
    for workload, configs in plan.items():
        results = _by_name(payloads.get(workload))
        for name in configs:
            r = results.get(name)
            label = lib.parse_config_name(name).label()
            if r is None:
                rows.append([workload, label, f"not run: {reasons.get(workload + ':' + name) or reasons.get(workload) or 'no result'}"]
                            + [""] * 6)
                continue
            if r.get("status") != "ok":
                rows.append([workload, label, f"{r.get('status')}: {lib.short_error(r.get('error', ''), 120)}", "", "",
                             lib.fmt_bytes(r.get("peak_accel_bytes")) if r.get("peak_accel_bytes") else "",
                             r.get("fits_cap") or "", "", ""])
                continue
            rows.append([
                workload, label, "ok", f"{r['tokens_per_s']:.0f}", f"{r['step_median_s']:.3f}",
                lib.fmt_bytes(r.get("peak_accel_bytes")), r.get("fits_cap") or "-",
                lib.fmt_bytes(r.get("peak_rss_node_bytes")),
                "n/a" if r.get("final_loss") is None else f"{r['final_loss']:.4f}",
            ])
    return rows


RESULT_HEADER = ["workload", "configuration", "status", "tokens/s", "step median (s)", "peak GPU mem",
                 "fits the cap", "peak host RSS (node)", "final loss"]
COMPARISON_HEADER = ["workload", "hf_zero", "against", "tokens/s ratio", "peak GPU mem ratio", "peak host RSS ratio",
                     "goal (issue 28)", "verdict"]


def comparison_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no pair of rows ran: no ratios)"
    return lib.markdown_table(COMPARISON_HEADER, [
        [r["workload"], r["configuration"], r["against"], lib.fmt_ratio(r["speed"]), lib.fmt_ratio(r["gpu_memory"]),
         lib.fmt_ratio(r["host_rss"]), r["goal"], r["verdict"]] for r in rows
    ])
