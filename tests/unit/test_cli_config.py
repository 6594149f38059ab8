"""``hf-zero config check``: output and exit codes, in-process and as ``python -m hf_zero.cli.main``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_zero.cli import main as cli_main
from hf_zero.cli.main import main

SEEDS = Path("/work/shared/seed_configs")
if not SEEDS.is_dir():  # pragma: no cover
    SEEDS = Path(__file__).resolve().parents[2] / "shared" / "seed_configs"
REPO = Path(__file__).resolve().parents[2]


def test_check_prints_resolved_json(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["config", "check", str(SEEDS / "chatglm3_ds_zero_2.json"), "--per_device_train_batch_size", "4",
                 "--gradient_accumulation_steps", "2", "--world_size", "2", "--bf16", "--max_grad_norm", "0.7"])
    out = capsys.readouterr().out
    assert code == 0
    report = json.loads(out)
    config = report["config"]
    assert config["train_batch_size"] == 16 and config["train_micro_batch_size_per_gpu"] == 4
    assert config["gradient_clipping"] == 0.7
    assert config["bf16"]["enabled"] is True and config["fp16"]["enabled"] is False
    assert config["zero_optimization"]["stage"] == 2
    assert report["unresolved"] == []
    assert any(line.startswith("zero_optimization.contiguous_gradients: no effect") for line in report["no_effect"])


def test_check_merges_fragments_and_lists_auto(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["config", "check", str(SEEDS / "openmind_zero1.json"), str(SEEDS / "openmind_optimizer.json"),
                 str(SEEDS / "openmind_scheduler.json")])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert report["config"]["optimizer"]["type"] == "adamw"
    assert "optimizer.lr" in report["unresolved"] and "scheduler.params.total_num_steps" in report["unresolved"]


def test_check_resolves_scheduler_and_buckets(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["config", "check", str(SEEDS / "openmind_zero3_full.json"), str(SEEDS / "openmind_scheduler.json"),
                 "--learning_rate", "1e-4", "--warmup_ratio", "0.1", "--num_training_steps", "200",
                 "--hidden_size", "16", "--world_size", "1"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["unresolved"] == []
    params = report["config"]["scheduler"]["params"]
    assert (params["warmup_max_lr"], params["warmup_num_steps"], params["total_num_steps"]) == (1e-4, 20, 200)
    assert report["config"]["optimizer"]["betas"] == [0.9, 0.999]
    assert report["config"]["zero_optimization"]["reduce_bucket_size"] == 256


def test_check_reports_mismatches_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8}))
    code = main(["config", "check", str(path), "--per_device_train_batch_size", "2"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert "2 problem(s)" in captured.err
    assert f"{path}: train_micro_batch_size_per_gpu=4 but --per_device_train_batch_size=2" in captured.err
    assert "gradient_accumulation_steps=8 but --gradient_accumulation_steps=1" in captured.err


def test_check_invalid_config_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"zero_optimization": {"stage": 5}}')
    assert main(["config", "check", str(path)]) == 2
    assert f"{path}: zero_optimization.stage=5" in capsys.readouterr().err


def test_check_non_strict_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "typo.json"
    path.write_text('{"zero_optimization": {"stage": 2, "overlap_com": true}}')
    assert main(["config", "check", str(path)]) == 2
    capsys.readouterr()
    assert main(["config", "check", str(path), "--non_strict"]) == 0
    captured = capsys.readouterr()
    assert 'warning:' in captured.err and "overlap_com" in captured.err
    assert json.loads(captured.out)["config"]["zero_optimization"]["stage"] == 2


def test_check_notes_missing_nvme_folder(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "check", str(SEEDS / "llm_book_zero3_offload_nvme.json")]) == 0
    notes = json.loads(capsys.readouterr().out)["notes"]
    if not os.path.isdir("/nvme_data"):
        assert any("nvme_path='/nvme_data' does not exist" in note for note in notes)


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["config"]) == 2
    with pytest.raises(SystemExit) as info:
        main(["config", "check"])  # FILE is required
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["nonsense"])
    assert info.value.code == 2


def test_missing_command_module_is_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli_main, "_COMMAND_MODULES", ["hf_zero.cli.config_cmd", "hf_zero.cli.no_such_cmd"])
    with pytest.raises(ModuleNotFoundError):
        main(["config", "check", str(SEEDS / "openmind_zero1.json")])


def test_python_dash_m_entry_point(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    ok = subprocess.run([sys.executable, "-m", "hf_zero.cli.main", "config", "check",
                         str(SEEDS / "openmind_zero2_full.json"), "--bf16", "--world_size", "2"],
                        capture_output=True, text=True, env=env, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    report = json.loads(ok.stdout)
    assert report["config"]["train_batch_size"] == 16  # 2 ranks x 8 (default micro) x 1
    assert report["config"]["bf16"]["enabled"] is True

    bad = tmp_path / "broken.json"
    bad.write_text("{\n  \"zero_optimization\": {\"stage\": 2,}\n}\n")
    failed = subprocess.run([sys.executable, "-m", "hf_zero.cli.main", "config", "check", str(bad)],
                            capture_output=True, text=True, env=env, cwd=tmp_path)
    assert failed.returncode == 2
    assert f"{bad}:2:" in failed.stderr and failed.stdout == ""
