"""The pure parts of bench/run_bench.py: configuration matrix, ZeRO JSON, statistics, ratios, tables,
the GPU memory cap, argument parsing, aggregation of rank records. No training here."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from argparse import Namespace
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


lib = _load("_bench_lib")
run_bench = _load("run_bench")


# ------------------------------------------------------------------------------------------ matrix
def test_parse_config_names():
    c = lib.parse_config_name("zero3_opt_cpu_param_cpu")
    assert (c.kind, c.stage, c.offload_optimizer, c.offload_param) == ("hf_zero", 3, "cpu", "cpu")
    assert c.label() == "hf_zero ZeRO-3 +opt cpu +param cpu"
    d = lib.parse_config_name("ds2_opt_nvme")
    assert (d.kind, d.stage, d.offload_optimizer, d.uses_nvme, d.is_alternative) == ("deepspeed", 2, "nvme", True, True)
    assert d.label() == "DeepSpeed ZeRO-2 +opt nvme"
    assert lib.parse_config_name("ddp").label() == "Trainer DDP"
    assert lib.parse_config_name("fsdp2").kind == "fsdp2"
    assert not lib.parse_config_name("zero1").is_alternative


@pytest.mark.parametrize(
    "name, message",
    [
        ("zero4", "unknown configuration"),
        ("zero0_opt_cpu", "stage 1, 2 or 3"),
        ("zero2_param_cpu", "needs stage 3"),
        ("zero3_param_nvme", "needs an offloaded optimizer"),
        ("zero3_opt_disk", "unknown configuration"),
        ("fsdp", "unknown configuration"),
    ],
)
def test_parse_config_name_rejects(name, message):
    with pytest.raises(ValueError, match=message):
        lib.parse_config_name(name)


def test_matrix_groups_order_and_duplicates():
    configs, notes = lib.build_config_matrix("ddp, zero,zero2,ds3", deepspeed_available=True)
    assert [c.name for c in configs] == ["ddp", "zero0", "zero1", "zero2", "zero3", "ds3"]
    assert notes == []
    default, _ = lib.build_config_matrix("default", deepspeed_available=True)
    assert [c.name for c in default] == list(lib.DEFAULT_CONFIGS)


def test_matrix_drops_deepspeed_when_unavailable():
    configs, notes = lib.build_config_matrix(["default"], deepspeed_available=False)
    assert all(c.kind != "deepspeed" for c in configs)
    assert "ds2" in notes[0] and "ds3" in notes[0]
    with pytest.raises(ValueError, match="no configuration left"):
        lib.build_config_matrix("ds2", deepspeed_available=False)


def test_zero_config_dict():
    cfg = lib.zero_config_dict(lib.parse_config_name("zero3_opt_nvme_param_nvme"), nvme_path="/nvme", sub_group_size=10**8)
    zero = cfg["zero_optimization"]
    assert zero["stage"] == 3 and zero["sub_group_size"] == 10**8
    assert zero["offload_optimizer"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/nvme"}
    assert zero["offload_param"]["device"] == "nvme"
    assert cfg["train_micro_batch_size_per_gpu"] == "auto" and cfg["bf16"] == {"enabled": "auto"}
    assert "aio" in cfg and "optimizer" not in cfg  # hf_zero uses the Trainer's optimizer
    assert "offload_optimizer" not in lib.zero_config_dict(lib.parse_config_name("zero0"))["zero_optimization"]
    # DeepSpeed's optimizer offload needs its own (CPU) Adam: an "auto" AdamW section.
    ds = lib.zero_config_dict(lib.parse_config_name("ds2_opt_cpu"))
    assert ds["optimizer"]["type"] == "AdamW" and ds["optimizer"]["params"]["lr"] == "auto"
    with pytest.raises(ValueError, match="nvme_path"):
        lib.zero_config_dict(lib.parse_config_name("zero2_opt_nvme"))
    with pytest.raises(ValueError, match="not a ZeRO"):
        lib.zero_config_dict(lib.parse_config_name("ddp"))


def test_zero_config_is_valid_for_hf_zero():
    from hf_zero.config.parse import parse_config

    for name in ("zero0", "zero1_opt_cpu", "zero2", "zero3_opt_cpu_param_cpu", "zero3_opt_nvme"):
        parse_config(lib.zero_config_dict(lib.parse_config_name(name), nvme_path="/tmp/nvme"))


def test_param_count_matches_transformers():
    import torch
    from transformers import AutoModelForCausalLM

    for preset in ("tiny", "7b"):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(run_bench.qwen2_config(lib.PRESETS[preset]))
        assert sum(p.numel() for p in model.parameters()) == lib.qwen2_param_count(lib.PRESETS[preset])
    assert lib.qwen2_param_count(lib.PRESETS["7b"]) == 7_615_616_512  # Qwen2-7B


# ------------------------------------------------------------------------------------------ memory cap
def test_memory_cap_fraction():
    assert lib.memory_cap_fraction(24 * 2**30, 80 * 2**30) == pytest.approx(0.3)
    assert lib.memory_cap_fraction(lib.parse_size("24GB"), 81559 * 2**20) == pytest.approx(24 * 1024 / 81559)
    assert lib.memory_cap_fraction(10, 10) == 1.0
    with pytest.raises(ValueError, match="exceeds the card"):
        lib.memory_cap_fraction(lib.parse_size("96GB"), 80 * 2**30)
    with pytest.raises(ValueError, match="positive"):
        lib.memory_cap_fraction(0, 80 * 2**30)


@pytest.mark.parametrize(
    "text, expected",
    [("24GB", 24 * 2**30), ("24GiB", 24 * 2**30), ("24g", 24 * 2**30), ("512MB", 512 * 2**20), ("1.5G", 3 * 2**29), ("80e9", 80 * 10**9), (1024, 1024)],
)
def test_parse_size(text, expected):
    assert lib.parse_size(text) == expected


@pytest.mark.parametrize("text", ["24XB", "", "GB", "-1GB", "0"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        lib.parse_size(text)


# ------------------------------------------------------------------------------------------ statistics
def test_step_stats_drop_warmup():
    stats = lib.step_stats([9.0, 5.0, 1.0, 2.0, 3.0, 4.0], warmup=2)
    assert stats == {"steps_measured": 4, "median_s": 2.5, "min_s": 1.0, "max_s": 4.0, "mean_s": 2.5, "total_s": 10.0}
    assert lib.tokens_per_second(1000, stats) == pytest.approx(400.0)
    with pytest.raises(ValueError, match="no step left"):
        lib.step_stats([1.0, 2.0], warmup=2)


def _result(name, tps, rss=None, accel=None, status="ok"):
    kind = lib.parse_config_name(name).kind
    return {"name": name, "label": lib.parse_config_name(name).label(), "kind": kind, "status": status,
            "tokens_per_s": tps, "rss_over_baseline_bytes": rss, "peak_accel_bytes": accel}


def test_pick_round_reports_the_fastest():
    rounds = [_result("zero3", 90.0), _result("zero3", 110.0), _result("zero3", None, status="failed"), _result("zero3", 100.0)]
    best = lib.pick_round(rounds)
    assert best["tokens_per_s"] == 110.0 and best["rounds_tokens_per_s"] == [90.0, 110.0, 100.0] and best["rounds_failed"] == 1
    assert lib.fmt_tokens_per_s(best) == "110 (100)"
    assert lib.fmt_tokens_per_s(_result("zero3", 99.6)) == "100"
    failed = lib.pick_round([_result("zero3", None, status="failed"), {**_result("zero3", None, status="timeout")}])
    assert failed["status"] == "timeout"
    with pytest.raises(ValueError):
        lib.pick_round([])
    header = lib.results_table([{**best, "step_median_s": 1, "step_min_s": 1, "step_max_s": 1}]).splitlines()[0]
    assert "tokens/s, best (median)" in header


def test_ratios_against_every_alternative():
    results = [_result("ddp", 100.0, rss=400), _result("fsdp2", 50.0, rss=200), _result("zero3", 80.0, rss=100),
               _result("ds3", 40.0, rss=0), _result("zero2", 1.0, status="failed")]
    ratios = lib.compute_ratios(results)
    assert set(ratios) == {"ddp", "fsdp2", "zero3", "ds3"}  # failed runs get none
    assert set(ratios["zero3"]) == {"ddp", "fsdp2", "ds3"}  # failed runs are no reference either
    assert ratios["zero3"]["ddp"] == {"speed": pytest.approx(0.8), "memory": pytest.approx(0.25)}
    assert ratios["zero3"]["fsdp2"] == {"speed": pytest.approx(1.6), "memory": pytest.approx(0.5)}
    assert ratios["zero3"]["ds3"]["memory"] is None  # zero reference
    assert ratios["ddp"]["ddp"] == {"speed": 1.0, "memory": 1.0}


def test_memory_metric_prefers_accelerator():
    assert lib.memory_metric({"peak_accel_bytes": 5, "rss_over_baseline_bytes": 9}) == ("peak accelerator memory (busiest rank)", 5)
    assert lib.memory_metric({"peak_accel_bytes": None, "rss_over_baseline_bytes": 9})[1] == 9
    assert lib.memory_metric({})[1] is None


# ------------------------------------------------------------------------------------------ tables
def test_results_table():
    ok = {**_result("zero3", 1234.4, rss=300 * 2**20), "step_median_s": 0.25, "step_min_s": 0.2, "step_max_s": 0.5,
          "peak_rss_node_bytes": 3 * 2**30, "final_loss": 8.123456}
    failed = {**_result("ds3", None, status="failed"), "error": "Traceback\nline\ntorch.OutOfMemoryError: CUDA out of memory. Tried"}
    table = lib.results_table([ok, failed]).splitlines()
    assert table[0].startswith("| configuration | tokens/s | step median (s)")
    assert table[1].count("---") == 9
    assert table[2] == "| hf_zero ZeRO-3 | 1234 | 0.250 | 0.200 | 0.500 | n/a | 3.00 GiB | 300 MiB | 8.1235 |"
    assert "**failed**: torch.OutOfMemoryError: CUDA out of memory." in table[3]
    assert all(line.count("|") == 10 for line in table)


def test_ratio_table():
    results = [_result("ddp", 100.0, rss=400), _result("zero3", 80.0, rss=100)]
    table = lib.ratio_table(results).splitlines()
    assert table[0] == "| configuration | vs Trainer DDP (speed / mem) |"
    assert table[3] == "| hf_zero ZeRO-3 | 0.80x / 0.25x |"
    assert "no alternative" in lib.ratio_table([_result("zero3", 80.0, rss=100)])


def test_markdown_escapes_and_short_error():
    assert lib.markdown_table(["a"], [["x|y\nz"]]).splitlines()[2] == "| x\\|y z |"
    assert lib.short_error("a\nValueError: bad\nmore") == "ValueError: bad"
    assert lib.short_error("") == "no output"
    assert len(lib.short_error("Error: " + "x" * 500)) == 160
    assert lib.fmt_bytes(None) == "n/a" and lib.fmt_bytes(3 * 2**30) == "3.00 GiB" and lib.fmt_bytes(5 * 2**20) == "5 MiB"


# ------------------------------------------------------------------------------------------ arguments
def test_parse_args_defaults_and_preset():
    args = run_bench.parse_args([])
    assert args.preset == "tiny" and args.shape == lib.PRESETS["tiny"]
    assert (args.seq_len, args.micro_batch, args.steps, args.nproc_per_node, args.dtype) == (128, 2, 20, 2, "bf16")
    assert args.cap_bytes is None and args.configs == "default" and args.repeat == 1 and args.malloc_mmap_threshold is None
    args = run_bench.parse_args(["--preset", "7b", "--gpu_memory_cap", "24GB", "--nproc_per_node", "1", "--configs", "zero3,ddp"])
    assert args.shape["hidden"] == 3584 and args.shape["tie"] is False and args.cap_bytes == 24 * 2**30


def test_parse_args_custom_shape():
    args = run_bench.parse_args(["--hidden", "512", "--layers", "2", "--heads", "8", "--vocab", "1000"])
    assert args.preset == "custom"
    assert args.shape == {"hidden": 512, "layers": 2, "heads": 8, "kv_heads": 8, "intermediate": 1368, "vocab": 1000, "tie": True}
    args = run_bench.parse_args(["--preset", "0.5b", "--layers", "2", "--untied"])
    assert args.preset == "0.5b" and args.shape["layers"] == 2 and args.shape["hidden"] == 896 and args.shape["tie"] is False


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--hidden", "100", "--heads", "3"], "multiple of heads"),
        (["--steps", "3", "--warmup_steps", "3"], "warmup_steps"),
        (["--gpu_memory_cap", "lots"], "cannot read memory size"),
        (["--configs", "zero9"], "unknown configuration"),
        (["--micro_batch", "0"], "micro_batch"),
        (["--repeat", "0"], "repeat"),
        (["--preset", "70b"], "invalid choice"),
    ],
)
def test_parse_args_rejects(argv, message, capsys):
    with pytest.raises(SystemExit):
        run_bench.parse_args(argv)
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ aggregation
def test_aggregate_rank_records():
    args = Namespace(nproc_per_node=2, warmup_steps=1, seq_len=8, micro_batch=2, grad_accum=1)
    config = lib.parse_config_name("zero2")
    common = {"status": "ok", "node": "h", "peak_accel_bytes": None, "params": 10, "trainable_params": 10}
    records = [
        {**common, "rank": 0, "step_times_s": [5.0, 1.0, 1.0, 3.0], "baseline_rss_bytes": 100, "peak_rss_bytes": 300,
         "final_loss": 2.0, "losses": [3.0, 2.0]},
        {**common, "rank": 1, "step_times_s": [5.0, 2.0, 1.0, 1.0], "baseline_rss_bytes": 100, "peak_rss_bytes": 500},
    ]
    r = run_bench.aggregate(config, records, args)
    assert r["status"] == "ok" and r["step_times_s"] == [5.0, 2.0, 1.0, 3.0]  # the slowest rank of each step
    assert (r["step_median_s"], r["step_min_s"], r["step_max_s"]) == (2.0, 1.0, 3.0)
    assert r["tokens_per_step"] == 32 and r["tokens_per_s"] == pytest.approx(32 * 3 / 6.0)
    assert (r["peak_rss_node_bytes"], r["baseline_rss_node_bytes"], r["rss_over_baseline_bytes"]) == (800, 200, 600)
    assert r["peak_accel_bytes"] is None and r["final_loss"] == 2.0
    missing = run_bench.aggregate(config, records[:1], args)
    assert missing["status"] == "failed" and "1 of 2 ranks" in missing["error"]
    json.dumps(r)


def test_worker_spec(tmp_path):
    args = run_bench.parse_args(["--configs", "zero3_opt_nvme", "--gpu_memory_cap", "24GB"])
    spec = run_bench.worker_spec(lib.parse_config_name("zero3_opt_nvme"), args, tmp_path / "m", tmp_path / "r", tmp_path / "nvme")
    assert spec["kind"] == "hf_zero" and spec["gpu_memory_cap_bytes"] == 24 * 2**30
    assert spec["zero_config"]["zero_optimization"]["offload_optimizer"]["nvme_path"] == str(tmp_path / "nvme" / "zero3_opt_nvme")
    assert (tmp_path / "nvme" / "zero3_opt_nvme").is_dir()
    assert "zero_config" not in run_bench.worker_spec(lib.parse_config_name("ddp"), args, tmp_path, tmp_path, tmp_path)


# ------------------------------------------------------------------------------------------ uncapped rows, deadline
def test_uncapped_rows_and_cap_verdict(tmp_path):
    args = run_bench.parse_args(["--configs", "zero3,zero3_opt_cpu", "--gpu_memory_cap", "24GB", "--uncapped", "zero3"])
    assert args.uncapped_names == {"zero3"}
    specs = {n: run_bench.worker_spec(lib.parse_config_name(n), args, tmp_path, tmp_path, tmp_path) for n in ("zero3", "zero3_opt_cpu")}
    assert specs["zero3"]["gpu_memory_cap_bytes"] is None and specs["zero3_opt_cpu"]["gpu_memory_cap_bytes"] == 24 * 2**30
    with pytest.raises(SystemExit):
        run_bench.parse_args(["--uncapped", "zero3"])  # nothing to be exempt from
    cap = 24 * lib.GiB
    assert lib.cap_verdict({"status": "ok", "gpu_memory_cap_bytes": cap, "peak_accel_bytes": 20 * lib.GiB}, cap).startswith("yes")
    assert lib.cap_verdict({"status": "ok", "gpu_memory_cap_bytes": None, "peak_accel_bytes": 23 * lib.GiB}, cap).startswith("yes")
    assert lib.cap_verdict({"status": "ok", "gpu_memory_cap_bytes": None, "peak_accel_bytes": 31 * lib.GiB}, cap).startswith("no")
    oom = {"status": "failed", "gpu_memory_cap_bytes": cap, "error": "torch.OutOfMemoryError: CUDA out of memory. Tried"}
    assert lib.cap_verdict(oom, cap) == "no: out of memory under the cap"
    assert lib.cap_verdict({**oom, "error": "ValueError: bad"}, cap) is None  # another failure says nothing
    assert lib.cap_verdict({"status": "ok", "gpu_memory_cap_bytes": None, "peak_accel_bytes": None}, cap) is None  # CPU
    assert lib.cap_verdict(oom, None) is None


def test_run_process_group_ends_the_whole_group(tmp_path):
    """A timeout must end the children too (torchrun's ranks), not only the process started."""
    import time

    pid_file = tmp_path / "child.pid"
    cmd = ["sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"]
    t = time.perf_counter()
    assert lib.run_process_group(cmd, timeout=1.0) is None
    assert time.perf_counter() - t < 30
    child = int(pid_file.read_text())
    for _ in range(50):  # the kill is delivered; the child may take a moment to be reaped by init
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        if Path(f"/proc/{child}/stat").exists() and Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"child {child} of the timed-out command is still running")
    assert lib.run_process_group(["sh", "-c", "exit 3"], timeout=10) == 3


