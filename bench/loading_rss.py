"""Peak host memory (RSS) of loading a model for ZeRO-3 on N ranks, with and without hf_zero's
low-memory loading (meta model on LOCAL_RANK != 0, shards filled from rank 0).

    python bench/loading_rss.py --hidden 1024 --layers 8 --nproc 2

Creates a Qwen2-shaped random model (saved as safetensors in a temporary directory), then runs
``torchrun --nproc_per_node N`` twice on CPU/gloo (or NCCL when CUDA is there): once loading with
plain ``AutoModelForCausalLM.from_pretrained`` on every rank, once inside
``hf_zero.engine.materialize.low_memory_loading()``; both shard the model with
``hf_zero.initialize`` at stage 3. Reported per rank: RSS after imports, after loading and after
sharding, and the peak (``VmHWM``, which counts file pages of the memory-mapped checkpoint that the
rank touched as well as its own allocations); per node: the sum of the ranks' peaks and the peak
of the ranks' summed RSS, sampled every 10 ms by this process. Prints a Markdown table; ``--json``
writes the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MiB = 1024 * 1024


# ------------------------------------------------------------------------------------ /proc helpers
def _status_kib(pid: int | str = "self") -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                    out[key] = int(rest.split()[0])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return out


def _worker_pids(marker: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if marker.encode() in cmd and b"--worker" in cmd and b"torch.distributed.run" not in cmd:
            pids.append(int(entry))
    return pids


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class _NodeSampler(threading.Thread):
    """Samples the worker processes (those with ``marker`` on their command line) every 10 ms:
    peak of their summed RSS and summed PSS (shared pages, e.g. the page cache of a checkpoint
    that several ranks memory-map, split between them), and each one's peak anonymous RSS."""

    def __init__(self, marker: str, out: Path):
        super().__init__(daemon=True)
        self.marker, self.out, self.stop = marker, out, threading.Event()
        self.peak_rss_kib = self.peak_pss_kib = 0
        self.peak_anon_kib: dict[int, int] = {}

    def run(self) -> None:
        pids: list[int] = []
        last_scan = 0.0
        while not self.stop.is_set():
            now = time.monotonic()
            if now - last_scan > 0.5:
                pids, last_scan = _worker_pids(self.marker), now
            rss = pss = 0
            pids = [p for p in pids if not (self.out / f"{p}.measured").exists()]  # past its last mark
            for pid in pids:
                st = _status_kib(pid)
                rss += st.get("VmRSS", 0)
                pss += _pss_kib(pid)
                self.peak_anon_kib[pid] = max(self.peak_anon_kib.get(pid, 0), st.get("RssAnon", 0))
            self.peak_rss_kib = max(self.peak_rss_kib, rss)
            self.peak_pss_kib = max(self.peak_pss_kib, pss)
            time.sleep(0.01)


# ------------------------------------------------------------------------------------ worker (a rank)
def _integrate_stage() -> str:
    """The stage-3 wrap this bench measures must be hf_zero's own (it fills meta shards from rank 0)."""
    import inspect

    from hf_zero.engine import stages

    if "sharded_from_rank0" not in inspect.getsource(stages.FullyShardedStage.wrap):
        raise SystemExit("FullyShardedStage.wrap does not call sharded_from_rank0: nothing to measure")
    return "stages.py"


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import hf_zero
    from hf_zero.distributed.env import init_distributed
    from hf_zero.engine.materialize import has_meta_params, low_memory_loading

    env = init_distributed()
    integration = _integrate_stage()
    marks = {"after_import": _status_kib()}
    dist.barrier()
    t0 = time.perf_counter()
    if args.mode == "low_memory":
        with low_memory_loading():
            model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.torch_dtype))
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.torch_dtype))
    load_s = time.perf_counter() - t0
    meta = has_meta_params(model)
    marks["after_load"] = _status_kib()
    dist.barrier()
    t0 = time.perf_counter()
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "bf16": {"enabled": args.torch_dtype == "bfloat16"}}
    hf_zero.initialize(model, config)
    shard_s = time.perf_counter() - t0
    marks["after_shard"] = _status_kib()
    peak = marks["after_shard"]["VmHWM"]
    Path(args.out, f"{os.getpid()}.measured").touch()  # the driver's sampler stops watching this rank
    # A cheap correctness probe (no full tensor): the sum of every shard, summed over ranks.
    probe = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        probe += local.detach().sum(dtype=torch.float64).cpu()
    dist.all_reduce(probe)
    probe = float(probe)
    result = {
        "rank": env.rank, "pid": os.getpid(), "local_rank": env.local_rank, "mode": args.mode, "meta_after_load": meta,
        "marks_kib": marks, "peak_kib": peak, "load_s": load_s, "shard_s": shard_s,
        "probe": probe, "stage_integration": integration,
    }
    Path(args.out, f"rank{env.rank}.json").write_text(json.dumps(result))
    dist.barrier()


