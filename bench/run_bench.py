"""Side-by-side fine-tune: hf_zero stages 0-3 and offload against plain DDP, FSDP2 and DeepSpeed.

    python bench/run_bench.py --preset tiny --seq_len 128 --micro_batch 2 --steps 20 --nproc_per_node 2 \
        --deepspeed_python /tmp/ds-venv/bin/python

One command runs the same fine-tune (a Qwen2-shaped model with random weights, saved once; synthetic
token data; the Hugging Face ``Trainer`` loop) under every configuration asked for, each as its own
``torchrun --nproc_per_node N`` job of ``bench/_bench_worker.py`` (gloo on CPU, NCCL on GPUs):

* ``ddp``: plain ``Trainer`` (what runs without any ZeRO flag);
* ``fsdp2``: ``Trainer`` with ``--fsdp`` (accelerate's FSDP2, ``reshard_after_forward=True``);
* ``zero0``..``zero3``, ``zero2_opt_cpu``, ``zero3_opt_cpu_param_cpu``, ``zero3_opt_nvme``, ...: hf_zero's ``ZeroTrainer``;
* ``ds2``, ``ds3``, ...: ``Trainer --deepspeed`` with the same JSON, in a Python where
  ``import deepspeed`` works (``--deepspeed_python``; DeepSpeed is never a dependency of hf_zero).

It prints a Markdown table (tokens/s, step time median/min/max after the warm-up steps, peak
accelerator memory, peak host RSS per node and its part above the import baseline, final loss),
a table of ratios against each alternative that ran, and writes ``<out>/<tag>.json``,
``<out>/<tag>.md`` and ``<out>/<tag>.png`` (bars of tokens/s and memory). A tqdm bar shows
progress over the configurations; each run's output goes to a log file named in the JSON.

``--gpu_memory_cap 24GB`` caps every rank's CUDA caching allocator at 24 GiB
(``torch.cuda.set_per_process_memory_fraction``) to emulate 24 GB cards on a larger GPU.
See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import _bench_lib as lib  # noqa: E402
from _bench_report import render_markdown, save_plot  # noqa: E402

# The driver builds the ZeRO JSON with hf_zero's own "auto" rules: make the working tree importable
# without an install (the GPU session runs from a bare checkout: nothing can be pip-installed there).
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))

WORKER = HERE / "_bench_worker.py"


# ------------------------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python bench/run_bench.py",
        description="Run the same Trainer fine-tune under hf_zero stages/offload and under DDP, FSDP2 and DeepSpeed; "
        "report tokens/s, step times and peak memory side by side.",
    )
    m = p.add_argument_group("model (Qwen2-shaped, random weights)")
    m.add_argument("--preset", choices=sorted(lib.PRESETS), default=None, help="a named shape (default: tiny)")
    m.add_argument("--hidden", type=int, help="hidden size (overrides the preset)")
    m.add_argument("--layers", type=int, help="decoder layers")
    m.add_argument("--heads", type=int, help="attention heads")
    m.add_argument("--kv_heads", type=int, help="key/value heads (default: heads)")
    m.add_argument("--intermediate", type=int, help="MLP size (default: about 2.7 x hidden)")
    m.add_argument("--vocab", type=int, help="vocabulary size")
    m.add_argument("--untied", action="store_true", help="separate LM head (tied by default except the 7b preset)")
    w = p.add_argument_group("workload")
    w.add_argument("--seq_len", type=int, default=128)
    w.add_argument("--micro_batch", type=int, default=2, help="per-device batch (per_device_train_batch_size)")
    w.add_argument("--grad_accum", type=int, default=1)
    w.add_argument("--steps", type=int, default=20, help="optimizer steps per configuration")
    w.add_argument("--warmup_steps", type=int, default=3, help="first steps left out of the timing")
    w.add_argument("--nproc_per_node", type=int, default=2)
    w.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="bf16 mixed precision (default) or fp32")
    w.add_argument("--lora_rank", type=int, default=None, help="train LoRA adapters (peft, all-linear) instead of the full model")
    w.add_argument("--gradient_checkpointing", action="store_true")
    w.add_argument("--learning_rate", type=float, default=3e-4)
    w.add_argument("--seed", type=int, default=42)
    c = p.add_argument_group("configurations")
    c.add_argument(
        "--configs",
        default="default",
        help="comma-separated names (ddp, fsdp2, zero0..zero3[_opt_cpu|_opt_nvme][_param_cpu|_param_nvme], ds0..ds3[...]) "
        f"or groups ({', '.join(lib.CONFIG_GROUPS)}); default: {','.join(lib.DEFAULT_CONFIGS)}",
    )
    c.add_argument("--deepspeed_python", default=None, help="a Python whose environment imports deepspeed (e.g. /tmp/ds-venv/bin/python)")
    c.add_argument(
        "--one_python", action="store_true",
        help="run every configuration with --deepspeed_python's interpreter (hf_zero from this checkout on its path), "
        "so that host RSS compares engines, not environments: transformers.trainer alone imported 208 MiB in the "
        "project's venv and 126 MiB in a DeepSpeed venv of the same versions (packages it imports when installed)",
    )
    c.add_argument("--nvme_path", default=None, help="folder for NVMe offload swap files (default: a temporary folder)")
    c.add_argument("--sub_group_size", type=int, default=None, help="zero_optimization.sub_group_size for every ZeRO config")
    c.add_argument("--gpu_memory_cap", default=None, help="emulate cards of this size, e.g. 24GB (CUDA only)")
    c.add_argument(
        "--uncapped", default="",
        help="comma-separated configurations that run without --gpu_memory_cap (their peak is then compared with "
        "the cap: 'fits' in the JSON); for rows that cannot fit, so that their speed is still measured",
    )
    c.add_argument(
        "--malloc_mmap_threshold", type=int, default=None,
        help="set glibc's MALLOC_MMAP_THRESHOLD_ (e.g. 65536) in the workers so that freed tensors leave the RSS "
        "(peak RSS then follows live bytes rather than heap fragmentation)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--out", default=str(HERE / "results"), help="folder for <tag>.json/.md/.png (default bench/results)")
    o.add_argument("--tag", default=None, help="file name stem (default: <preset>-<device>-<N>rank)")
    o.add_argument("--work_dir", default=None, help="model, logs and scratch (default: a temporary folder, kept)")
    o.add_argument("--timeout", type=float, default=1200, help="seconds per configuration")
    o.add_argument(
        "--deadline", type=float, default=None,
        help="wall-clock time (seconds since the epoch) by which every configuration must have ended: each run's "
        "timeout is cut to what is left, and a configuration with less than --min_run_s left is skipped "
        "(reported as such); the results are written after every configuration either way",
    )
    o.add_argument("--min_run_s", type=float, default=30.0, help="with --deadline: the least time worth starting a run in")
    o.add_argument(
        "--repeat", type=int, default=1,
        help="rounds over all configurations (round-robin); each row reports its fastest round, "
        "tokens/s shows 'best (median of rounds)'. Use 3 on a shared machine.",
    )
    c.add_argument(
        "--overlap_comm", choices=("auto", "true", "false"), default="auto",
        help="zero_optimization.overlap_comm in the JSON (hf_zero ignores it; DeepSpeed overlaps its reduction "
        "when true, its default for stage 3 and what Hugging Face's ZeRO-3 example sets); auto: true with CUDA, "
        "false on CPU (gloo)",
    )
    o.add_argument("--no_plot", action="store_true")
    o.add_argument(
        "--memory_profile", type=int, default=None, metavar="STEP",
        help="CUDA only: record per-phase peaks (forward, backward, step) every step and the allocator history of "
        "optimizer step STEP; each run writes memory_profile.json/.md (the blocks alive at the peak) to its folder",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line; fills ``args.shape`` (the model shape) and ``args.cap_bytes``."""
    p = build_parser()
    args = p.parse_args(argv)
    args.shape = resolve_shape(args, p)
    for name in ("seq_len", "micro_batch", "grad_accum", "steps", "nproc_per_node", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.warmup_steps < 0 or args.warmup_steps >= args.steps:
        p.error(f"--warmup_steps must be in [0, --steps): got {args.warmup_steps} with --steps {args.steps}")
    args.cap_bytes = None
    if args.gpu_memory_cap:
        try:
            args.cap_bytes = lib.parse_size(args.gpu_memory_cap)
        except ValueError as exc:
            p.error(str(exc))
    try:
        lib.build_config_matrix(args.configs, deepspeed_available=True)
        args.uncapped_names = {c.name for c in lib.build_config_matrix(args.uncapped, deepspeed_available=True)[0]} if args.uncapped.strip() else set()
    except ValueError as exc:
        p.error(str(exc))
    if args.uncapped_names and not args.cap_bytes:
        p.error("--uncapped needs --gpu_memory_cap")
    return args


def resolve_shape(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> dict[str, Any]:
    """The model shape: the preset (default ``tiny``) with any explicit dimension replacing its value."""
    explicit = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab")}
    base = dict(lib.PRESETS[args.preset or "tiny"])
    if args.preset is None:
        args.preset = "custom" if any(v is not None for v in explicit.values()) else "tiny"
    for key, value in explicit.items():
        if value is not None:
            base[key] = value
    if explicit["heads"] is not None and explicit["kv_heads"] is None:
        base["kv_heads"] = explicit["heads"]
    if explicit["hidden"] is not None and explicit["intermediate"] is None:
        base["intermediate"] = int(round(base["hidden"] * 8 / 3 / 8)) * 8
    if args.untied:
        base["tie"] = False
    problems = []
    if base["hidden"] % base["heads"]:
        problems.append(f"hidden {base['hidden']} is not a multiple of heads {base['heads']}")
    if base["heads"] % base["kv_heads"]:
        problems.append(f"heads {base['heads']} is not a multiple of kv_heads {base['kv_heads']}")
    if problems:
        if parser is not None:
            parser.error("; ".join(problems))
        raise ValueError("; ".join(problems))
    return base


# ------------------------------------------------------------------------------------------- machine
def machine_info(python: str = sys.executable) -> dict[str, Any]:
    """CPU, memory, GPUs and library versions of this machine (what the results were measured on)."""
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["ram_bytes"] = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    try:
        import accelerate
        import torch
        import transformers

        info.update(torch=torch.__version__, transformers=transformers.__version__, accelerate=accelerate.__version__)
        info["cuda"] = torch.cuda.is_available()
        if info["cuda"]:
            info["gpus"] = [
                {"name": torch.cuda.get_device_name(i), "total_bytes": torch.cuda.get_device_properties(i).total_memory}
                for i in range(torch.cuda.device_count())
            ]
            info["cuda_version"] = torch.version.cuda
    except ImportError:
        info["cuda"] = False
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        info["hf_zero_commit"] = commit.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def deepspeed_python(requested: str | None) -> tuple[str | None, str | None]:
    """(python, deepspeed version) for the DeepSpeed runs, or (None, reason)."""
    candidates = [requested] if requested else []
    if not requested and importlib.util.find_spec("deepspeed") is not None:
        candidates.append(sys.executable)
    for py in candidates:
        try:
            proc = subprocess.run(
                [py, "-c", "import deepspeed, sys; sys.stdout.write(deepspeed.__version__)"],
                capture_output=True, text=True, timeout=300,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"{py}: {exc}"
        if proc.returncode == 0:
            return py, proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "?"
        return None, f"{py} cannot import deepspeed: {lib.short_error(proc.stderr)}"
    return None, "no --deepspeed_python given and deepspeed is not importable here"


# ------------------------------------------------------------------------------------------- model
def qwen2_config(shape: dict[str, Any]):
    from transformers import Qwen2Config

    return Qwen2Config(
        hidden_size=shape["hidden"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        intermediate_size=shape["intermediate"],
        vocab_size=shape["vocab"],
        tie_word_embeddings=shape.get("tie", True),
        max_position_embeddings=32768,
        use_cache=False,
    )


def prepare_model(shape: dict[str, Any], work_dir: Path, seed: int = 0) -> Path:
    """A random Qwen2 model of ``shape`` saved (bf16 safetensors) under ``work_dir``; reused if there.

    Built on the GPU when there is one: the random initialisation of a 7B model takes minutes on
    CPU cores and seconds on a GPU, and a lent GPU's minutes are the scarce resource.
    """
    key = hashlib.sha1(json.dumps([shape, seed], sort_keys=True).encode()).hexdigest()[:10]
    path = work_dir / f"model-{key}"
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(qwen2_config(shape), dtype=torch.bfloat16)
    tmp = work_dir / f".model-{key}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the workers, not this driver, should hold the card
    tmp.rename(path)
    return path


# ------------------------------------------------------------------------------------------- running
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _overlap_comm(args: argparse.Namespace) -> bool:
    choice = getattr(args, "overlap_comm", "auto")
    if choice == "auto":
        import torch

        return torch.cuda.is_available()
    return choice == "true"


def worker_spec(config: lib.BenchConfig, args: argparse.Namespace, model_dir: Path, result_dir: Path, nvme_root: Path) -> dict[str, Any]:
    """What one worker job needs (written as SPEC.json)."""
    spec: dict[str, Any] = {
        "name": config.name,
        "kind": config.kind,
        "repo": str(REPO),
        "model_dir": str(model_dir),
        "result_dir": str(result_dir),
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum,
        "steps": args.steps,
        "learning_rate": args.learning_rate,
        "seed": args.seed,
        "dtype": args.dtype,
        "lora_rank": args.lora_rank,
        "gradient_checkpointing": args.gradient_checkpointing,
        "gpu_memory_cap_bytes": None if config.name in getattr(args, "uncapped_names", ()) else args.cap_bytes,
        "layer_cls": ["Qwen2DecoderLayer"],
        "memory_profile": getattr(args, "memory_profile", None),
    }
    if config.stage is not None:
        nvme = None
        if config.uses_nvme:
            nvme = nvme_root / config.name
            nvme.mkdir(parents=True, exist_ok=True)
        spec["zero_config"] = lib.zero_config_dict(config, nvme_path=str(nvme) if nvme else None, sub_group_size=args.sub_group_size,
                                                   overlap_comm=_overlap_comm(args))
    return spec


def run_config(config: lib.BenchConfig, args: argparse.Namespace, python: str, model_dir: Path, work_dir: Path,
               round_index: int = 0, timeout: float | None = None) -> dict[str, Any]:
    """Run one configuration under torchrun; return its aggregated result (status ok/failed/timeout)."""
    timeout = args.timeout if timeout is None else timeout
    result_dir = work_dir / "runs" / (config.name if args.repeat == 1 else f"{config.name}.round{round_index}")
    shutil.rmtree(result_dir, ignore_errors=True)
    result_dir.mkdir(parents=True)
    spec = worker_spec(config, args, model_dir, result_dir, work_dir / "nvme")
    spec_path = result_dir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    log_path = result_dir / "log.txt"
    cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc_per_node),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(WORKER), str(spec_path)]
    threads = max(1, (os.cpu_count() or 1) // args.nproc_per_node)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "PYTHONUNBUFFERED": "1"}
    if args.malloc_mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    if config.kind == "hf_zero":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    status, error = "ok", ""
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        returncode = lib.run_process_group(cmd, stdout=log, env=env, cwd=REPO, timeout=timeout)
        if returncode is None:
            status, error = "timeout", f"timed out after {timeout:.0f} s"
        elif returncode != 0:
            status = "failed"
    wall = time.perf_counter() - t0
    records = [json.loads(p.read_text()) for p in sorted(result_dir.glob("rank*.json"))]
    exit_note = None
    if status == "failed" and len(records) == args.nproc_per_node and all(r.get("status") == "ok" for r in records):
        # Every rank trained and wrote its results; the job failed on the way out.
        status = "ok"
        exit_note = f"torchrun exited {returncode} after every rank had finished training: {lib.short_error(log_path.read_text()[-4000:])}"
    if status == "failed":
        rank_errors = [r.get("error", "") for r in records if r.get("status") == "failed"]
        error = rank_errors[0] if rank_errors else log_path.read_text()[-4000:]
    result = aggregate(config, records, args, status=status, error=error)
    result.update(wall_s=wall, log=str(log_path), command=" ".join(cmd), python=python,
                  gpu_memory_cap_bytes=spec["gpu_memory_cap_bytes"])
    if exit_note:
        result["exit_note"] = exit_note
    return result


def aggregate(config: lib.BenchConfig, records: list[dict[str, Any]], args: argparse.Namespace, *, status: str = "ok", error: str = "") -> dict[str, Any]:
    """Combine the ranks' records: the slowest rank per step, RSS summed per node, the busiest GPU."""
    base: dict[str, Any] = {"name": config.name, "label": config.label(), "kind": config.kind, "stage": config.stage,
                            "offload_optimizer": config.offload_optimizer, "offload_param": config.offload_param}
    ok = [r for r in records if r.get("status") == "ok"]
    if status == "ok" and len(ok) != args.nproc_per_node:
        status, error = "failed", error or f"{len(ok)} of {args.nproc_per_node} ranks reported"
    if status != "ok":
        peaks = [r.get("peak_rss_bytes") for r in records if r.get("peak_rss_bytes")]
        return {**base, "status": status, "error": error, "peak_rss_node_bytes": sum(peaks) if peaks else None}
    steps = min(len(r["step_times_s"]) for r in ok)
    step_times = [max(r["step_times_s"][i] for r in ok) for i in range(steps)]
    stats = lib.step_stats(step_times, args.warmup_steps)
    tokens_per_step = args.seq_len * args.micro_batch * args.grad_accum * len(ok)
    nodes: dict[str, list[dict[str, Any]]] = {}
    for r in ok:
        nodes.setdefault(r["node"], []).append(r)
    node_peak = max(sum(r["peak_rss_bytes"] for r in rs) for rs in nodes.values())
    node_base = max(sum(r["baseline_rss_bytes"] for r in rs) for rs in nodes.values())
    accel = [r.get("peak_accel_bytes") for r in ok]
    rank0 = min(ok, key=lambda r: r["rank"])
    return {
        **base,
        "status": "ok",
        "world_size": len(ok),
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": lib.tokens_per_second(tokens_per_step, stats),
        "step_median_s": stats["median_s"],
        "step_min_s": stats["min_s"],
        "step_max_s": stats["max_s"],
        "step_mean_s": stats["mean_s"],
        "steps_measured": stats["steps_measured"],
        "step_times_s": step_times,
        "peak_accel_bytes": max(accel) if all(a is not None for a in accel) else None,
        "peak_accel_per_rank_bytes": accel,
        "peak_rss_node_bytes": node_peak,
        "baseline_rss_node_bytes": node_base,
        "rss_over_baseline_bytes": node_peak - node_base,
        "peak_rss_per_rank_bytes": [r["peak_rss_bytes"] for r in sorted(ok, key=lambda r: r["rank"])],
        "final_loss": rank0.get("final_loss"),
        "losses": rank0.get("losses"),
        "params": rank0.get("params"),
        "trainable_params": rank0.get("trainable_params"),
        "optimizer": rank0.get("optimizer"),
        "versions": {k: rank0.get(k) for k in ("torch_version", "transformers_version", "deepspeed_version") if rank0.get(k)},
        "engine_memory_report_rank0": rank0.get("engine_memory_report"),
        "gpu_memory_fraction": rank0.get("gpu_memory_fraction"),
        "distributed_type": rank0.get("distributed_type"),
        "wrapped_model": rank0.get("wrapped_model"),
        **({"deepspeed_engine": rank0["deepspeed_engine"]} if rank0.get("deepspeed_engine") else {}),
        **({"memory_phases": phases} if (phases := _memory_phases(ok)) else {}),
        **({"warning": "the Trainer did not shard the model (no FSDP module): it ran DDP"}
           if config.kind == "fsdp2" and not rank0.get("fsdp2_modules") else {}),
    }


def _memory_phases(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    from _memory_profile import phase_summary

    return phase_summary(records)


def add_estimates(results: list[dict[str, Any]], model_dir: Path, args: argparse.Namespace, cuda: bool) -> None:
    """hf_zero's estimate next to each hf_zero result: per GPU on CUDA; on CPU every tier of the node
    (the "GPU" is the host there, so the per-GPU bytes of each rank and the host bytes add up)."""
    try:
        from hf_zero.estimator import estimate_memory
    except ImportError:
        return
    try:
        rows = estimate_memory(
            str(model_dir), num_gpus=args.nproc_per_node, dtype=args.dtype, lora_rank=args.lora_rank,
            micro_batch_size=args.micro_batch, seq_len=args.seq_len, gradient_checkpointing=args.gradient_checkpointing,
        )
    except Exception as exc:  # the estimate is an extra column
        for r in results:
            r["estimate_error"] = repr(exc)
        return
    by_choice = {(row["stage"], row["offload_optimizer"], row["offload_param"]): row for row in rows}
    for r in results:
        if r["kind"] != "hf_zero":
            continue
        row = by_choice.get((r["stage"], r["offload_optimizer"], r["offload_param"]))
        if row is None:
            continue
        r["estimate_row"] = row
        r["estimate_bytes"] = row["gpu_bytes"] if cuda else args.nproc_per_node * row["gpu_bytes"] + row["cpu_bytes"]


# ------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ds_python, ds_info = deepspeed_python(args.deepspeed_python)
    configs, notes = lib.build_config_matrix(args.configs, deepspeed_available=ds_python is not None)
    if ds_python is None and any(n.startswith("DeepSpeed") for n in notes):
        notes.append(f"DeepSpeed: {ds_info}")
    machine = machine_info()
    if args.cap_bytes and not machine.get("cuda"):
        notes.append(f"--gpu_memory_cap {args.gpu_memory_cap} has no effect: no CUDA device on this machine")
        print(f"[bench] note: {notes[-1]}", file=sys.stderr)
    if args.cap_bytes and machine.get("gpus"):
        lib.memory_cap_fraction(args.cap_bytes, min(g["total_bytes"] for g in machine["gpus"]))  # fails early
    if machine.get("cuda") and args.nproc_per_node > len(machine.get("gpus", [])):
        print(f"[bench] --nproc_per_node {args.nproc_per_node} needs as many GPUs (NCCL runs one rank per GPU); "
              f"this machine has {len(machine.get('gpus', []))}", file=sys.stderr)
        return 2
    machine["loadavg_start"] = os.getloadavg()
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="hf_zero_bench_"))
    work_dir.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "gpu" if machine.get("cuda") else "cpu"
    tag = args.tag or f"{args.preset}-{device}-{args.nproc_per_node}rank" + (f"-lora{args.lora_rank}" if args.lora_rank else "")

    print(f"[bench] preparing the {lib.qwen2_param_count(args.shape) / 1e6:.1f}M-parameter model in {work_dir}", file=sys.stderr)
    model_dir = prepare_model(args.shape, work_dir)
    settings = lib.RunSettings(
        preset=args.preset, shape=args.shape, params=lib.qwen2_param_count(args.shape), seq_len=args.seq_len,
        micro_batch=args.micro_batch, grad_accum=args.grad_accum, steps=args.steps, warmup_steps=args.warmup_steps,
        nproc_per_node=args.nproc_per_node, dtype=args.dtype, lora_rank=args.lora_rank,
        gradient_checkpointing=args.gradient_checkpointing, gpu_memory_cap_bytes=args.cap_bytes,
        learning_rate=args.learning_rate, seed=args.seed,
    )

    from tqdm.auto import tqdm

    command = "python bench/run_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    rounds: dict[str, list[dict[str, Any]]] = {c.name: [] for c in configs}
    jobs = [(i, c) for i in range(args.repeat) for c in configs]

    def payload() -> dict[str, Any]:
        # Rows that have not run yet are left out: the file written after each run is complete as far as it goes.
        results = [lib.pick_round(rounds[c.name]) for c in configs if rounds[c.name]]
        for r in results:
            r["fits_cap"] = lib.cap_verdict(r, args.cap_bytes if machine.get("cuda") else None)
        return {
            "command": command,
            "settings": settings.as_dict(),
            "machine": machine,
            "deepspeed_version": ds_info if ds_python else None,
            "configs": [c.name for c in configs],
            "uncapped": sorted(args.uncapped_names),
            "repeat": args.repeat,
            "malloc_mmap_threshold": args.malloc_mmap_threshold,
            "rounds": {name: [r.get("tokens_per_s") for r in rs] for name, rs in rounds.items()},
            "notes": notes,
            "results": results,
            "ratios": lib.compute_ratios(results),
            "work_dir": str(work_dir),
        }

    bar = tqdm(jobs, desc="bench", unit="run", file=sys.stderr, dynamic_ncols=True)
    for round_index, config in bar:
        bar.set_postfix_str(config.label() + (f" (round {round_index + 1}/{args.repeat})" if args.repeat > 1 else ""))
        python = ds_python if config.kind == "deepspeed" or (args.one_python and ds_python) else sys.executable
        timeout = args.timeout
        left = None if args.deadline is None else args.deadline - time.time()
        if left is not None and left < args.min_run_s:
            result = aggregate(config, [], args, status="skipped", error=f"not started: {max(left, 0):.0f} s left before the deadline")
            result["wall_s"] = 0.0
        else:
            if left is not None:
                timeout = min(timeout, left)
            result = run_config(config, args, python, model_dir, work_dir, round_index, timeout=timeout)
        rounds[config.name].append(result)
        state = f"{result['tokens_per_s']:.0f} tok/s" if result["status"] == "ok" else f"{result['status']}: {lib.short_error(result.get('error', ''), 80)}"
        bar.write(f"[bench] {config.label()}: {state} ({result['wall_s']:.0f} s)", file=sys.stderr)
        (out / f"{tag}.json").write_text(json.dumps(payload(), indent=1))
    bar.close()
    machine["loadavg_end"] = os.getloadavg()
    final = payload()
    add_estimates(final["results"], model_dir, args, bool(machine.get("cuda")))
    (out / f"{tag}.json").write_text(json.dumps(final, indent=1))
    md = render_markdown(final)
    (out / f"{tag}.md").write_text(f"`{command}`\n\n" + md)
    print(md)
    if not args.no_plot:
        png = save_plot(final, out / f"{tag}.png")
        if png:
            print(f"[bench] plot: {png}", file=sys.stderr)
    print(f"[bench] results: {out / (tag + '.json')}, {out / (tag + '.md')}; logs under {work_dir / 'runs'}", file=sys.stderr)
    return 0 if all(r["status"] == "ok" for r in final["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