# ------------------------------------------------------------------------------------------ the GPU session's plan
session_lib = _load("_gpu_session_lib")


def test_session_plans_differ_only_in_shapes_and_limits():
    gpu, cpu = session_lib.GPU, session_lib.CPU
    assert gpu.full.configs == cpu.full.configs == session_lib.FULL_CONFIGS
    assert [w.configs for w in gpu.lora] == [session_lib.LORA_CONFIGS] * 2 and cpu.lora[0].configs == session_lib.LORA_CONFIGS
    assert gpu.full.uncapped == cpu.full.uncapped and gpu.cap == cpu.cap == "24GB"
    assert {w.extra_args for w in (*gpu.lora, *cpu.lora)} == {("--lora_rank", "8", "--gradient_checkpointing")}
    args = gpu.full.bench_args(cap=gpu.cap)
    assert args[:2] == ["--preset", "1.5b"] and args[args.index("--seq_len") + 1] == "1024"
    assert args[args.index("--gpu_memory_cap") + 1] == "24GB" and args[args.index("--uncapped") + 1] == "fsdp2,zero2,zero3,ds3"
    assert args[args.index("--nproc_per_node") + 1] == "1"
    # every plan parses as run_bench arguments (the CPU dry run runs the same code)
    for workload in (gpu.full, *gpu.lora, cpu.full, *cpu.lora):
        parsed = run_bench.parse_args(workload.bench_args(cap="24GB"))
        assert parsed.configs == ",".join(workload.configs)
    assert [w.shape_args[1] for w in gpu.lora] == ["7b", "3b"]  # largest first
    assert "--uncapped" not in gpu.lora[0].bench_args(cap="24GB")  # LoRA rows all run under the cap


