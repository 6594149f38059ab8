"""``hf-zero env``: the parsers on sample texts, redaction, the O_DIRECT probe, the report, the CLI."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import platform
import re
import subprocess
import time
from types import SimpleNamespace

import pytest
import torch

from hf_zero.cli import env_cmd
from hf_zero.diagnostics import env_report
from hf_zero.distributed import device as accel
from hf_zero.diagnostics.env_report import (
    REDACTED,
    UNSET,
    EnvReport,
    check_o_direct,
    collect_env,
    environment_variables,
    find_mount,
    format_bytes,
    parse_cgroup_limit,
    parse_meminfo,
    parse_nvidia_smi_csv,
    parse_proc_self_cgroup,
    render_text,
)

SECTIONS = ("versions", "gpus", "distributed", "host", "environment", "nvme", "warnings")
VERSION_KEYS = ("hf_zero", "python", "os", "kernel", "torch", "transformers", "accelerate", "peft",
                "safetensors", "datasets", "deepspeed")
MAX_SECONDS = 10.0

MEMINFO = """\
MemTotal:       32768000 kB
MemFree:         1024000 kB
MemAvailable:   16384000 kB
HugePages_Total:       0
Hugepagesize:       2048 kB
"""

MOUNTS = r"""/dev/vda / ext4 rw,relatime 0 0
proc /proc proc rw,nosuid 0 0
tmpfs /dev/shm tmpfs rw,size=65536k 0 0
/dev/nvme0n1p1 /mnt/nvme xfs rw,noatime 0 0
/dev/nvme1n1 /mnt/nvme/deep ext4 rw 0 0
/dev/sdb1 /mnt/my\040disk ext4 rw 0 0
tmpfs /dev/shm tmpfs rw,size=16777216k 0 0
"""


@pytest.fixture(scope="module")
def timed_report() -> tuple[EnvReport, float]:
    """One report for the module (collecting it imports and probes; do it once)."""
    start = time.perf_counter()
    report = collect_env(nvme_path=None)
    return report, time.perf_counter() - start


# ---------------------------------------------------------------------------- parsers


def test_parse_meminfo_in_bytes() -> None:
    info = parse_meminfo(MEMINFO)
    assert info["MemTotal"] == 32768000 * 1024
    assert info["MemAvailable"] == 16384000 * 1024
    assert info["HugePages_Total"] == 0  # a count, not kB
    assert parse_meminfo("garbage\n\n") == {}


@pytest.mark.parametrize(("text", "expected"), [
    ("max\n", None),                        # cgroup v2: no limit
    ("9223372036854771712\n", None),        # cgroup v1: "no limit" sentinel
    ("8589934592\n", 8 * 2**30),            # a real limit
    ("  17179869184  ", 16 * 2**30),
])
def test_parse_cgroup_limit(text: str, expected: int | None) -> None:
    assert parse_cgroup_limit(text) == expected


def test_parse_cgroup_limit_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        parse_cgroup_limit("lots")


def test_parse_proc_self_cgroup_v1_and_v2() -> None:
    v1 = "12:pids:/\n4:memory:/slurm/uid_1/job_7\n3:cpu,cpuacct:/\n0::/\n"
    assert parse_proc_self_cgroup(v1) == {"memory": "/slurm/uid_1/job_7", "v2": "/"}
    assert parse_proc_self_cgroup("0::/system.slice/job.scope\n") == {"v2": "/system.slice/job.scope"}


@pytest.mark.parametrize(("path", "mount_point", "fstype"), [
    ("/mnt/nvme/swap", "/mnt/nvme", "xfs"),
    ("/mnt/nvme", "/mnt/nvme", "xfs"),
    ("/mnt/nvme/deep/x", "/mnt/nvme/deep", "ext4"),      # the longest prefix wins
    ("/mnt/nvmeother/x", "/", "ext4"),                    # whole path components only
    ("/mnt/my disk/data", "/mnt/my disk", "ext4"),        # \040 is a space
    ("/home/user", "/", "ext4"),
])
def test_find_mount_longest_prefix(path: str, mount_point: str, fstype: str) -> None:
    mount = find_mount(path, MOUNTS)
    assert mount is not None
    assert (mount["mount_point"], mount["fstype"]) == (mount_point, fstype)


def test_find_mount_later_entry_hides_earlier() -> None:
    assert find_mount("/dev/shm/x", MOUNTS) == {"device": "tmpfs", "mount_point": "/dev/shm", "fstype": "tmpfs"}
    assert find_mount("/x", "proc /proc proc rw 0 0\n") is None


def test_parse_nvidia_smi_csv() -> None:
    text = "0, Disabled, 550.54.15, Enabled\n1, [N/A], 550.54.15, [N/A]\n\n"
    rows = parse_nvidia_smi_csv(text)
    assert rows == [
        {"index": "0", "mig_mode": "Disabled", "driver_version": "550.54.15", "ecc_mode": "Enabled"},
        {"index": "1", "mig_mode": "[N/A]", "driver_version": "550.54.15", "ecc_mode": "[N/A]"},
    ]
    assert parse_nvidia_smi_csv("") == []
    with pytest.raises(ValueError):
        parse_nvidia_smi_csv("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver")


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1536, 64 * 2**20, 24 * 2**30)] == \
        ["0 B", "1023 B", "1.50 KiB", "64.00 MiB", "24.00 GiB"]


# ---------------------------------------------------------------------------- environment variables


def test_environment_variables_selects_and_redacts() -> None:
    environ = {
        "CUDA_VISIBLE_DEVICES": "",            # set but empty: kept, it hides every GPU
        "NCCL_DEBUG": "INFO",
        "NCCL_IB_PASSWORD": "hunter2",
        "HF_ZERO_API_TOKEN": "tok-123",
        "ACCELERATE_SECRET_KEY": "s3cr3t",
        "TORCH_NCCL_BLOCKING_WAIT": "1",
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
        "MASTER_ADDR": "10.0.0.1",
        "HF_TOKEN": "hf_abc",                  # not a selected prefix: not shown at all
        "PATH": "/usr/bin",
    }
    env = environment_variables(environ)
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["NCCL_DEBUG"] == "INFO"
    assert env["TORCH_NCCL_BLOCKING_WAIT"] == "1"
    assert env["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"
    assert env["MASTER_ADDR"] == "10.0.0.1"
    assert env["NCCL_IB_PASSWORD"] == env["HF_ZERO_API_TOKEN"] == env["ACCELERATE_SECRET_KEY"] == REDACTED
    assert env["RANK"] == env["OMP_NUM_THREADS"] == UNSET
    assert "HF_TOKEN" not in env and "PATH" not in env
    dumped = json.dumps(env)
    assert not any(secret in dumped for secret in ("hunter2", "tok-123", "s3cr3t", "hf_abc"))


# ---------------------------------------------------------------------------- O_DIRECT probe


def test_o_direct_on_tmp_path(tmp_path) -> None:
    answer = check_o_direct(str(tmp_path))
    assert answer == "yes" or re.fullmatch(r"no \(.+\)", answer), answer
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def _kernel() -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", platform.release())
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def test_o_direct_refused_on_tmpfs() -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with open("/proc/mounts", encoding="utf-8") as f:
        mount = find_mount(os.path.realpath("/dev/shm"), f.read())
    if mount is None or mount["fstype"] != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs here")
    if _kernel() >= (6, 6):
        pytest.skip(f"Linux {platform.release()}: tmpfs accepts O_DIRECT since 6.6")
    before = set(os.listdir("/dev/shm"))
    assert check_o_direct("/dev/shm").startswith("no (EINVAL")
    assert set(os.listdir("/dev/shm")) <= before


def test_o_direct_refusal_reported_and_file_removed(tmp_path, monkeypatch) -> None:
    """What an old tmpfs does: the open creates the file, then fails with EINVAL."""
    real_open = os.open

    def refusing_open(path, flags, mode=0o777, **kwargs):
        if flags & getattr(os, "O_DIRECT", 0):
            os.close(real_open(path, flags & ~os.O_DIRECT, mode))
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, mode, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    answer = check_o_direct(str(tmp_path))
    if not hasattr(os, "O_DIRECT"):
        assert answer.startswith("no (")
    else:
        assert answer.startswith("no (EINVAL: Invalid argument"), answer
    assert list(tmp_path.iterdir()) == []


def test_nvme_section_on_tmp_path(tmp_path) -> None:
    warnings: list[str] = []
    nvme = env_report._nvme_section(str(tmp_path), warnings)
    assert nvme["exists"] == "yes" and nvme["writable"] == "yes"
    assert "free of" in nvme["free"]
    assert nvme["o_direct"] == "yes" or nvme["o_direct"].startswith("no (")
    missing = env_report._nvme_section(str(tmp_path / "absent"), warnings)
    assert missing["exists"] == "no"
    assert any("not an existing folder" in w for w in warnings)


def test_hung_probe_is_given_up() -> None:
    start = time.perf_counter()
    result = env_report._bounded(lambda: time.sleep(5) or {}, timeout=0.2)
    assert time.perf_counter() - start < 2
    assert result["error"].startswith("unknown (no answer after 0.2 s")


# ---------------------------------------------------------------------------- the report


def test_collect_env_has_every_section(timed_report) -> None:
    report, seconds = timed_report
    assert seconds < MAX_SECONDS
    data = report.to_dict()
    assert tuple(data) == SECTIONS
    assert data["nvme"] is None
    for key in VERSION_KEYS:
        assert data["versions"][key], key
    assert data["versions"]["torch"].startswith(torch.__version__)
    assert data["gpus"]["cuda_available"].startswith("yes" if torch.cuda.is_available() else "no CUDA device visible")
    for key in ("cpu_model", "logical_cores", "usable_cores", "numa_nodes", "ram_total", "ram_available",
                "cgroup_memory_limit", "memlock_limit", "dev_shm", "torch_threads"):
        assert data["host"][key], key
    assert data["host"]["logical_cores"] == str(os.cpu_count())
    assert set(data["distributed"]) >= {"nccl", "gloo"}
    assert "CUDA_VISIBLE_DEVICES" in data["environment"]
    assert isinstance(data["warnings"], list)


def test_without_cuda_the_report_says_why(timed_report) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    gpus = timed_report[0].gpus
    assert gpus["cuda_available"].startswith("no CUDA device visible: ")
    if torch.version.cuda is None:
        assert "built without CUDA" in gpus["cuda_available"]


def test_render_text_and_json(timed_report) -> None:
    report = timed_report[0]
    text = render_text(report)
    assert "torch" in text and torch.__version__ in text
    for title in ("### Versions", "### GPUs", "### Host", "### Environment variables", "### Warnings"):
        assert title in text
    assert "not checked (pass --nvme_path PATH)" in text
    assert json.loads(report.to_json()) == report.to_dict()


def test_warnings_for_small_shm_low_memlock_and_cgroup(monkeypatch) -> None:
    real_statvfs = os.statvfs

    def small_shm(path):
        if path == "/dev/shm":
            return SimpleNamespace(f_blocks=16384, f_frsize=4096, f_bavail=16384)  # 64 MiB: Docker's default
        return real_statvfs(path)

    import resource

    monkeypatch.setattr(os, "statvfs", small_shm)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (65536, 65536))
    monkeypatch.setattr(env_report, "_cgroup_memory_limit", lambda: (2**20, "/sys/fs/cgroup/memory.max"))
    monkeypatch.setattr(env_report, "parse_meminfo", lambda text: {"MemTotal": 2**34, "MemAvailable": 2**33})
    warnings: list[str] = []
    host = env_report._host_section(torch, True, warnings)
    assert host["dev_shm"].startswith("64.00 MiB total")
    assert host["memlock_limit"] == "64.00 KiB (hard limit 64.00 KiB)"
    assert host["cgroup_memory_limit"] == "1.00 MiB (/sys/fs/cgroup/memory.max)"
    text = "\n".join(warnings)
    assert "/dev/shm is 64.00 MiB" in text
    assert "ulimit -l" in text
    assert "below host RAM 16.00 GiB" in text


def test_gpu_section_with_a_fake_two_gpu_torch(monkeypatch) -> None:
    """The CUDA path on a CPU machine: one pre-Ampere GPU, no P2P, MIG on the second."""
    current = [0]

    @contextlib.contextmanager
    def device(i):
        previous, current[0] = current[0], i
        yield
        current[0] = previous

    props = [SimpleNamespace(name="Tesla V100", total_memory=32 * 2**30, major=7, minor=0),
             SimpleNamespace(name="NVIDIA A100", total_memory=80 * 2**30, major=8, minor=0)]
    class TwoGpus(accel.CudaRuntime):
        def available(self):
            return True

        def device_count(self):
            return 2

        def device_properties(self, i):
            return props[i]

        def bf16_supported(self, index=None):
            with device(index):
                return props[current[0]].major >= 8

        def can_access_peer(self, i, j):
            return False

    fake_torch = SimpleNamespace(version=SimpleNamespace(cuda="12.4", hip=None))
    outputs = {"--query-gpu=index,mig.mode.current,driver_version,ecc.mode.current":
               "0, Disabled, 550.54.15, Enabled\n1, Enabled, 550.54.15, Enabled\n",
               "topo": "\tGPU0\tGPU1\nGPU0\t X \tSYS\nGPU1\tSYS\t X \n"}
    monkeypatch.setattr(env_report, "_run", lambda cmd: outputs[cmd[1]])
    warnings: list[str] = []
    with accel.use_runtime(TwoGpus()):
        gpus = env_report._gpu_section(fake_torch, warnings)
    assert gpus["count"] == "2"
    assert [d["bf16_native"] for d in gpus["devices"]] == ["no", "yes"]
    assert gpus["devices"][1] == {"index": "1", "name": "NVIDIA A100", "memory": "80.00 GiB",
                                  "compute_capability": "8.0", "bf16_native": "yes"}
    assert gpus["p2p"] == [["-", "no"], ["no", "-"]]
    assert gpus["nvidia_smi"][1]["mig_mode"] == "Enabled"
    assert "SYS" in gpus["topology"]
    text = "\n".join(warnings)
    assert "GPU 0 (Tesla V100, compute capability 7.0) has no native bf16" in text
    assert "P2P unavailable between GPUs 0->1, 1->0" in text
    assert "MIG is enabled on GPU 1" in text
    rendered = render_text(EnvReport({}, gpus, {}, {}, {}, None, warnings))
    assert "- p2p (row GPU -> column GPU):" in rendered and "  - index: 0, name: Tesla V100" in rendered


# ---------------------------------------------------------------------------- CLI


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hf-zero")
    env_cmd.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_env_json(capsys, monkeypatch) -> None:
    monkeypatch.setenv("HF_ZERO_TEST_TOKEN", "do-not-print-me")
    args = _parse(["env", "--json"])
    assert args.json and args.nvme_path is None
    start = time.perf_counter()
    assert args.func(args) == 0
    assert time.perf_counter() - start < MAX_SECONDS
    out = capsys.readouterr().out
    data = json.loads(out)
    assert set(VERSION_KEYS) <= set(data["versions"])
    assert data["environment"]["HF_ZERO_TEST_TOKEN"] == REDACTED
    assert "do-not-print-me" not in out


def test_cli_env_text_with_nvme_path(capsys, tmp_path) -> None:
    args = _parse(["env", "--nvme-path", str(tmp_path)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "### NVMe path" in out and f"- path: {tmp_path}" in out and "- o_direct: " in out
    assert list(tmp_path.iterdir()) == []


def test_run_strips_color_and_bounds_time(monkeypatch) -> None:
    assert env_report._run(["printf", r"\033[4mGPU0\033[0m\tX"]) == "GPU0\tX"
    with pytest.raises(RuntimeError, match="exited 1"):
        env_report._run(["false"])
    with pytest.raises(FileNotFoundError, match="not found on PATH"):
        env_report._run(["hf-zero-no-such-binary"])
    monkeypatch.setattr(env_report, "TIMEOUT_S", 0.2)
    start = time.perf_counter()
    with pytest.raises(subprocess.TimeoutExpired):
        env_report._run(["sleep", "5"])
    assert time.perf_counter() - start < 3
