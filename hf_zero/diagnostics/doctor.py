"""``hf-zero doctor``: check this machine's GPUs, collectives and every ZeRO path; 26 s on one H100.

One process per device (CPU processes on gloo without a GPU: the same code), each running
:mod:`hf_zero.diagnostics.doctor_worker`; a deadline for the whole run, so a hang is reported as a
hang with the check it hung in. The ranks' results are merged into one table: a check passes when
it passed on every rank. When the collectives fail, they are tried again with ``NCCL_P2P_DISABLE=1``
and the table says which setting works.

Example::

    >>> report = run_doctor(nproc=2, timeout_s=110)        # doctest: +SKIP
    >>> print(render(report)); report.ok                   # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DoctorReport", "run_doctor", "render", "HINTS"]

# What to do when a check fails, by check-name prefix.
HINTS = {
    "device": "each rank must see its own GPU: check CUDA_VISIBLE_DEVICES and --nproc_per_node",
    "collectives": "NCCL gave wrong values or hung: see the P2P row; try NCCL_P2P_DISABLE=1, check ACS/IOMMU "
                   "settings and the driver; send `hf-zero env` output with the report",
    "pinned-copy": "pinned host memory is broken or limited: check `ulimit -l` and the container's memory limit; "
                   "set pin_memory: false in the offload sections",
    "cpu-optimizer-threads": "give each rank its share of cores: unset OMP_NUM_THREADS or launch with hf-zero run",
    "train:": "this ZeRO path trains differently from the run without offload (or from its own checkpoint): "
              "do not use it; report it with `hf-zero env` output and this table",
    "peak-memory": "",
}


@dataclass
class CheckRow:
    name: str
    status: str  # pass, warn, skip, fail, hang, missing
    seconds: float | None = None
    detail: str = ""
    per_rank: dict[int, dict[str, Any]] = field(default_factory=dict)


@dataclass
class DoctorReport:
    rows: list[CheckRow]
    nproc: int
    backend_note: str = ""
    out_dir: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(r.status in ("pass", "warn", "skip") for r in self.rows)

    def to_json(self) -> str:
        return json.dumps({"ok": self.ok, "nproc": self.nproc, "seconds": self.seconds, "note": self.backend_note,
                           "checks": [r.__dict__ for r in self.rows]}, indent=1, default=str)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _default_nproc() -> int:
    from hf_zero.distributed import device as accel

    return accel.device_count() or 2


def _launch(nproc: int, out: Path, extra: list[str], env_extra: dict[str, str], timeout_s: float) -> tuple[bool, float]:
    """Start the ranks and wait for them; True when all exited in time (whatever their status)."""
    port = _free_port()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    procs, logs = [], []
    for rank in range(nproc):
        env = {**os.environ, **env_extra, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
               "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        # As hf-zero run does: each rank gets its share of the cores unless the user chose.
        env.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
        cmd = [sys.executable, "-m", "hf_zero.diagnostics.doctor_worker", "--out", str(out), *extra]
        log = (out / f"rank{rank}.log").open("w")
        logs.append(log)
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    finished = all(p.poll() is not None for p in procs)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for log in logs:
        log.close()
    return finished, time.monotonic() - t0


def _clear_results(out: Path) -> None:
    """Remove what an earlier run left in ``out`` (``--keep`` reused): its records would otherwise
    be merged with this run's, and a check that hangs now would show the old PASS."""
    for pattern in ("rank*.jsonl", "rank*.log"):
        for f in out.glob(pattern):
            f.unlink()
    for sub in ("runs", "p2p_off"):
        shutil.rmtree(out / sub, ignore_errors=True)


