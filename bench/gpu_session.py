"""The prepared GPU session (issue 28): one command, one GPU, under 9 minutes, every result under $OUT.

    python3 bench/gpu_session.py --out "$OUT"                                         # on the lent GPU
    python bench/gpu_session.py --cpu --out DIR --ds_python /tmp/ds-venv/bin/python   # the CPU dry run

The exact device call (command, carry, timeout_s) and the time budget are in bench/README.md. In
order, each step with its own time limit and all against one deadline:

0. DeepSpeed: on the GPU machine (no network, no DeepSpeed) the wheels of ``.whl/`` (made here by
   bench/make_wheels.sh) go into a folder of their own that only the DeepSpeed rows see, through a
   small ``ds-python`` wrapper; its CPU Adam is JIT-built in the background (its compiler must not
   share the cores with a timed row, so the first training row waits for it);
1. ``hf-zero env --json``;  2. ``hf-zero doctor --json``;
3. ``bench/run_bench.py``, full fine-tune of a Qwen2.5-1.5B shape (random weights, bf16, seq 1024,
   ``--gpu_memory_cap 24GB``): Trainer FSDP2, hf_zero ZeRO-2 and -3, ZeRO-3 + optimizer on CPU,
   ZeRO-3 + optimizer and parameters on CPU, DeepSpeed ZeRO-3 and ZeRO-3 + optimizer on CPU;
4. ``bench/run_bench.py``, LoRA (r=8, all linear layers, gradient checkpointing) of the largest Qwen2
   shape the clock still allows (7B, else 3B) under the cap: hf_zero ZeRO-3 against DeepSpeed ZeRO-3;
5. the report.

hf_zero itself is never installed: the working tree is put on PYTHONPATH. Files written to --out (the
device tool returns at most 8, two folders deep): ``session.md`` (the tables), ``session.json``
(everything), ``full.json``/``full.png`` and ``lora.json``/``lora.png`` (run_bench's own output), and
``logs.tar.gz`` (every step's and every row's log). They are rewritten after each step, so a run cut
short still returns what it measured. ``--cpu`` runs the same steps on tiny shapes with gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import _bench_lib as lib  # noqa: E402
import _gpu_session_lib as plan  # noqa: E402

DEFAULT_CPU_DS_PYTHON = os.environ.get("HF_ZERO_DEEPSPEED_PYTHON", "/tmp/ds-venv/bin/python")
"""The dry run's DeepSpeed (a separate venv with the same torch: DeepSpeed is never hf_zero's dependency)."""
OUT_FILES = ("session.md", "session.json", "full.json", "full.png", "lora.json", "lora.png", "logs.tar.gz")
"""Everything the session writes to --out: 7 files, under the device tool's 8 (the call's tee adds console.log)."""
_LOG_NAMES = ("log.txt", "spec.json", "memory_profile.md", "memory_profile.json")
_MAX_LOG_BYTES = 2 * 1024 * 1024


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 bench/gpu_session.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for the results (default: $OUT)")
    p.add_argument("--cpu", action="store_true", help="the dry run: tiny shapes, gloo, no GPU needed")
    p.add_argument("--work_dir", default=None,
                   help="models, logs, DeepSpeed's folder (default /tmp/hf_zero_gpu_session-<gpu|cpu>; models are reused)")
    p.add_argument("--ds_python", default=None,
                   help="a Python that imports deepspeed (default: the wheels of --wheels on a GPU; with --cpu "
                        "$HF_ZERO_DEEPSPEED_PYTHON or /tmp/ds-venv/bin/python, when there)")
    p.add_argument("--wheels", default=str(REPO / ".whl"), help="the folder bench/make_wheels.sh filled (default .whl/)")
    p.add_argument("--budget_s", type=float, default=None, help="seconds for the whole session (default: the profile's)")
    p.add_argument("--phases", default="env,doctor,full,lora", help="which steps to run (a rerun on a warm machine)")
    p.add_argument("--only", default=None,
                   help="comma-separated rows to run, each NAME (in every workload) or WORKLOAD:NAME, e.g. "
                        "full:ds3_opt_cpu,lora:zero3 (a rerun of a few rows; the quick test); the others are listed as not selected")
    p.add_argument("--memory_profile", type=int, default=None, metavar="STEP",
                   help="run_bench.py --memory_profile STEP for every row: per-phase peaks and the blocks alive at the peak "
                        "(memory_profile.md in each row's folder of logs.tar.gz)")
    return p


class Session:
    """The session's record: steps, their logs and the benchmark payloads; written out after each step."""

    def __init__(self, out: Path, work: Path, profile: plan.Profile, deadline: float, argv: list[str]):
        self.out, self.work, self.profile, self.deadline = out, work, profile, deadline
        self.logs = work / "logs"
        self.t0 = time.time()
        self.record: dict[str, Any] = {
            "command": "python3 bench/gpu_session.py " + " ".join(argv),
            "device": profile.device, "budget_s": deadline - self.t0, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "steps": {}, "notes": list(profile.notes), "plan": {}, "not_run": {}, "payloads": {},
            "budget": plan.budget_rows(profile),
        }

    def left(self) -> float:
        return self.deadline - time.time()

    def step(self, name: str, cmd: list[str], limit_s: float, env: dict[str, str] | None = None,
             stdout_file: str | None = None) -> dict[str, Any]:
        """Run one command with a time limit (cut to the deadline); its output goes to logs/<name>.log
        (stdout to ``stdout_file`` instead when given, stderr then to the log)."""
        limit = max(1.0, min(limit_s, self.left()))
        log_path = self.logs / f"{name}.log"
        t = time.time()
        with open(log_path, "w") as log:
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            if stdout_file:
                with open(self.logs / stdout_file, "w") as so:
                    rc = lib.run_process_group(cmd, stdout=so, stderr=log, env=env, cwd=REPO, timeout=limit)
            else:
                rc = lib.run_process_group(cmd, stdout=log, env=env, cwd=REPO, timeout=limit)
        info = {"status": "ok" if rc == 0 else ("timeout" if rc is None else "failed"), "returncode": rc,
                "wall_s": round(time.time() - t, 1), "limit_s": round(limit, 1), "log": f"logs/{name}.log"}
        self.record["steps"][name] = info
        print(f"[session] {name}: {info['status']} in {info['wall_s']:.0f} s (limit {limit:.0f} s)", file=sys.stderr)
        return info

    def write(self) -> None:
        """session.json, session.md and logs.tar.gz as they stand now."""
        self.record["wall_s"] = round(time.time() - self.t0, 1)
        (self.out / "session.json").write_text(json.dumps(self.record, indent=1, default=str))
        (self.out / "session.md").write_text(render(self.record))
        bundle_logs(self.work, self.out / "logs.tar.gz")