def test_session_budget_and_lora_choice():
    gpu = session_lib.GPU
    assert gpu.budget_s <= 9 * 60  # the limit for the whole command
    assert session_lib.pick_lora(gpu, 1000).shape_args[1] == "7b"
    assert session_lib.pick_lora(gpu, gpu.lora[0].need_s - 1).shape_args[1] == "3b"
    assert session_lib.pick_lora(gpu, gpu.lora[1].need_s - 1) is None
    # the full phase leaves the smallest LoRA workload and the summary their time
    end = session_lib.full_phase_deadline(gpu, 0.0)
    assert end == gpu.budget_s - gpu.lora[-1].need_s - gpu.summary_reserve_s
    # a rerun of full rows alone (--phases full --budget_s 200) keeps its whole budget for them
    assert session_lib.full_phase_deadline(gpu, 10.0, 200.0, lora_follows=False) == 10.0 + 200.0 - gpu.summary_reserve_s
    assert gpu.env_limit_s + gpu.doctor_limit_s < end  # the steps before the benchmark cannot eat it


def _row(name, tps, accel, rss, status="ok", **extra):
    c = lib.parse_config_name(name)
    return {"name": name, "label": c.label(), "kind": c.kind, "status": status, "tokens_per_s": tps, "peak_accel_bytes": accel,
            "peak_rss_node_bytes": rss, "step_median_s": 0.5, "final_loss": 2.0, **extra}