def _read_rank(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
    return out


def _merge(out: Path, nproc: int, finished: bool) -> list[CheckRow]:
    per_rank = {r: _read_rank(out / f"rank{r}.jsonl") for r in range(nproc)}
    order: list[str] = []
    for records in per_rank.values():
        for rec in records:
            if rec["check"] not in order:
                order.append(rec["check"])
    rows = []
    for name in order:
        row = CheckRow(name, "pass")
        statuses = []
        for rank, records in per_rank.items():
            mine = [r for r in records if r["check"] == name]
            final = next((r for r in reversed(mine) if r["status"] != "start"), None)
            if final is None:
                statuses.append("hang" if mine and not finished else "missing")
                row.per_rank[rank] = {"status": statuses[-1]}
                continue
            statuses.append(final["status"])
            row.per_rank[rank] = final
            row.seconds = max(row.seconds or 0.0, final.get("seconds") or 0.0)
        for worst in ("hang", "fail", "missing", "warn", "skip"):
            if worst in statuses:
                row.status = worst
                break
        row.detail = _detail(row)
        rows.append(row)
    return rows


def _detail(row: CheckRow) -> str:
    bad = {r: d for r, d in row.per_rank.items() if d.get("status") not in ("pass", "warn", "skip")}
    if bad:
        silent = {"hang": "no answer before the deadline", "missing": "never got there"}
        spoke = {r: d for r, d in bad.items() if d.get("status") not in silent}
        if not spoke:
            ranks = ", ".join(str(r) for r in bad)
            return f"rank(s) {ranks}: {silent[next(iter(bad.values()))['status']]}"
        rank, d = next(iter(spoke.items()))
        return f"rank {rank}: {d.get('why') or d.get('error', '')}"
    d = row.per_rank.get(0, {})
    keys = ("device", "name", "bus_GBps", "GBps", "threads", "cores", "step_ms", "step_ms_all_cores",
            "rel_diff_vs_no_offload", "resume_rel_diff", "host_peak_rss_MiB", "device_peak_allocated_MiB", "why")
    parts = []
    for k in keys:
        if k in d:
            v = d[k]
            parts.append(f"{k}={v:.2e}" if isinstance(v, float) and "diff" in k else f"{k}={v}")
    return ", ".join(parts)


def run_doctor(nproc: int | None = None, *, zero_config: str | None = None, nvme_path: str | None = None,
               timeout_s: float = 110.0, keep: str | None = None, inject: str = "") -> DoctorReport:
    """Run every check on ``nproc`` local processes and return the merged report.

    Args:
        nproc: processes (default: the visible GPUs, or 2 CPU processes on gloo without one).
        zero_config: a DeepSpeed/hf_zero config whose ``zero_optimization`` section is trained too.
        nvme_path: a folder for the NVMe offload cases (skipped without one).
        timeout_s: deadline for the whole run; ranks still running then are reported as hung.
        keep: a folder to keep the ranks' logs and results in (a temporary one otherwise).
    """
    nproc = nproc or _default_nproc()
    t_start = time.monotonic()
    out = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="hf_zero_doctor_"))
    out.mkdir(parents=True, exist_ok=True)
    _clear_results(out)
    extra: list[str] = []
    if nvme_path:
        extra += ["--nvme_path", nvme_path]
    if zero_config:
        from hf_zero.config.sources.readers import load_raw

        raw, _ = load_raw(zero_config)
        zero = {k: v for k, v in (raw.get("zero_optimization") or {}).items() if v != "auto"}
        extra += ["--user_zero", json.dumps(zero)]
    if inject:
        extra += ["--inject", inject]
    try:
        finished, _ = _launch(nproc, out, extra, {}, timeout_s)
        rows = _merge(out, nproc, finished)
        note = ""
        from hf_zero.distributed import device as accel

        nccl = accel.default_backend() == "nccl"
        if nccl and any(r.name.startswith("collectives") and r.status in ("fail", "hang") for r in rows):
            retry = out / "p2p_off"
            retry.mkdir()
            ok_again, _ = _launch(nproc, retry, ["--only", "collectives", *(["--inject", inject] if inject else [])],
                                  {"NCCL_P2P_DISABLE": "1"}, min(60.0, timeout_s))
            again = [r for r in _merge(retry, nproc, ok_again) if r.name.startswith("collectives")]
            works = bool(again) and all(r.status == "pass" for r in again)
            note = ("collectives pass with NCCL_P2P_DISABLE=1: export it before training" if works
                    else "collectives also fail with NCCL_P2P_DISABLE=1")
            rows.append(CheckRow("collectives-p2p-off", "pass" if works else "fail", detail=note))
        return DoctorReport(rows, nproc, note, str(out), round(time.monotonic() - t_start, 1))
    finally:
        if not keep:
            shutil.rmtree(out, ignore_errors=True)
        if nvme_path:  # the workers' swap folder (they name it after this process)
            shutil.rmtree(os.path.join(nvme_path, f"hf_zero_doctor_{os.getpid()}"), ignore_errors=True)


def render(report: DoctorReport) -> str:
    """The table users read (and paste): one row per check, what to do for each failure."""
    lines = [f"hf-zero doctor: {report.nproc} process(es), {report.seconds:.0f} s", "",
             "| check | result | s | details |", "|---|---|---:|---|"]
    for r in report.rows:
        secs = "" if r.seconds is None else f"{r.seconds:.1f}"
        lines.append(f"| {r.name} | {r.status.upper()} | {secs} | {r.detail} |")
    failed = [r for r in report.rows if r.status not in ("pass", "warn", "skip")]
    if not report.rows:
        lines.append("| (no check reported) | FAIL | | the ranks did not start: see the rank logs |")
    if failed:
        lines += ["", "What to do:"]
        for r in failed:
            hint = next((h for k, h in HINTS.items() if r.name.startswith(k) and h), "")
            lines.append(f"- {r.name}: {hint}")
    lines += ["", "All checks passed." if report.ok and report.rows else "Some checks FAILED."]
    return "\n".join(lines)