# ------------------------------------------------------------------------------------ driver
def make_model(args, directory: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate or int(args.hidden * 2.75),
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=2048, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.checkpoint_dtype))
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(directory)
    size = sum(f.stat().st_size for f in Path(directory).glob("*.safetensors"))
    del model
    return {"params": n, "fp32_bytes": 4 * n, "checkpoint_bytes": size}


def run_mode(args, model_dir: str, mode: str, workdir: str) -> dict:
    out = Path(workdir, mode)
    out.mkdir(parents=True, exist_ok=True)
    marker = f"--marker={mode}-{os.getpid()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           __file__, "--worker", marker, f"--mode={mode}", f"--model_dir={model_dir}", f"--out={out}",
           f"--torch_dtype={args.torch_dtype}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    sampler = _NodeSampler(marker, out)
    sampler.start()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    sampler.stop.set()
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"{mode} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    for r in ranks:
        r["sampled_peak_anon_kib"] = sampler.peak_anon_kib.get(r["pid"], 0)
    return {"mode": mode, "ranks": ranks, "node_peak_rss_kib": sampler.peak_rss_kib,
            "node_peak_pss_kib": sampler.peak_pss_kib, "wall_s": wall}


def _mib(kib: int) -> str:
    return f"{kib / 1024:,.0f}"


def report(info: dict, runs: list[dict], command: str) -> str:
    lines = [
        f"Model: Qwen2-shaped, {info['params'] / 1e6:.1f}M parameters, fp32 size {info['fp32_bytes'] / MiB:,.0f} MiB, "
        f"checkpoint {info['checkpoint_bytes'] / MiB:,.0f} MiB ({info['checkpoint_dtype']}), loaded as {info['dtype']}, "
        f"{info['nproc']} ranks. Command: `{command}`",
        "",
        "Per rank (MiB):",
        "",
        "| loading | rank | meta after load | RSS after import | after load | after shard | peak RSS (VmHWM) "
        "| peak anon RSS (sampled) | load s | shard s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        for r in run["ranks"]:
            m = r["marks_kib"]
            lines.append(
                f"| {run['mode']} | {r['rank']} | {r['meta_after_load']} | {_mib(m['after_import']['VmRSS'])} | "
                f"{_mib(m['after_load']['VmRSS'])} | {_mib(m['after_shard']['VmRSS'])} | {_mib(r['peak_kib'])} | "
                f"{_mib(r['sampled_peak_anon_kib'])} | {r['load_s']:.2f} | {r['shard_s']:.2f} |"
            )
    lines += ["", "Per node (MiB; all ranks of the run):", "",
              "| loading | sum of rank peak RSS | same, minus RSS after import | peak of summed RSS (sampled) "
              "| peak of summed PSS (sampled) | wall s |", "|---|---|---|---|---|---|"]
    for run in runs:
        total_peak = sum(r["peak_kib"] for r in run["ranks"])
        imports = sum(r["marks_kib"]["after_import"]["VmRSS"] for r in run["ranks"])
        lines.append(f"| {run['mode']} | {_mib(total_peak)} | {_mib(total_peak - imports)} | "
                     f"{_mib(run['node_peak_rss_kib'])} | {_mib(run['node_peak_pss_kib'])} | {run['wall_s']:.1f} |")
    lines.append("")
    lines.append("(stage integration: " + runs[-1]["ranks"][0]["stage_integration"] + ")")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=0, help="MLP width (default 2.75 x hidden)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv_heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--torch_dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype= for from_pretrained; bfloat16 also enables bf16 training (fp32 master shards)")
    p.add_argument("--checkpoint_dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype the random model is saved in")
    p.add_argument("--modes", default="baseline,low_memory")
    p.add_argument("--json", default=None, help="write the raw numbers here")
    # worker-only
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--marker", default="", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="baseline", help=argparse.SUPPRESS)
    p.add_argument("--model_dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return
    command = "python bench/loading_rss.py " + " ".join(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="hf_zero_loading_") as tmp:
        model_dir = os.path.join(tmp, "model")
        info = {**make_model(args, model_dir), "dtype": args.torch_dtype, "checkpoint_dtype": args.checkpoint_dtype,
                "nproc": args.nproc}
        runs = [run_mode(args, model_dir, mode, tmp) for mode in args.modes.split(",")]
    probes = {r["probe"] for run in runs for r in run["ranks"]}
    text = report(info, runs, command)
    print(text)
    if len(probes) != 1:
        raise SystemExit(f"ranks/modes disagree on the gathered weights: {probes}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": info, "runs": runs, "command": command}, indent=1))


if __name__ == "__main__":
    main()