def test_session_comparisons_against_the_goals():
    payloads = {
        "full": {"results": [_row("fsdp2", 100.0, 30 * lib.GiB, 10), _row("zero3", 96.0, 29 * lib.GiB, 10),
                             _row("ds3", 120.0, 28 * lib.GiB, 20), _row("zero3_opt_cpu", 50.0, 9 * lib.GiB, 40),
                             _row("ds3_opt_cpu", 40.0, 10 * lib.GiB, 30), _row("zero2", None, None, None, status="failed")]},
        "lora": None,
    }
    rows = {(r["workload"], r["configuration"], r["against"]): r for r in session_lib.comparison_rows(payloads, gpu=True)}
    z3_fsdp = rows[("full", "hf_zero ZeRO-3", "Trainer --fsdp (FSDP2)")]
    assert z3_fsdp["speed"] == pytest.approx(0.96) and z3_fsdp["verdict"] == "speed met (+1%)"
    z3_ds = rows[("full", "hf_zero ZeRO-3", "DeepSpeed ZeRO-3")]
    assert z3_ds["speed"] == pytest.approx(0.8) and "speed missed (-20%)" in z3_ds["verdict"] and "memory missed (+4%)" in z3_ds["verdict"]
    off = rows[("full", "hf_zero ZeRO-3 +opt cpu", "DeepSpeed ZeRO-3 +opt cpu")]
    assert off["speed"] == pytest.approx(1.25) and off["gpu_memory"] == pytest.approx(0.9) and off["host_rss"] == pytest.approx(4 / 3)
    assert "speed met" in off["verdict"] and "memory met" in off["verdict"]
    assert not any(k[1] == "hf_zero ZeRO-2" for k in rows)  # a failed row is compared with nothing
    assert all(r["verdict"] == "not judged (CPU dry run)" for r in session_lib.comparison_rows(payloads, gpu=False))
    table = session_lib.comparison_table(list(rows.values()))
    assert table.splitlines()[0].startswith("| workload | hf_zero | against | tokens/s ratio")
    results = session_lib.result_rows({"full": ["zero3", "zero2", "ds3_opt_cpu", "zero3_opt_cpu_param_cpu"], "lora": ["zero3"]},
                                      payloads, {"full:zero3_opt_cpu_param_cpu": "why not", "lora": "no time"})
    assert [r[2].split(":")[0] for r in results] == ["ok", "failed", "ok", "not run", "not run"]
    assert results[3][2] == "not run: why not" and results[4][2] == "not run: no time"
    assert all(len(r) == len(session_lib.RESULT_HEADER) for r in results)