def bundle_logs(work: Path, target: Path) -> None:
    """One tar of the session's logs and every row's log, spec and rank records (models left out)."""
    tmp = work / "logs.tar.gz.tmp"  # not in --out: a session cut short there must leave no extra file
    with tarfile.open(tmp, "w:gz") as tar:
        for path in sorted(work.rglob("*")):
            if not path.is_file():
                continue
            rel = path.relative_to(work)
            wanted = rel.parts[0] == "logs" or (
                "runs" in rel.parts and (path.name in _LOG_NAMES or (path.name.startswith("rank") and path.suffix == ".json")))
            if not wanted:
                continue
            if path.stat().st_size > _MAX_LOG_BYTES:  # keep both ends of a runaway log
                data = path.read_bytes()
                half = _MAX_LOG_BYTES // 2
                clipped = data[:half] + b"\n[... cut by gpu_session.py ...]\n" + data[-half:]
                clipped_path = work / ".clipped"
                clipped_path.write_bytes(clipped)
                tar.add(clipped_path, arcname=str(rel))
                clipped_path.unlink()
            else:
                tar.add(path, arcname=str(rel))
    shutil.move(str(tmp), str(target))


# ------------------------------------------------------------------------------------------ DeepSpeed
def deepspeed_from_wheels(wheels: Path, work: Path, session: Session, python: str = sys.executable) -> str | None:
    """Install ``wheels/*.whl`` into ``work/ds-site`` and return a ``ds-python`` wrapper that puts that
    folder first on PYTHONPATH: DeepSpeed (and the newer typing_extensions pydantic needs) are then
    seen by the DeepSpeed rows only, never by the hf_zero rows. None (with a note) if that fails."""
    files = sorted(str(p) for p in wheels.glob("*.whl"))
    if not any(Path(f).name.startswith("deepspeed-") for f in files):
        session.record["notes"].append(f"DeepSpeed: no deepspeed wheel in {wheels} (run bench/make_wheels.sh and carry .whl)")
        return None
    site = work / "ds-site"
    shutil.rmtree(site, ignore_errors=True)
    info = session.step("ds_install", [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                                       "--no-cache-dir", "--disable-pip-version-check", "--target", str(site), *files], 120)
    if info["status"] != "ok":
        session.record["notes"].append("DeepSpeed: installing the wheels failed (logs/ds_install.log)")
        return None
    wrapper = work / "ds-python"
    wrapper.write_text(f'#!/bin/sh\nexport PYTHONPATH="{site}${{PYTHONPATH:+:$PYTHONPATH}}"\nexec "{python}" "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


@dataclass
class Build:
    """DeepSpeed's CPU Adam JIT build running in the background."""

    proc: subprocess.Popen
    started: float
    log: Any


def start_cpu_adam_build(ds_python: str, session: Session) -> Build:
    """DeepSpeed's CPU Adam, JIT-built (or loaded from torch's extension cache) in the background."""
    # On a CPU, DeepSpeed's collectives need its shared-memory op too: built here, not inside a row's time limit.
    code = ("import time; t = time.time(); from deepspeed.accelerator import get_accelerator; "
            "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); "
            "get_accelerator().device_name() == 'cpu' and get_accelerator().create_op_builder('ShareMemCommBuilder').load(); "
            "print(f'DeepSpeed ops ready in {time.time() - t:.1f} s')")
    log = open(session.logs / "ds_build.log", "w")
    log.write(f"$ {ds_python} -c {code!r}\n")
    log.flush()
    proc = subprocess.Popen([ds_python, "-c", code], stdout=log, stderr=subprocess.STDOUT, cwd=session.work,
                            env=_env(), start_new_session=True)
    return Build(proc, time.time(), log)


def finish_build(build: Build, session: Session) -> bool:
    """Wait for the build within its limit; record it; True when DeepSpeed's CPU Adam loads."""
    limit = session.profile.build_limit_s - (time.time() - build.started)
    rc = lib.wait_process_group(build.proc, max(1.0, min(limit, session.left())))
    build.log.close()
    status = "ok" if rc == 0 else ("timeout" if rc is None else "failed")
    session.record["steps"]["ds_cpu_adam_build"] = {
        "status": status, "returncode": rc, "wall_s": round(time.time() - build.started, 1),
        "limit_s": session.profile.build_limit_s, "log": "logs/ds_build.log"}
    print(f"[session] ds_cpu_adam_build: {status}", file=sys.stderr)
    return status == "ok"


# ------------------------------------------------------------------------------------------ benchmarks
def run_workload(workload: plan.Workload, session: Session, ds_python: str | None, skip: dict[str, str],
                 deadline: float, memory_profile: int | None = None) -> None:
    """One run_bench.py invocation; its JSON/PNG copied to --out as <workload>.json/.png."""
    configs = [c for c in workload.configs if f"{workload.name}:{c}" not in skip]
    for c in workload.configs:
        if f"{workload.name}:{c}" in skip:
            session.record["not_run"][f"{workload.name}:{c}"] = skip[f"{workload.name}:{c}"]
    session.record["plan"][workload.name] = list(workload.configs)
    session.record["workloads"] = {**session.record.get("workloads", {}), workload.name: workload.label}
    if not configs:
        return
    bench_out = session.work / "bench_out"
    bench_out.mkdir(exist_ok=True)
    for suffix in (".json", ".md", ".png"):  # a rerun's run_bench that dies early must not leave the last run's files
        (bench_out / f"{workload.name}{suffix}").unlink(missing_ok=True)
    w = replace(workload, configs=tuple(configs))
    cmd = [sys.executable, str(HERE / "run_bench.py"), *w.bench_args(cap=session.profile.cap),
           "--out", str(bench_out), "--tag", workload.name, "--work_dir", str(session.work / workload.name),
           "--deadline", f"{deadline:.0f}", "--min_run_s", str(session.profile.min_run_s)]
    if ds_python:
        cmd += ["--deepspeed_python", ds_python]
    if memory_profile:
        cmd += ["--memory_profile", str(memory_profile)]
    # The bench's own overhead (model creation, estimates, plot) on top of the rows' deadline.
    session.step(workload.name, cmd, deadline - time.time() + 90, env=_env())
    src = bench_out / f"{workload.name}.json"
    if src.exists():
        payload = json.loads(src.read_text())
        session.record["payloads"][workload.name] = payload
        shutil.copyfile(src, session.out / f"{workload.name}.json")
        ds_notes = " ".join(n for n in payload.get("notes", []) if n.startswith("DeepSpeed"))
        ran = {r["name"] for r in payload.get("results", [])}
        for c in configs:
            if c.startswith("ds") and c not in ran and ds_notes:
                session.record["not_run"].setdefault(f"{workload.name}:{c}", ds_notes)
    png = bench_out / f"{workload.name}.png"
    if png.exists():
        shutil.copyfile(png, session.out / f"{workload.name}.png")


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    # DeepSpeed's JIT ops in a folder of the session's own: torch's shared default is keyed by Python
    # and CUDA version only, so another environment's build of the same op (other include paths)
    # makes each side rebuild the other's, minutes each, inside a row's time limit.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "hf_zero_gpu_session" / "torch_extensions"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# ------------------------------------------------------------------------------------------ report
def render(record: dict[str, Any]) -> str:
    """session.md: the steps, the combined results, the ratios against the goals, then the details."""
    gpu = record["device"] == "gpu"
    payloads = record.get("payloads", {})
    lines = [f"# hf_zero GPU session ({'GPU' if gpu else 'CPU dry run'})", "",
             f"`{record['command']}` started {record['started']}; {record.get('wall_s', 0):.0f} s of a "
             f"{record['budget_s']:.0f} s budget.", ""]
    machine = next((p["machine"] for p in payloads.values() if p and p.get("machine")), None)
    if machine:
        gpus = ", ".join(f"{g['name']} ({g['total_bytes'] / lib.GiB:.0f} GiB)" for g in machine.get("gpus", [])) or "no GPU"
        lines += [f"Machine: {gpus}; {machine.get('cpu', '?')}, {machine.get('cpu_count')} CPUs, "
                  f"{lib.fmt_bytes(machine.get('ram_bytes'))} RAM; torch {machine.get('torch')} (CUDA {machine.get('cuda_version')}), "
                  f"transformers {machine.get('transformers')}, accelerate {machine.get('accelerate')}; "
                  f"DeepSpeed {next((p.get('deepspeed_version') for p in payloads.values() if p and p.get('deepspeed_version')), 'not run')}; "
                  f"hf_zero {machine.get('hf_zero_commit')}.", ""]
    lines += ["## Steps", "", lib.markdown_table(
        ["step", "status", "wall (s)", "limit (s)", "log"],
        [[k, v["status"], f"{v['wall_s']:.0f}", f"{v['limit_s']:.0f}", v.get("log", "")] for k, v in record["steps"].items()])]
    lines += ["", "Plan (estimates and limits, bench/README.md explains them):", "",
              lib.markdown_table(["step", "estimate (s)", "limit (s)"], record.get("budget", []))]
    doctor = record.get("doctor")
    if doctor:
        lines += ["", f"hf-zero doctor: {'all checks passed' if doctor.get('ok') else 'FAILED'} in {doctor.get('seconds')} s: "
                  + ", ".join(f"{c['name']} {c['status']}" for c in doctor.get("checks", []))]
    lines += ["", "## Results", "", "Workloads: " + "; ".join(f"{k}: {v}" for k, v in record.get("workloads", {}).items()) + ".", "",
              lib.markdown_table(plan.RESULT_HEADER, plan.result_rows(record.get("plan", {}), payloads, record.get("not_run", {}))),
              "", "## Ratios (hf_zero over the alternative; tokens/s > 1 is faster, memory < 1 is less)", "",
              plan.comparison_table(plan.comparison_rows(payloads, gpu=gpu))]
    if record.get("notes"):
        lines += ["", *[f"Note: {n}" for n in record["notes"]]]
    for name, payload in payloads.items():
        if payload:
            from _bench_report import render_markdown

            lines += ["", f"## {name}: run_bench.py's report", "", f"`{payload['command']}`", "", render_markdown(payload)]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if not args.out:
        sys.exit("gpu_session.py: give --out (or set $OUT)")
    profile = plan.CPU if args.cpu else plan.GPU
    if not args.cpu and not _cuda_available():
        sys.exit("gpu_session.py: no CUDA device here; use --cpu for the dry run")
    start = time.time()
    deadline = start + (args.budget_s or profile.budget_s)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in OUT_FILES:  # a local rerun into the same folder must not show the last run's files
        (out / stale).unlink(missing_ok=True)
    work = Path(args.work_dir or Path(tempfile.gettempdir()) / f"hf_zero_gpu_session-{profile.device}")
    shutil.rmtree(work / "logs", ignore_errors=True)
    for name in ("full", "lora"):
        shutil.rmtree(work / name / "runs", ignore_errors=True)
    (work / "logs").mkdir(parents=True)
    session = Session(out, work, profile, deadline, argv)
    phases = {p.strip() for p in args.phases.split(",") if p.strip()}

    rows = [f"full:{c}" for c in plan.FULL_CONFIGS] + [f"lora:{c}" for c in plan.LORA_CONFIGS]
    skip: dict[str, str] = {}  # "workload:name" -> why the row is not run
    if args.only:
        chosen = {c.strip() for c in args.only.split(",") if c.strip()}
        skip.update({r: "not selected (--only)" for r in rows if r not in chosen and r.split(":", 1)[1] not in chosen})
    ds_rows = [r for r in rows if r.split(":", 1)[1].startswith("ds") and r not in skip]
    ds_python = args.ds_python
    if ds_rows and phases & {"full", "lora"}:
        if ds_python is None and not args.cpu:
            ds_python = deepspeed_from_wheels(Path(args.wheels), work, session)
        elif ds_python is None and Path(DEFAULT_CPU_DS_PYTHON).exists():
            ds_python = DEFAULT_CPU_DS_PYTHON
        if ds_python is None:
            session.record["notes"].append("DeepSpeed: no Python with deepspeed (give --ds_python): its rows are not run")
            skip.update({c: "no DeepSpeed" for c in ds_rows})
    # Started first, so that the compiler works while env and doctor run.
    build = start_cpu_adam_build(ds_python, session) if ds_python and ds_rows and phases & {"full", "lora"} else None

    if "env" in phases:
        session.step("env", [sys.executable, "-m", "hf_zero.cli.main", "env", "--json"], profile.env_limit_s,
                     env=_env(), stdout_file="env.json")
        session.record["env"] = _read_json(session.logs / "env.json")
        session.write()
    if "doctor" in phases:
        session.step("doctor", [sys.executable, "-m", "hf_zero.cli.main", "doctor", "--json", *profile.doctor_args],
                     profile.doctor_limit_s, env=_env(), stdout_file="doctor.json")
        session.record["doctor"] = _read_json(session.logs / "doctor.json")
        session.write()

    if build is not None and not finish_build(build, session):
        for r in rows:
            if r.split(":", 1)[1] in plan.DS_BUILD_NEEDED_BY:
                skip.setdefault(r, "DeepSpeed's cpu_adam did not build (logs/ds_build.log)")
    if "full" in phases:
        run_workload(profile.full, session, ds_python, skip,
                     plan.full_phase_deadline(profile, start, deadline - start, lora_follows="lora" in phases),
                     args.memory_profile)
        session.write()
    if "lora" in phases:
        left = session.left() - profile.summary_reserve_s
        lora = plan.pick_lora(profile, left)
        if lora is None:
            session.record["plan"]["lora"] = list(profile.lora[-1].configs)
            session.record["not_run"]["lora"] = f"{left:.0f} s left, the smallest LoRA workload needs {profile.lora[-1].need_s:.0f} s"
        else:
            run_workload(lora, session, ds_python, skip, deadline - profile.summary_reserve_s, args.memory_profile)
    session.write()
    rec = session.record
    print(lib.markdown_table(plan.RESULT_HEADER, plan.result_rows(rec["plan"], rec["payloads"], rec["not_run"])))
    print()
    print(plan.comparison_table(plan.comparison_rows(rec["payloads"], gpu=profile.device == "gpu")))
    print(f"[session] {time.time() - start:.0f} s; files in {out}: {', '.join(sorted(p.name for p in out.iterdir()))}",
          file=sys.stderr)
    # 0 when every step and every row that ran went through; rows not run are listed with their reason.
    steps_ok = all(s["status"] == "ok" for s in rec["steps"].values())
    rows_ok = all(r.get("status") == "ok" for p in rec["payloads"].values() if p for r in p.get("results", []))
    return 0 if steps_ok and rows_ok else 1


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    sys.exit(main())
