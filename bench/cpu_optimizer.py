"""AdamW step throughput on the CPU: hf_zero's offloaded optimizer vs torch's CPU AdamW vs memory bandwidth.

    python bench/cpu_optimizer.py [--numel 33554432] [--tensors 8] [--repeat 5] [--threads N ...] [--json out.json]

An AdamW step reads the parameter, gradient and both moments and writes back the parameter and
both moments: 7 fp32 values = 28 bytes per parameter. A step cannot be faster than the machine
moves those bytes, so the table gives each variant's parameters/s and the bandwidth it implies
(``28 B x params/s``) next to the best streaming bandwidth measured in the same rounds on tensors
of the same size: ``memcpy`` (``dst.copy_(src)``, 8 B per element) or STREAM's triad
(``a = b + s*c``, 12 B per element), whichever is higher.

Variants:

* ``torch fused``: ``torch.optim.AdamW(fused=True)`` (what ``build_optimizer`` builds).
* ``torch foreach``: ``torch.optim.AdamW(foreach=True)``.
* ``torch for-loop``: ``torch.optim.AdamW(foreach=False)``, the single-tensor reference path.
* ``hf_zero offload``: :class:`hf_zero.offload.OffloadedOptimizer` with ``device=cpu`` stepping
  fp32 host masters in ``sub_group_size`` chunks and copying each chunk back into 16-bit
  "device" parameters (here also in host memory: the copy-back is an extra 6 bytes/parameter
  that a GPU run overlaps with the next chunk's step). The gradient copy (``accumulate_grad``, what
  the backward hooks do) is timed separately.
* ``deepspeed cpu_adam``: DeepSpeed's ``DeepSpeedCPUAdam`` when it can be imported (it JIT-builds
  a C++ extension; skipped otherwise).

Every variant steps the same data; the first step (state allocation) is not timed. The variants
are timed round-robin and the best round is reported (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

ADAMW_BYTES_PER_PARAM = 28
"""fp32 AdamW traffic per parameter and step: read p, g, m, v (16 B), write p, m, v (12 B)."""


def make_tensors(numel: int, tensors: int, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    per = numel // tensors
    params = [torch.randn(per, generator=g) for _ in range(tensors)]
    grads = [torch.randn(per, generator=g) * 1e-3 for _ in range(tensors)]
    return params, grads


def setup_memcpy(numel: int):
    src = torch.randn(numel)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def setup_triad(numel: int):
    a, b, c = torch.empty(numel), torch.randn(numel), torch.randn(numel)
    return lambda: torch.add(b, c, alpha=0.5, out=a)  # STREAM triad: 2 reads + 1 write


def setup_torch(numel: int, tensors: int, **kwargs):
    params, grads = make_tensors(numel, tensors)
    ps = [torch.nn.Parameter(p) for p in params]
    for p, g in zip(ps, grads):
        p.grad = g
    opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, **kwargs)
    return opt.step


def setup_offload(numel: int, tensors: int, sub_group_size: int, copy_back: bool = True):
    """(step, gradient feed) of an OffloadedOptimizer over 16-bit "device" parameters."""
    from hf_zero.config.schema import OptimizerConfig
    from hf_zero.offload.cpu_optimizer import (
        HostOffloadConfig,
        OffloadedOptimizer,
        ParamPlan,
    )
    from hf_zero.optim.optimizers import build_optimizer

    params, grads = make_tensors(numel, tensors)
    device = [torch.nn.Parameter(p.to(torch.bfloat16)) for p in params]  # the 16-bit "device" shards
    cfg = OptimizerConfig(type="adamw", lr=1e-3, weight_decay=0.01)
    build = lambda groups: build_optimizer(cfg, groups)
    plan = ParamPlan(host=device, masters={id(d): p for d, p in zip(device, params)})
    # copy_back=False: what the CPU does on a GPU machine, where the copy to the device is a DMA
    # transfer overlapped with the next chunk (no CPU pass).
    writer = None if copy_back else (lambda param, start, values: None)
    opt = OffloadedOptimizer(build(device), build, {id(d): f"p{i}" for i, d in enumerate(device)},
                             HostOffloadConfig(device="cpu", sub_group_size=sub_group_size), plan,
                             param_writer=writer)

    def feed() -> None:
        for d, g in zip(device, grads):
            opt.accumulate_grad(d, g)

    def step() -> None:
        for slot in opt.slots:
            slot.fresh = False  # keep the gradients of the last feed
        opt.step()

    feed()
    return step, feed


def setup_deepspeed(numel: int, tensors: int):
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 -- not installed, or its C++ op cannot build here
        return None
    params, grads = make_tensors(numel, tensors)
    ps = [torch.nn.Parameter(p) for p in params]
    for p, g in zip(ps, grads):
        p.grad = g
    try:
        opt = DeepSpeedCPUAdam(ps, lr=1e-3, weight_decay=0.01, adamw_mode=True)
    except Exception:  # noqa: BLE001
        return None
    return opt.step


def run_rounds(fns: dict, rounds: int) -> dict[str, list[float]]:
    """Time every function once per round, round-robin, after one untimed call each (state
    allocation, page faults). Interleaving spreads load changes of a shared machine over all of
    them; the tables report the best round (the least disturbed) and the median."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs, torch {torch.__version__}, Python {platform.python_version()}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 24, help="parameters stepped (default 16M = 64 MiB fp32)")
    ap.add_argument("--tensors", type=int, default=8, help="split into this many tensors")
    ap.add_argument("--repeat", type=int, default=10, help="timed rounds")
    ap.add_argument("--threads", type=int, nargs="*", default=None, help="torch intra-op threads to try (default: all)")
    ap.add_argument("--sub-group-size", type=int, nargs="*", default=[1_000_000_000, 1 << 21])
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    threads = args.threads or [torch.get_num_threads()]
    n = args.numel
    rows = []
    print(f"# {machine()}")
    print(f"# {n:,} fp32 parameters in {args.tensors} tensors; best (median) of {args.repeat} interleaved rounds")
    for t in threads:
        torch.set_num_threads(t)
        fns = {
            "memcpy": setup_memcpy(n),
            "triad": setup_triad(n),
            "torch fused": setup_torch(n, args.tensors, fused=True),
            "torch foreach": setup_torch(n, args.tensors, foreach=True),
            "torch for-loop": setup_torch(n, args.tensors, foreach=False),
        }
        feed = None
        for sg in args.sub_group_size:
            fns[f"hf_zero offload, sub_group_size={sg:.0e}"], feed = setup_offload(n, args.tensors, sg)
        fns["hf_zero offload, step without the copy to 16-bit params"], _ = setup_offload(
            n, args.tensors, args.sub_group_size[0], copy_back=False)
        fns["hf_zero gradient copy to host (per step)"] = feed
        ds = setup_deepspeed(n, args.tensors)
        if ds is not None:
            fns["deepspeed cpu_adam"] = ds
        times = run_rounds(fns, args.repeat)
        copy_bw = 8 * n / min(times["memcpy"])
        triad_bw = 12 * n / min(times["triad"])
        bw = max(copy_bw, triad_bw)
        bound = bw / ADAMW_BYTES_PER_PARAM
        print(f"\nthreads={t}: memcpy {copy_bw / 1e9:.1f} GB/s, triad {triad_bw / 1e9:.1f} GB/s "
              f"-> AdamW at that bandwidth: {bound / 1e6:.0f} M params/s")
        print("| variant | step ms, best (median) | M params/s | GB/s at 28 B/param | vs streaming GB/s |")
        print("|---|---:|---:|---:|---:|")
        for name, ts in times.items():
            if name in ("memcpy", "triad"):
                continue
            best, med = min(ts), statistics.median(ts)
            if name.startswith("hf_zero gradient copy"):
                print(f"| {name} | {best * 1e3:.1f} ({med * 1e3:.1f}) | {n / best / 1e6:.0f} | "
                      f"{8 * n / best / 1e9:.1f} (8 B/param) | {100 * 8 * n / best / bw:.0f}% |")
                continue
            gbs = ADAMW_BYTES_PER_PARAM * n / best / 1e9
            print(f"| {name} | {best * 1e3:.1f} ({med * 1e3:.1f}) | {n / best / 1e6:.0f} | {gbs:.1f} | "
                  f"{100 * gbs * 1e9 / bw:.0f}% |")
            rows.append({"threads": t, "variant": name, "best_s": best, "median_s": med,
                         "params_per_s": n / best, "gb_per_s": gbs, "memcpy_gb_per_s": copy_bw / 1e9,
                         "triad_gb_per_s": triad_bw / 1e9})
        if ds is None:
            print("| deepspeed cpu_adam | not importable here | | | |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "numel": n, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