# ------------------------------------------------------------------------------------------ the CPU dry run
SESSION = BENCH / "gpu_session.py"
DS_PYTHON = os.environ.get("HF_ZERO_DEEPSPEED_PYTHON", "/tmp/ds-venv/bin/python")
QUICK_ROWS = ("full:zero3_opt_cpu_param_cpu", "full:ds3_opt_cpu", "lora:zero3", "lora:ds3")
"""The rows the quick dry run keeps: per workload one hf_zero and one DeepSpeed row (hf_zero with
both offloads against DeepSpeed with its compiled CPU Adam; LoRA at stage 3 for both), so that
every step of the session runs in about a minute; each row is a torchrun job of 10-40 s on the 2
shared cores. HF_ZERO_BENCH_ALL_ROWS=1 runs every row (about 5 minutes)."""


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """``bench/gpu_session.py --cpu`` once: the GPU session's steps on tiny shapes with gloo.

    The doctor step is left out here (tests/unit/test_doctor.py runs the doctor; here it would add
    30-90 s); DeepSpeed's rows run when its separate venv is there (its ops come from the JIT cache
    after the first run, which builds them for minutes)."""
    import subprocess

    out, work = tmp_path_factory.mktemp("session_out"), tmp_path_factory.mktemp("session_work")
    has_ds = Path(DS_PYTHON).exists()
    cmd = [sys.executable, str(SESSION), "--cpu", "--out", str(out), "--work_dir", str(work), "--phases", "env,full,lora"]
    if not os.environ.get("HF_ZERO_BENCH_ALL_ROWS"):
        cmd += ["--only", ",".join(QUICK_ROWS)]
    cmd += ["--ds_python", DS_PYTHON] if has_ds else []
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    record = json.loads((out / "session.json").read_text()) if (out / "session.json").exists() else None
    return proc, out, record, has_ds


