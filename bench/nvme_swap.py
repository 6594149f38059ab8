"""NVMe swap throughput vs. the raw sequential bandwidth of the same disk, in the same run.

    python bench/nvme_swap.py --path /local_nvme [--gib 1] [--record-mib 64] [--threads 1 2 4] [--repeat 3]

1. **Raw disk** (dd-like): one file of ``--gib`` GiB written then read sequentially in 1 MiB
   ``O_DIRECT`` requests from one thread (``dd bs=1M oflag=direct`` / ``iflag=direct``), so the page
   cache neither absorbs the writes nor serves the reads. Buffered write + ``fsync`` and buffered
   read (after ``POSIX_FADV_DONTNEED``) are shown too.
2. **hf_zero swap space** (``hf_zero.offload.nvme.SwapSpace``): the same amount of data as
   ``--record-mib`` records (one optimizer sub-group each), written and read through pool buffers
   with the ``aio`` settings given (block size, queue depth, thread count), as the optimizer swaps.
3. **Offloaded optimizer step** with ``device=nvme`` vs ``device=cpu``: AdamW over ``--step-numel``
   parameters, whose state (master + 2 moments) makes the optimizer read and write 12 bytes per
   parameter per step; the NVMe step's extra time over the CPU step, against those bytes, is the
   swap throughput the step sees (read-ahead and write-behind overlap part of it with compute).

Results are MB/s (10^6 bytes per second) and the ratio to the raw O_DIRECT figure.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

import torch

MiB = 1 << 20


def aligned_buffer(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, nbytes)  # anonymous mappings are page-aligned


def raw_sequential(path: str, total: int, direct: bool, block: int = MiB) -> tuple[float, float]:
    """(write MB/s, read MB/s) of one file written then read in ``block`` requests."""
    name = os.path.join(path, "hf_zero_bench_raw.bin")
    buf = aligned_buffer(block)
    buf.write(os.urandom(block))
    flag = os.O_DIRECT if direct else 0
    try:
        fd = os.open(name, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | flag, 0o600)
        start = time.perf_counter()
        for offset in range(0, total, block):
            os.pwrite(fd, buf, offset)
        os.fsync(fd)
        write = total / (time.perf_counter() - start) / 1e6
        os.close(fd)
        fd = os.open(name, os.O_RDONLY | flag)
        if not direct:
            os.posix_fadvise(fd, 0, total, os.POSIX_FADV_DONTNEED)
        start = time.perf_counter()
        for offset in range(0, total, block):
            os.preadv(fd, [buf], offset)
        read = total / (time.perf_counter() - start) / 1e6
        os.close(fd)
    finally:
        if os.path.exists(name):
            os.remove(name)
    return write, read


def swap_space(path: str, total: int, record: int, threads: int, block: int, queue_depth: int) -> tuple[float, float]:
    from hf_zero.config.schema import AioConfig
    from hf_zero.offload.nvme import BufferPool, SwapDir, SwapSpace, new_run_id

    aio = AioConfig(block_size=block, queue_depth=queue_depth, thread_count=threads)
    space = SwapSpace(SwapDir(path, new_run_id(), 0, "bench"), aio, "bench", owns_dir=True)
    try:
        count = max(1, total // record)
        for i in range(count):
            space.create(f"r{i}", record)
        pool = BufferPool(4, record, pin=False, setting="bench")
        for b in pool.buffers:
            b.copy_(torch.randint(0, 256, (b.numel(),), dtype=torch.uint8))
        # Steady state: from the second optimizer step on, records are overwritten in place (the
        # first write into a preallocated file also converts its extents, a one-off cost).
        for i in range(count):
            space.write(f"r{i}", pool.buffers[0]).wait()
        # Writes: keep up to 3 records in flight, as write-behind does.
        start = time.perf_counter()
        pending = []
        for i in range(count):
            pending.append(space.write(f"r{i}", pool.buffers[i % pool.count]))
            if len(pending) >= pool.count - 1:
                pending.pop(0).wait()
        for h in pending:
            h.wait()
        for i in range(count):
            # A no-op after O_DIRECT writes; makes a buffered fallback pay for its writeback too.
            fd = os.open(space.path(f"r{i}"), os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        write = count * record / (time.perf_counter() - start) / 1e6
        # Reads: one ahead, as read-ahead does.
        start = time.perf_counter()
        ahead = space.read("r0", pool.buffers[0])
        for i in range(count):
            current = ahead
            if i + 1 < count:
                ahead = space.read(f"r{i + 1}", pool.buffers[(i + 1) % 2])
            current.wait()
        read = count * record / (time.perf_counter() - start) / 1e6
        return write, read
    finally:
        space.close()


def optimizer_step(path: str, numel: int, sub_group_size: int, repeat: int, threads: int) -> tuple[float, float]:
    """(cpu step s, nvme step s) of an offloaded AdamW over ``numel`` parameters."""
    from hf_zero.config.schema import AioConfig, OptimizerConfig
    from hf_zero.offload.cpu_optimizer import (
        HostOffloadConfig,
        OffloadedOptimizer,
        ParamPlan,
    )
    from hf_zero.offload.nvme import new_run_id
    from hf_zero.optim.optimizers import build_optimizer

    cfg = OptimizerConfig(type="adamw", lr=1e-3, weight_decay=0.01)
    build = lambda groups: build_optimizer(cfg, groups)
    out = []
    for device in ("cpu", "nvme"):
        tensors = 8
        params = [torch.nn.Parameter(torch.randn(numel // tensors).to(torch.bfloat16)) for _ in range(tensors)]
        host = HostOffloadConfig(device=device, sub_group_size=sub_group_size, buffer_count=4, nvme_path=path,
                                 aio=AioConfig(block_size=MiB, queue_depth=8, thread_count=threads), run_id=new_run_id())
        opt = OffloadedOptimizer(build(params), build, {id(p): f"p{i}" for i, p in enumerate(params)}, host,
                                 ParamPlan(host=params))
        grads = [torch.randn(p.numel()) * 1e-3 for p in params]

        def step(opt=opt, params=params, grads=grads) -> None:
            for p, g in zip(params, grads):
                opt.accumulate_grad(p, g)
            opt.step()
            opt.zero_grad()

        step()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        opt.close()
        out.append(statistics.median(times))
    return out[0], out[1]


def describe_disk(path: str) -> str:
    try:
        dev = subprocess.run(["df", "-hT", path], capture_output=True, text=True, check=True).stdout.splitlines()[-1]
    except (OSError, subprocess.CalledProcessError):
        dev = path
    return " ".join(dev.split())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", required=True, help="folder on the disk to measure (the nvme_path)")
    ap.add_argument("--gib", type=float, default=1.0, help="data per measurement")
    ap.add_argument("--record-mib", type=int, default=64, help="swap record (sub-group) size")
    ap.add_argument("--threads", type=int, nargs="*", default=[1, 2, 4], help="aio.thread_count values")
    ap.add_argument("--queue-depth", type=int, default=8)
    ap.add_argument("--block-mib", type=float, default=1.0, help="aio.block_size")
    ap.add_argument("--step-numel", type=int, default=1 << 24, help="parameters in the optimizer-step test")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    total = int(args.gib * (1 << 30))
    record = args.record_mib * MiB
    block = int(args.block_mib * MiB)
    free = shutil.disk_usage(args.path).free
    if free < 2 * total:
        raise SystemExit(f"{args.path} has {free / 2**30:.1f} GiB free; need {2 * total / 2**30:.1f}")
    print(f"# disk: {describe_disk(args.path)}")
    print(f"# {platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}; {total / 2**30:.2f} GiB per test, "
          f"median of {args.repeat}")
    rows = []

    def median_of(fn):
        results = [fn() for _ in range(args.repeat)]
        return tuple(statistics.median(r[i] for r in results) for i in range(len(results[0])))

    raw_w, raw_r = median_of(lambda: raw_sequential(args.path, total, direct=True))
    rows.append(("raw O_DIRECT, 1 MiB requests, 1 thread (dd-like)", raw_w, raw_r))
    bw, br = median_of(lambda: raw_sequential(args.path, total, direct=False))
    rows.append(("raw buffered + fsync / read after DONTNEED", bw, br))
    for threads in args.threads:
        w, r = median_of(lambda t=threads: swap_space(args.path, total, record, t, block, args.queue_depth))
        name = (f"hf_zero SwapSpace, {args.record_mib} MiB records, thread_count={threads}, "
                f"queue_depth={args.queue_depth}, block {args.block_mib:g} MiB")
        rows.append((name, w, r))
    print("| what | write MB/s | read MB/s | write / raw | read / raw |")
    print("|---|---:|---:|---:|---:|")
    for name, w, r in rows:
        print(f"| {name} | {w:.0f} | {r:.0f} | {w / raw_w:.2f} | {r / raw_r:.2f} |")
    cpu_s, nvme_s = optimizer_step(args.path, args.step_numel, min(record // 16, 1 << 24), args.repeat, max(args.threads))
    moved = 2 * 12 * args.step_numel  # master + 2 moments read and written
    extra = max(nvme_s - cpu_s, 1e-9)
    print(f"\noffloaded AdamW step over {args.step_numel:,} parameters: cpu {cpu_s * 1e3:.0f} ms, nvme {nvme_s * 1e3:.0f} ms; "
          f"{moved / 1e6:.0f} MB swapped per step = {moved / nvme_s / 1e6:.0f} MB/s over the whole step, "
          f"{moved / extra / 1e6:.0f} MB/s over the time NVMe adds")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"disk": describe_disk(args.path), "rows": rows, "step": {"cpu_s": cpu_s, "nvme_s": nvme_s,
                       "numel": args.step_numel}}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
