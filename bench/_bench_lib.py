"""Pure parts of the side-by-side fine-tune benchmark (``bench/run_bench.py``).

No torch import here: the driver, the worker (``bench/_bench_worker.py``, which may run in another
Python with DeepSpeed installed) and the unit tests (``tests/unit/test_bench.py``) share it.

* presets: Qwen2-shaped model shapes (``tiny`` for CPUs, ``0.5b``/``1.5b``/``3b``/``7b`` as the
  released Qwen2/Qwen2.5 checkpoints are shaped);
* the configuration matrix: names such as ``ddp``, ``fsdp2``, ``zero3_opt_cpu_param_cpu`` or ``ds2``
  parsed into :class:`BenchConfig`, and the DeepSpeed-style config each ZeRO entry runs with;
* step-time statistics, ratios against the alternatives, the Markdown tables;
* the per-process GPU memory cap (``--gpu_memory_cap 24GB``) as a fraction of the card.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

GiB = 1024**3
MiB = 1024**2

# --------------------------------------------------------------------------------------- model shapes
PRESETS: dict[str, dict[str, Any]] = {
    # A CPU-sized model: seconds per step on 2 cores.
    "tiny": dict(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=688, vocab=4096, tie=True),
    # Qwen2-0.5B / Qwen2.5-0.5B
    "0.5b": dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936, tie=True),
    # Qwen2-1.5B / Qwen2.5-1.5B
    "1.5b": dict(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960, vocab=151936, tie=True),
    # Qwen2.5-3B
    "3b": dict(hidden=2048, layers=36, heads=16, kv_heads=2, intermediate=11008, vocab=151936, tie=True),
    # Qwen2-7B / Qwen2.5-7B
    "7b": dict(hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944, vocab=152064, tie=False),
}
"""Qwen2 shapes: hidden size, layers, attention heads, key/value heads, MLP size, vocabulary, tied head."""


def qwen2_param_count(shape: dict[str, Any]) -> int:
    """Parameters of a Qwen2 model of ``shape`` (q/k/v with bias, o without, gated MLP, RMSNorms).

    >>> qwen2_param_count(PRESETS["0.5b"])  # Qwen2-0.5B
    494032768
    """
    h, layers, inter, vocab = shape["hidden"], shape["layers"], shape["intermediate"], shape["vocab"]
    head_dim = h // shape["heads"]
    kv = shape["kv_heads"] * head_dim
    attn = h * h + h + 2 * (h * kv + kv) + h * h
    mlp = 3 * h * inter
    block = attn + mlp + 2 * h
    embed = vocab * h
    return layers * block + embed + h + (0 if shape.get("tie", True) else embed)


# --------------------------------------------------------------------------------------- configurations
ALTERNATIVE_KINDS = ("ddp", "fsdp2", "deepspeed")
"""What a user would run instead of hf_zero: plain Trainer (DDP), Trainer --fsdp (FSDP2), Trainer --deepspeed."""

_ZERO_RE = re.compile(r"^(zero|ds)([0-3])(?:_opt_(cpu|nvme))?(?:_param_(cpu|nvme))?$")


@dataclass(frozen=True)
class BenchConfig:
    """One configuration of the matrix."""

    name: str
    """The command-line name: ``ddp``, ``fsdp2``, ``zero{0-3}[_opt_{cpu,nvme}][_param_{cpu,nvme}]``,
    ``ds{0-3}[...]`` (DeepSpeed)."""
    kind: str
    """``ddp``, ``fsdp2``, ``hf_zero`` or ``deepspeed``."""
    stage: int | None = None
    offload_optimizer: str = "none"
    offload_param: str = "none"

    @property
    def is_alternative(self) -> bool:
        return self.kind in ALTERNATIVE_KINDS

    @property
    def uses_nvme(self) -> bool:
        return "nvme" in (self.offload_optimizer, self.offload_param)

    def label(self) -> str:
        """Human name for tables and plots, e.g. ``hf_zero ZeRO-3 +opt cpu +param cpu``."""
        if self.kind == "ddp":
            return "Trainer DDP"
        if self.kind == "fsdp2":
            return "Trainer --fsdp (FSDP2)"
        who = "hf_zero" if self.kind == "hf_zero" else "DeepSpeed"
        text = f"{who} ZeRO-{self.stage}"
        if self.offload_optimizer != "none":
            text += f" +opt {self.offload_optimizer}"
        if self.offload_param != "none":
            text += f" +param {self.offload_param}"
        return text


def parse_config_name(name: str) -> BenchConfig:
    """``"zero3_opt_cpu_param_cpu"`` -> :class:`BenchConfig`; ValueError naming the bad name.

    Rules (those of DeepSpeed's config): optimizer offload at stages 1-3, parameter offload at
    stage 3 only, parameter NVMe offload only with an offloaded optimizer.
    """
    name = name.strip()
    if name in ("ddp", "fsdp2"):
        return BenchConfig(name=name, kind=name)
    m = _ZERO_RE.match(name)
    if not m:
        raise ValueError(
            f"unknown configuration {name!r}: use ddp, fsdp2, zero<0-3>[_opt_<cpu|nvme>][_param_<cpu|nvme>] "
            "or ds<0-3>[...] (DeepSpeed)"
        )
    family, stage, opt, param = m.group(1), int(m.group(2)), m.group(3) or "none", m.group(4) or "none"
    if opt != "none" and stage == 0:
        raise ValueError(f"{name}: optimizer offload needs stage 1, 2 or 3")
    if param != "none" and stage != 3:
        raise ValueError(f"{name}: parameter offload needs stage 3")
    if param == "nvme" and opt == "none":
        raise ValueError(f"{name}: parameter NVMe offload needs an offloaded optimizer (add _opt_cpu or _opt_nvme)")
    kind = "hf_zero" if family == "zero" else "deepspeed"
    return BenchConfig(name=name, kind=kind, stage=stage, offload_optimizer=opt, offload_param=param)


DEFAULT_CONFIGS = (
    "ddp",
    "fsdp2",
    "zero0",
    "zero1",
    "zero2",
    "zero3",
    "zero2_opt_cpu",
    "zero3_opt_cpu_param_cpu",
    "zero3_opt_nvme",
    "ds2",
    "ds3",
)
"""What ``--configs default`` runs (the ``ds*`` entries only when a DeepSpeed Python is given)."""

CONFIG_GROUPS: dict[str, tuple[str, ...]] = {
    "default": DEFAULT_CONFIGS,
    "alternatives": ("ddp", "fsdp2", "ds2", "ds3"),
    "zero": ("zero0", "zero1", "zero2", "zero3"),
    "offload": ("zero1_opt_cpu", "zero2_opt_cpu", "zero3_opt_cpu", "zero3_opt_cpu_param_cpu", "zero3_opt_nvme", "zero3_opt_nvme_param_nvme"),
    "lora24": ("ddp", "fsdp2", "zero2", "zero3", "zero2_opt_cpu", "zero3_opt_cpu", "zero3_opt_cpu_param_cpu", "ds2", "ds3"),
}
"""Names usable in ``--configs`` for several configurations at once."""


def build_config_matrix(spec: str | Sequence[str], *, deepspeed_available: bool) -> tuple[list[BenchConfig], list[str]]:
    """The configurations to run, in order, without duplicates, and the notes on what was left out.

    ``spec`` is a comma-separated string or a list of names and group names (:data:`CONFIG_GROUPS`).
    DeepSpeed entries are dropped with a note when ``deepspeed_available`` is false.
    """
    items = [s for s in (spec.split(",") if isinstance(spec, str) else spec)]
    names: list[str] = []
    for item in (s.strip() for s in items):
        if not item:
            continue
        for name in CONFIG_GROUPS.get(item, (item,)):
            if name not in names:
                names.append(name)
    configs = [parse_config_name(n) for n in names]
    notes = []
    skipped = [c.name for c in configs if c.kind == "deepspeed" and not deepspeed_available]
    if skipped:
        notes.append(f"DeepSpeed not importable (give --deepspeed_python): skipped {', '.join(skipped)}")
    configs = [c for c in configs if c.name not in skipped]
    if not configs:
        raise ValueError(f"no configuration left to run from {spec!r}")
    return configs, notes


def zero_config_dict(config: BenchConfig, *, nvme_path: str | None = None, sub_group_size: int | None = None,
                     overlap_comm: bool = False) -> dict[str, Any]:
    """The DeepSpeed-style JSON this configuration runs with (hf_zero and DeepSpeed alike).

    Everything the Trainer knows is ``"auto"`` (batch sizes, accumulation, clipping, precision), as
    in the users' ``ds_config.json`` files; there is no optimizer/scheduler section, so the
    Trainer's own AdamW and schedule are used -- except DeepSpeed with optimizer offload, which
    needs its own CPU Adam (``optimizer: AdamW`` with ``"auto"`` hyper-parameters).
    ``overlap_comm`` changes nothing in hf_zero; DeepSpeed overlaps its gradient reduction with
    it (run_bench.py sets it on GPUs; the H100 session of 2026-11-27 still ran with false).
    """
    if config.stage is None:
        raise ValueError(f"{config.name} is not a ZeRO configuration")
    zero: dict[str, Any] = {"stage": config.stage}
    if config.stage > 0:
        zero.update(overlap_comm=overlap_comm, contiguous_gradients=True, reduce_bucket_size="auto")
    if config.stage == 3:
        zero.update(
            stage3_prefetch_bucket_size="auto",
            stage3_param_persistence_threshold="auto",
            stage3_gather_16bit_weights_on_model_save=True,
        )
    for key, device in (("offload_optimizer", config.offload_optimizer), ("offload_param", config.offload_param)):
        if device == "none":
            continue
        section: dict[str, Any] = {"device": device, "pin_memory": True}
        if device == "nvme":
            if not nvme_path:
                raise ValueError(f"{config.name}: NVMe offload needs an nvme_path")
            section["nvme_path"] = nvme_path
        zero[key] = section
    if sub_group_size is not None:
        zero["sub_group_size"] = sub_group_size
    from hf_zero.config.auto import trainer_auto_config

    cfg = trainer_auto_config(zero, optimizer=config.kind == "deepspeed" and config.offload_optimizer != "none")
    if config.uses_nvme:
        cfg["aio"] = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False, "overlap_events": True}
    return cfg


# --------------------------------------------------------------------------------------- processes
def run_process_group(cmd: Sequence[str], *, timeout: float | None, stdout: Any = None, stderr: Any = "stdout",
                      env: dict[str, str] | None = None, cwd: Any = None) -> int | None:
    """Run ``cmd`` in a session of its own; its exit status, or None when it ran past ``timeout``
    (see :func:`wait_process_group`). ``stderr="stdout"`` sends both streams to ``stdout``."""
    import subprocess

    if stderr == "stdout":
        stderr = subprocess.STDOUT if stdout is not None else None
    proc = subprocess.Popen(list(cmd), stdout=stdout, stderr=stderr, env=env, cwd=cwd, start_new_session=True)
    return wait_process_group(proc, timeout)


def wait_process_group(proc: Any, timeout: float | None, grace_s: float = 10.0) -> int | None:
    """Wait for ``proc`` (started with ``start_new_session=True``); its exit status, or None when it
    ran past ``timeout``. Then the whole process group is ended (SIGTERM, then SIGKILL after
    ``grace_s``), not only ``proc``: killing torchrun alone leaves its worker ranks running, and on a
    GPU they would keep their memory while the next configuration starts.
    """
    import os
    import signal
    import subprocess

    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass

    def signal_group(sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the group is already empty
            pass

    signal_group(signal.SIGTERM)  # torchrun forwards it to its ranks and waits for them
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    signal_group(signal.SIGKILL)  # members that ignored SIGTERM or outlived the leader
    proc.wait()
    return None


# --------------------------------------------------------------------------------------- GPU memory cap
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]?)(i?[bB])?\s*$")
_UNIT = {"": 1, "k": 1024, "m": MiB, "g": GiB, "t": 1024**4}


def parse_size(text: str | int) -> int:
    """``"24GB"`` -> 24 x 2**30 bytes (binary units, as ``nvidia-smi`` and ``hf-zero estimate`` count);
    a bare number is bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise ValueError(f"memory size must be positive, got {text}")
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"cannot read memory size {text!r} (examples: 24GB, 24GiB, 80e9)")
    value = float(m.group(1)) * _UNIT[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return int(value)


def memory_cap_fraction(cap_bytes: int, total_bytes: int) -> float:
    """The ``torch.cuda.set_per_process_memory_fraction`` value that caps a process at ``cap_bytes``
    on a card of ``total_bytes`` (``torch.cuda.get_device_properties(d).total_memory``).

    The caching allocator refuses allocations beyond ``fraction x total_memory``; the CUDA context
    and NCCL's own buffers are outside it, as they are outside a real card's usable memory only in
    part, so the emulated card is slightly more generous than a real one (a few hundred MiB).

    >>> round(memory_cap_fraction(24 * 2**30, 80 * 2**30), 4)
    0.3
    """
    if cap_bytes <= 0 or total_bytes <= 0:
        raise ValueError(f"cap and total memory must be positive, got cap={cap_bytes}, total={total_bytes}")
    if cap_bytes > total_bytes:
        raise ValueError(
            f"cannot emulate a {cap_bytes / GiB:.1f} GiB card on one with {total_bytes / GiB:.1f} GiB: the cap exceeds the card"
        )
    return cap_bytes / total_bytes


def is_out_of_memory(text: str) -> bool:
    """Whether a run's error text is an accelerator out-of-memory error (torch's or DeepSpeed's wording)."""
    return any(key in str(text) for key in ("OutOfMemoryError", "CUDA out of memory", "out of memory"))


def cap_verdict(result: dict[str, Any], cap_bytes: int | None) -> str | None:
    """Whether a configuration fits the emulated card of ``cap_bytes``, from what its run showed.

    A run under the cap answers by finishing (``yes``) or by running out of memory (``no``); a run
    exempted from the cap (``gpu_memory_cap_bytes`` None in the result) answers by its peak
    allocated memory against the cap. None when there is no cap or the run says nothing (it failed
    for another reason, or was not run).

    >>> cap_verdict({"status": "ok", "gpu_memory_cap_bytes": None, "peak_accel_bytes": 30 * GiB}, 24 * GiB)
    'no: peak 30.00 GiB without the cap'
    """
    if not cap_bytes:
        return None
    capped = result.get("gpu_memory_cap_bytes") is not None
    status = result.get("status")
    if status == "ok":
        if capped:
            return "yes: ran under the cap"
        peak = result.get("peak_accel_bytes")
        if peak is None:
            return None
        return f"{'yes' if peak <= cap_bytes else 'no'}: peak {peak / GiB:.2f} GiB without the cap"
    if status == "failed" and capped and is_out_of_memory(result.get("error", "")):
        return "no: out of memory under the cap"
    return None


# --------------------------------------------------------------------------------------- measurements
def step_stats(step_times: Sequence[float], warmup: int) -> dict[str, float | int]:
    """Median/min/max/mean of the step times after dropping the first ``warmup`` steps.

    Raises ValueError when nothing is left to measure.
    """
    measured = list(step_times[warmup:])
    if not measured:
        raise ValueError(f"no step left to measure: {len(step_times)} step(s), {warmup} warm-up")
    return {
        "steps_measured": len(measured),
        "median_s": statistics.median(measured),
        "min_s": min(measured),
        "max_s": max(measured),
        "mean_s": statistics.fmean(measured),
        "total_s": math.fsum(measured),
    }


def tokens_per_second(tokens_per_step: int, stats: dict[str, float | int]) -> float:
    """Throughput over the measured steps: tokens of all ranks in one optimizer step x steps / time."""
    return tokens_per_step * stats["steps_measured"] / stats["total_s"]


def memory_metric(result: dict[str, Any]) -> tuple[str, float | None]:
    """The memory figure compared across configurations: peak accelerator memory of the busiest
    rank when there is one, else the node's peak host RSS above the import baseline."""
    if result.get("peak_accel_bytes") is not None:
        return "peak accelerator memory (busiest rank)", result["peak_accel_bytes"]
    if result.get("rss_over_baseline_bytes") is not None:
        return "peak host RSS above import baseline (node)", result["rss_over_baseline_bytes"]
    return "memory", None


def ratio(value: float | None, reference: float | None) -> float | None:
    """``value / reference``, or None when either is missing or the reference is zero."""
    if value is None or reference is None or reference == 0:
        return None
    return value / reference


def compute_ratios(results: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """For every result, throughput and memory divided by those of each alternative that ran.

    Returns ``{name: {alternative_name: {"speed": x, "memory": y}}}``; ``speed`` > 1 means faster
    than the alternative, ``memory`` < 1 means less memory. Failed runs get no ratios and are no
    reference.
    """
    ok = [r for r in results if r.get("status") == "ok"]
    references = [r for r in ok if r["kind"] in ALTERNATIVE_KINDS]
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for r in ok:
        row = {}
        for ref in references:
            row[ref["name"]] = {
                "speed": ratio(r.get("tokens_per_s"), ref.get("tokens_per_s")),
                "memory": ratio(memory_metric(r)[1], memory_metric(ref)[1]),
            }
        out[r["name"]] = row
    return out


def pick_round(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The result a row reports when a configuration ran several rounds: the fastest successful
    round, with every round's tokens/s beside it (``rounds_tokens_per_s``); the last failure when
    no round succeeded."""
    if not rounds:
        raise ValueError("no round to pick from")
    ok = [r for r in rounds if r.get("status") == "ok"]
    if not ok:
        return dict(rounds[-1])
    best = dict(max(ok, key=lambda r: r["tokens_per_s"]))
    best["rounds_tokens_per_s"] = [r["tokens_per_s"] for r in ok]
    best["rounds_failed"] = len(rounds) - len(ok)
    return best


def fmt_tokens_per_s(result: dict[str, Any]) -> str:
    """``1234``, or ``1234 (1100)`` = best (median of the rounds) when there were several."""
    text = f"{result['tokens_per_s']:.0f}"
    rounds = result.get("rounds_tokens_per_s") or []
    if len(rounds) > 1:
        text += f" ({statistics.median(rounds):.0f})"
    return text


# --------------------------------------------------------------------------------------- rendering
def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.0f} MiB"


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def results_table(results: Sequence[dict[str, Any]]) -> str:
    """One row per configuration: throughput, step times, memory, loss (or why it failed)."""
    several = any(len(r.get("rounds_tokens_per_s") or []) > 1 for r in results)
    header = [
        "configuration", "tokens/s, best (median)" if several else "tokens/s", "step median (s)", "step min (s)", "step max (s)",
        "peak accel mem (max rank)", "peak host RSS (node)", "RSS over baseline (node)", "final loss",
    ]
    rows = []
    for r in results:
        if r.get("status") != "ok":
            rows.append([r["label"], f"**{r.get('status', 'failed')}**: {short_error(r.get('error', ''))}"] + [""] * 7)
            continue
        rows.append([
            r["label"],
            fmt_tokens_per_s(r),
            f"{r['step_median_s']:.3f}",
            f"{r['step_min_s']:.3f}",
            f"{r['step_max_s']:.3f}",
            fmt_bytes(r.get("peak_accel_bytes")),
            fmt_bytes(r.get("peak_rss_node_bytes")),
            fmt_bytes(r.get("rss_over_baseline_bytes")),
            "n/a" if r.get("final_loss") is None else f"{r['final_loss']:.4f}",
        ])
    return markdown_table(header, rows)


def ratio_table(results: Sequence[dict[str, Any]]) -> str:
    """Speed and memory of each configuration relative to each alternative that ran.

    A cell is ``speed / memory``: ``1.20x / 0.50x`` = 1.2 times the alternative's tokens/s with half
    its memory (accelerator memory on a GPU, host RSS above the import baseline on a CPU).
    """
    ratios = compute_ratios(results)
    by_name = {r["name"]: r for r in results}
    refs = [r for r in results if r.get("status") == "ok" and r["kind"] in ALTERNATIVE_KINDS]
    if not refs:
        return "(no alternative ran: no ratios)"
    header = ["configuration"] + [f"vs {ref['label']} (speed / mem)" for ref in refs]
    rows = []
    for name, per_ref in ratios.items():
        rows.append([by_name[name]["label"]] + [
            f"{fmt_ratio(per_ref[ref['name']]['speed'])} / {fmt_ratio(per_ref[ref['name']]['memory'])}" for ref in refs
        ])
    return markdown_table(header, rows)


def short_error(text: str, limit: int = 160) -> str:
    """The most telling line of a failure's output (an exception line, an OOM), shortened."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    keys = ("OutOfMemoryError", "out of memory", "Error:", "Error", "Exception", "Killed", "timed out")
    for key in keys:
        hits = [ln for ln in lines if key in ln]
        if hits:
            line = hits[-1]
            break
    else:
        line = lines[-1] if lines else "no output"
    return line if len(line) <= limit else line[: limit - 3] + "..."


@dataclass
class RunSettings:
    """The workload every configuration runs (recorded with the results)."""

    preset: str | None
    shape: dict[str, Any]
    params: int
    seq_len: int
    micro_batch: int
    grad_accum: int
    steps: int
    warmup_steps: int
    nproc_per_node: int
    dtype: str
    lora_rank: int | None = None
    gradient_checkpointing: bool = False
    gpu_memory_cap_bytes: int | None = None
    learning_rate: float = 3e-4
    seed: int = 42
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.micro_batch * self.grad_accum * self.nproc_per_node

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_step": self.tokens_per_step}