def _planned(record, workload):
    rows = record["plan"][workload]
    return [c for c in rows if os.environ.get("HF_ZERO_BENCH_ALL_ROWS") or f"{workload}:{c}" in QUICK_ROWS]


@pytest.mark.slow
def test_dry_run_files_and_hf_zero_rows(dry_run):
    proc, out, record, has_ds = dry_run
    assert record is not None, proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # what the device tool returns: at most 8 files, plain names, directly under $OUT
    files = sorted(p.name for p in out.iterdir())
    expected = {"session.md", "session.json", "full.json", "lora.json", "logs.tar.gz"}
    if importlib.util.find_spec("matplotlib"):
        expected |= {"full.png", "lora.png"}
    assert set(files) == expected and len(files) <= 7
    assert all(p.is_file() for p in out.iterdir())
    assert record["steps"]["env"]["status"] == "ok" and record["env"]["versions"]["torch"]
    assert set(record["plan"]) == {"full", "lora"}
    assert record["plan"]["full"] == list(session_lib.FULL_CONFIGS)
    results = {(w, r["name"]): r for w, p in record["payloads"].items() for r in p["results"]}
    hf_rows = [(w, c) for w in ("full", "lora") for c in _planned(record, w) if not c.startswith("ds")]
    assert hf_rows
    for key in hf_rows:
        r = results[key]
        assert r["status"] == "ok", (key, r.get("error"))
        assert r["tokens_per_s"] > 0 and r["peak_rss_node_bytes"] > r["baseline_rss_node_bytes"] > 0
        assert r["steps_measured"] == 3 and len(r["losses"]) == 4
    # the same model, data and seed: every row of a workload ends at the same loss (FSDP2 reduces in
    # bf16: 0.2% off the others in the recorded run)
    for workload in ("full", "lora"):
        losses = [r["final_loss"] for (w, _), r in results.items() if w == workload and r["status"] == "ok"]
        assert max(losses) - min(losses) < 0.01 * min(losses), (workload, losses)
    # rows not run say why; every planned row is in the report and the logs
    md = (out / "session.md").read_text()
    for workload in ("full", "lora"):
        for name in record["plan"][workload]:
            assert lib.parse_config_name(name).label() in md
            if (workload, name) not in results:
                assert record["not_run"].get(f"{workload}:{name}"), (workload, name)
    pairs = session_lib.comparison_rows(record["payloads"], gpu=False)
    if pairs:
        assert "| workload | hf_zero | against | tokens/s ratio" in md and "not judged (CPU dry run)" in md
    else:  # no alternative ran (the quick rows without DeepSpeed)
        assert not has_ds and "(no pair of rows ran: no ratios)" in md
    import tarfile

    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert "logs/env.log" in names and "logs/env.json" in names and "logs/full.log" in names
    for workload, name in results:
        assert f"{workload}/runs/{name}/log.txt" in names and f"{workload}/runs/{name}/rank0.json" in names


