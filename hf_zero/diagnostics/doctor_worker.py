"""One rank of ``hf-zero doctor``: every check, each result appended to this rank's JSON-lines file.

Started by :mod:`hf_zero.diagnostics.doctor` (one process per device, rendezvous variables set).
Each check writes a "start" record before it runs and a result after, so when the parent kills a
hung rank it knows which check hung. Results are per rank; the parent merges them.

Not for direct use; ``--inject`` breaks one thing on purpose so tests can see the doctor catch it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_LR = 1e-3
_CLIP = 0.5
_STEPS = 3


class _Log:
    def __init__(self, path: Path):
        self._f = path.open("a", buffering=1)

    def write(self, **record: Any) -> None:
        self._f.write(json.dumps(record, default=str) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())


def _run_check(log: _Log, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
    log.write(check=name, status="start")
    t0 = time.perf_counter()
    try:
        details = fn() or {}
        status = details.pop("status", "pass")
        log.write(check=name, status=status, seconds=round(time.perf_counter() - t0, 2), **details)
        return details
    except Exception as exc:  # noqa: BLE001 -- every failure is a result to report, not a crash
        log.write(check=name, status="fail", seconds=round(time.perf_counter() - t0, 2),
                  error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc(limit=6)[-1500:])
        return None


# ----------------------------------------------------------------------------- device, collectives
def _check_device(local_rank: int) -> dict[str, Any]:
    from hf_zero.distributed import device as accel

    dev = accel.select_device(local_rank)
    out: dict[str, Any] = {"device": str(dev)}
    if accel.accelerator_available():
        out["name"] = accel.device_name(dev.index)
        if accel.current_device().index != local_rank:
            raise RuntimeError(f"rank with LOCAL_RANK {local_rank} runs on {accel.current_device()}")
    return out


def _check_collectives(dtype: torch.dtype, inject: str) -> dict[str, Any]:
    import torch.distributed as dist

    from hf_zero.distributed.collectives import collective_device

    dev = collective_device()
    rank, world = dist.get_rank(), dist.get_world_size()
    if inject == "hang" and rank == world - 1:
        time.sleep(3600)
    # all_reduce: sum of (rank + 1) over ranks, checked by value
    t = torch.full((1024,), float(rank + 1), dtype=dtype, device=dev)
    if inject == "collective" and rank == world - 1:
        t += 1
    dist.all_reduce(t)
    want = world * (world + 1) / 2
    if not torch.all(t.float() == want):
        raise RuntimeError(f"all_reduce gave {t.float().unique().tolist()}, expected {want}")
    # all_gather_into_tensor / reduce_scatter_tensor / broadcast
    mine = torch.full((256,), float(rank), dtype=dtype, device=dev)
    gathered = torch.empty(256 * world, dtype=dtype, device=dev)
    dist.all_gather_into_tensor(gathered, mine)
    expect = torch.arange(world, dtype=torch.float32).repeat_interleave(256)
    if not torch.equal(gathered.float().cpu(), expect):
        raise RuntimeError("all_gather returned other ranks' data in the wrong place")
    full = torch.arange(256 * world, dtype=torch.float32).to(dtype).to(dev)
    part = torch.empty(256, dtype=dtype, device=dev)
    dist.reduce_scatter_tensor(part, full)
    if not torch.equal(part.float().cpu(), (full.float().cpu() * world)[rank * 256:(rank + 1) * 256]):
        raise RuntimeError("reduce_scatter returned wrong values")
    b = torch.full((64,), float(rank + 7), dtype=dtype, device=dev)
    dist.broadcast(b, src=0)
    if not torch.all(b.float() == 7.0):
        raise RuntimeError("broadcast did not deliver rank 0's values")
    objs: list[Any] = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    if [o["rank"] for o in objs] != list(range(world)):
        raise RuntimeError(f"all_gather_object returned {objs}")
    # bus bandwidth of a larger all_reduce (NCCL's formula: 2 (n-1)/n x bytes / time)
    numel = (64 << 20) // 4 if dev.type != "cpu" else (4 << 20) // 4
    big = torch.ones(numel, dtype=torch.float32, device=dev)
    dist.all_reduce(big)
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(5):
        dist.all_reduce(big)
    _sync(dev)
    dt = (time.perf_counter() - t0) / 5
    busbw = 2 * (world - 1) / world * big.numel() * 4 / dt / 1e9 if world > 1 else float("nan")
    return {"bus_GBps": round(busbw, 2), "bytes": big.numel() * 4, "on": str(dev)}


def _sync(dev: torch.device) -> None:
    from hf_zero.distributed import device as accel

    accel.synchronize(dev)


def _check_pinned_copy() -> dict[str, Any]:
    from hf_zero.distributed import device as accel

    if not accel.accelerator_available():
        return {"status": "skip", "why": "no accelerator: nothing to pin for"}
    n = 16 << 20
    src = torch.arange(n, dtype=torch.float32, device=accel.current_device())
    host = accel.pinned_empty(n * 4, torch.float32)
    copies = accel.PendingCopies()
    t0 = time.perf_counter()
    copies.copy(host, src)
    copies.wait()
    dt = time.perf_counter() - t0
    if not torch.equal(host[:: 1 << 16], torch.arange(n, dtype=torch.float32)[:: 1 << 16]):
        raise RuntimeError("a device-to-host copy into pinned memory read back wrong values after its event")
    return {"GBps": round(n * 4 / dt / 1e9, 1), "pinned": host.is_pinned()}


def _check_cpu_threads(world: int) -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = torch.get_num_threads()
    numel = 4 << 20
    p = torch.zeros(numel, requires_grad=True)
    p.grad = torch.ones(numel)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)

    def timed() -> float:
        opt.step()
        t0 = time.perf_counter()
        for _ in range(3):
            opt.step()
        return (time.perf_counter() - t0) / 3

    mine = timed()
    torch.set_num_threads(cores)
    every = timed()
    torch.set_num_threads(threads)
    out = {"threads": threads, "cores": cores, "ranks": world, "step_ms": round(mine * 1e3, 2),
           "step_ms_all_cores": round(every * 1e3, 2)}
    if threads == 1 and cores >= 2 * world:
        out["status"] = "warn"
        out["why"] = (f"the offloaded optimizer step runs on 1 thread while {cores // world} cores per rank "
                      "are free: unset OMP_NUM_THREADS=1 or launch with hf-zero run")
    return out


# ----------------------------------------------------------------------------- the tiny model matrix
def _tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def _batches(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, 128, (2, 16), generator=gen) for _ in range(_STEPS)]


def _engine_config(case: dict[str, Any], nvme: str | None) -> dict[str, Any]:
    zo: dict[str, Any] = {"stage": case["stage"]}
    for key in ("offload_optimizer", "offload_param"):
        where = case.get(key)
        if where:
            zo[key] = {"device": where, "pin_memory": True}
            if where == "nvme":
                zo[key]["nvme_path"] = nvme
    if case.get("user_zero"):
        zo = dict(case["user_zero"])
    prec = case["precision"]
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": _CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": _LR, "weight_decay": 0.0}},
            "bf16": {"enabled": prec == "bf16"}, "fp16": {"enabled": prec == "fp16", "initial_scale_power": 8},
            "zero_optimization": zo}


def _train(case: dict[str, Any], rank: int, nvme: str | None, inject: str, work: Path) -> dict[str, Any]:
    """Three steps with clipping; a checkpoint after step 2, resumed into a fresh engine for step 3;
    the 16-bit export at the end."""
    import hf_zero
    from hf_zero.checkpoint.export16 import save_16bit_model
    from hf_zero.checkpoint.sharded import load_checkpoint, save_checkpoint

    cfg = _engine_config(case, nvme)
    if inject == "offload" and (case.get("offload_optimizer") or case.get("offload_param")):
        cfg["optimizer"]["params"]["lr"] = _LR * 3  # a wrong update that only offloaded runs make
    batches = _batches(rank)
    ckpt = work / f"ckpt-{case['name']}"
    engine = hf_zero.initialize(_tiny_model(), cfg)
    losses, norms = [], []
    try:
        for i, ids in enumerate(batches):
            loss = engine(input_ids=ids.to(engine.env.device), labels=ids.to(engine.env.device)).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
            norms.append(float(engine.get_global_grad_norm() or 0.0))
            if i == 1:
                save_checkpoint(engine, ckpt)
        export = work / f"export-{case['name']}"
        files = save_16bit_model(engine, export)
        if rank == 0:
            _check_export(export, files)
    finally:
        engine.close()
    resumed = hf_zero.initialize(_tiny_model(), cfg)
    try:
        load_checkpoint(resumed, ckpt)
        ids = batches[-1]
        loss = resumed(input_ids=ids.to(resumed.env.device), labels=ids.to(resumed.env.device)).loss
        resumed.backward(loss)
        resumed.step()
        resumed_loss = float(loss.detach())
    finally:
        resumed.close()
    return {"losses": losses, "grad_norms": norms, "resumed_step3_loss": resumed_loss, "export_files": len(files)}


def _check_export(folder: Path, files: list[str]) -> None:
    """The 16-bit export is a from_pretrained folder whose weights are all there and finite."""
    from safetensors.torch import load_file

    weights = [f for f in files if str(f).endswith(".safetensors")]
    if not weights:
        raise RuntimeError(f"the 16-bit export wrote no weights into {folder} (files: {files})")
    tensors: dict[str, torch.Tensor] = {}
    for f in weights:
        tensors.update(load_file(str(folder / Path(f).name)))
    if not any(k.endswith("embed_tokens.weight") for k in tensors):
        raise RuntimeError(f"the 16-bit export has no embedding ({sorted(tensors)[:5]}...)")
    bad = [k for k, v in tensors.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise RuntimeError(f"the 16-bit export has non-finite values in {bad[:3]}")


def _tolerance(precision: str, on_accelerator: bool) -> float:
    if precision == "fp32" and not on_accelerator:
        return 1e-5
    # 16-bit compute, and GPU kernels against the CPU optimizer's fp32 arithmetic: 2.7e-5 measured on
    # an H100 in bf16. A wrong update is larger (a 3x learning rate in one offload path: 7e-3).
    return 2e-3


def _compare(result: dict[str, Any], base: dict[str, Any] | None, tol: float) -> dict[str, Any]:
    losses = result["losses"]
    if not all(math.isfinite(x) for x in losses[:1]):
        raise RuntimeError(f"first loss is not finite: {losses}")
    resume_diff = abs(result["resumed_step3_loss"] - losses[-1]) / max(abs(losses[-1]), 1e-6)
    out = dict(result, resume_rel_diff=resume_diff)
    if resume_diff > tol:
        out["status"] = "fail"
        out["why"] = f"resuming from the step-2 checkpoint gave step-3 loss {result['resumed_step3_loss']:.6f}, " \
                     f"the uninterrupted run {losses[-1]:.6f}"
    if base is not None:
        diff = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(losses, base["losses"]))
        out["rel_diff_vs_no_offload"] = diff
        if diff > tol:
            out["status"] = "fail"
            out["why"] = f"losses {losses} differ from the run without offload {base['losses']} (rel {diff:.2e} > {tol})"
    return out


def matrix(nvme: str | None, bf16: bool, user_zero: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The cases the doctor trains, in order; a case's baseline is the earlier case named in "base"."""
    prec = "bf16" if bf16 else "fp32"
    cases: list[dict[str, Any]] = []
    for stage in range(4):
        base = f"s{stage}-{prec}"
        cases.append({"name": base, "stage": stage, "precision": prec})
        if stage >= 1:
            cases.append({"name": f"s{stage}-opt-cpu-{prec}", "stage": stage, "precision": prec,
                          "offload_optimizer": "cpu", "base": base})
        if stage == 3:
            cases.append({"name": f"s3-param-cpu-{prec}", "stage": 3, "precision": prec,
                          "offload_optimizer": "cpu", "offload_param": "cpu", "base": base})
        if nvme and stage in (2, 3):
            cases.append({"name": f"s{stage}-nvme-{prec}", "stage": stage, "precision": prec,
                          "offload_optimizer": "nvme", "offload_param": "nvme" if stage == 3 else None, "base": base})
    cases.append({"name": "s2-fp16", "stage": 2, "precision": "fp16"})
    if user_zero is not None:
        cases.append({"name": "your-config", "stage": int(user_zero.get("stage", 0)), "precision": prec,
                      "user_zero": user_zero, "base": f"s{int(user_zero.get('stage', 0))}-{prec}"})
    return cases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", choices=["all", "collectives"], default="all")
    ap.add_argument("--nvme_path", default=None)
    ap.add_argument("--user_zero", default=None, help="JSON of the user's zero_optimization section")
    ap.add_argument("--inject", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    log = _Log(args.out / f"rank{rank}.jsonl")
    from hf_zero.distributed import device as accel
    from hf_zero.distributed.env import init_distributed

    if _run_check(log, "device", lambda: _check_device(local_rank)) is None:
        return 1
    init_distributed(timeout_s=90)
    _run_check(log, "collectives-fp32", lambda: _check_collectives(torch.float32, args.inject))
    _run_check(log, "collectives-bf16", lambda: _check_collectives(torch.bfloat16, args.inject))
    if args.only == "collectives":
        return 0
    _run_check(log, "pinned-copy", _check_pinned_copy)
    _run_check(log, "cpu-optimizer-threads", lambda: _check_cpu_threads(world))
    bf16 = accel.bf16_supported()
    user_zero = json.loads(args.user_zero) if args.user_zero else None
    results: dict[str, dict[str, Any]] = {}
    nvme = None
    if args.nvme_path:
        nvme = os.path.join(args.nvme_path, f"hf_zero_doctor_{os.getppid()}")
        os.makedirs(nvme, exist_ok=True)
    runs = Path(args.out) / "runs"  # shared by the ranks: a checkpoint is one folder of every rank's files
    for case in matrix(nvme, bf16, user_zero):
        def one(case: dict[str, Any] = case) -> dict[str, Any]:
            res = _train(case, rank, nvme, args.inject, runs)
            results[case["name"]] = res
            tol = _tolerance(case["precision"], accel.accelerator_available())
            return _compare(res, results.get(case.get("base", "")), tol)

        _run_check(log, f"train:{case['name']}", one)
    _run_check(log, "peak-memory", _peak_memory)
    return 0


def _peak_memory() -> dict[str, Any]:
    import resource

    from hf_zero.distributed import device as accel

    out: dict[str, Any] = {"host_peak_rss_MiB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    peak = accel.max_memory_allocated()
    if peak is not None:
        out["device_peak_allocated_MiB"] = round(peak / 2**20, 1)
    return out


if __name__ == "__main__":
    sys.exit(main())
