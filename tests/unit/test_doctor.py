"""``hf-zero doctor`` on CPU (gloo, 2 ranks): it passes here, and it catches what is broken on purpose.

The worker's hidden ``--inject`` breaks one thing: a wrong update in the offloaded runs only, a
rank that contributes a wrong value to an all-reduce, a rank that never answers.
"""

from __future__ import annotations

import json
import time

import pytest

from hf_zero.cli.main import main
from hf_zero.diagnostics.doctor import CheckRow, DoctorReport, _merge, render


def _doctor(capsys, *args: str) -> tuple[int, dict]:
    code = main(["doctor", "--nproc_per_node", "2", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def _rows(report: dict) -> dict[str, dict]:
    return {r["name"]: r for r in report["checks"]}


@pytest.mark.slow
def test_doctor_passes_on_cpu_with_every_stage_and_offload(capsys, tmp_path):
    t0 = time.monotonic()
    code, report = _doctor(capsys, "--nvme_path", str(tmp_path))
    assert time.monotonic() - t0 < 120
    rows = _rows(report)
    assert code == 0 and report["ok"], report
    for name in ("device", "collectives-fp32", "collectives-bf16", "train:s0-fp32", "train:s1-opt-cpu-fp32",
                 "train:s2-opt-cpu-fp32", "train:s2-nvme-fp32", "train:s3-param-cpu-fp32", "train:s3-nvme-fp32",
                 "train:s2-fp16", "peak-memory"):
        assert rows[name]["status"] == "pass", (name, rows[name])
    offloaded = rows["train:s3-param-cpu-fp32"]["per_rank"]["0"]
    assert offloaded["rel_diff_vs_no_offload"] <= 1e-5 and offloaded["resume_rel_diff"] <= 1e-5
    assert offloaded["export_files"] >= 1


@pytest.mark.slow
def test_doctor_fails_the_offload_rows_when_offload_trains_wrong(capsys):
    code, report = _doctor(capsys, "--inject", "offload")
    rows = _rows(report)
    assert code == 1 and not report["ok"]
    assert rows["train:s2-opt-cpu-fp32"]["status"] == "fail"
    assert "differ from the run without offload" in rows["train:s2-opt-cpu-fp32"]["detail"]
    assert rows["train:s3-param-cpu-fp32"]["status"] == "fail"
    assert rows["train:s2-fp32"]["status"] == "pass" and rows["train:s3-fp32"]["status"] == "pass"


@pytest.mark.slow
def test_doctor_reports_wrong_collective_values_and_hangs(capsys, tmp_path):
    code, report = _doctor(capsys, "--inject", "collective")
    assert code == 1
    assert "all_reduce gave" in _rows(report)["collectives-fp32"]["detail"]
    # A --keep folder reused from a run that passed must not lend its PASS to a check that hangs now.
    keep = tmp_path / "doctor"
    keep.mkdir()
    for rank in (0, 1):
        (keep / f"rank{rank}.jsonl").write_text('{"check": "collectives-fp32", "status": "pass", "seconds": 0.1}\n')
    code, report = _doctor(capsys, "--inject", "hang", "--timeout", "20", "--keep", str(keep))
    assert code == 1
    hung = _rows(report)["collectives-fp32"]
    assert hung["status"] == "hang" and "no answer before the deadline" in hung["detail"]


def test_merge_takes_the_worst_rank_and_names_a_silent_rank(tmp_path):
    (tmp_path / "rank0.jsonl").write_text(
        '{"check": "device", "status": "start"}\n{"check": "device", "status": "pass", "seconds": 0.1, "device": "cuda:0"}\n'
        '{"check": "collectives-fp32", "status": "start"}\n{"check": "collectives-fp32", "status": "pass", "seconds": 1}\n'
    )
    (tmp_path / "rank1.jsonl").write_text(
        '{"check": "device", "status": "start"}\n{"check": "device", "status": "pass", "seconds": 0.2, "device": "cuda:1"}\n'
        '{"check": "collectives-fp32", "status": "start"}\n{"check": "collectives-fp32", "sta'  # killed mid-line
    )
    rows = {r.name: r for r in _merge(tmp_path, 2, finished=False)}
    assert rows["device"].status == "pass" and rows["device"].seconds == 0.2
    assert rows["collectives-fp32"].status == "hang"
    assert rows["collectives-fp32"].detail == "rank(s) 1: no answer before the deadline"


def test_render_says_what_to_do_for_each_failure():
    report = DoctorReport([CheckRow("device", "pass"), CheckRow("pinned-copy", "fail", detail="rank 0: boom")], nproc=2)
    text = render(report)
    assert "| pinned-copy | FAIL |" in text and "ulimit -l" in text and text.endswith("Some checks FAILED.")
    assert not report.ok