@pytest.mark.slow
def test_dry_run_deepspeed_rows(dry_run):
    proc, out, record, has_ds = dry_run
    if not has_ds:
        pytest.skip(f"no DeepSpeed venv at {DS_PYTHON} (set HF_ZERO_DEEPSPEED_PYTHON): DeepSpeed is never an hf_zero "
                    "dependency, so CI has none; the hf_zero rows are checked by test_dry_run_files_and_hf_zero_rows")
    assert record is not None, proc.stderr[-3000:]
    assert record["steps"]["ds_cpu_adam_build"]["status"] == "ok"
    results = {(w, r["name"]): r for w, p in record["payloads"].items() for r in p["results"]}
    ds_rows = [(w, c) for w in ("full", "lora") for c in _planned(record, w) if c.startswith("ds")]
    assert ds_rows
    for key in ds_rows:
        r = results[key]
        assert r["status"] == "ok", (key, r.get("error"))
        assert r["deepspeed_engine"]["zero_stage"] == 3 and r["tokens_per_s"] > 0
        # the same training under hf_zero and under DeepSpeed ends at the same loss
        hf = [v["final_loss"] for (w, n), v in results.items() if w == key[0] and v["kind"] == "hf_zero"]
        assert hf and all(abs(r["final_loss"] - h) < 1e-2 * h for h in hf), (key, r["final_loss"], hf)
    assert results[("full", "ds3_opt_cpu")]["deepspeed_engine"]["offload_optimizer"] == "cpu"
    compared = {(c["workload"], c["configuration"], c["against"]) for c in session_lib.comparison_rows(record["payloads"], gpu=False)}
    assert ("lora", "hf_zero ZeRO-3", "DeepSpeed ZeRO-3") in compared
