"""``hf-zero env``: the facts a bug report needs (versions, GPUs, host limits, environment, NVMe).

Every fact is best-effort: one that cannot be read says ``"unknown (<reason>)"`` instead of raising,
and subprocesses and the NVMe probe give up after :data:`TIMEOUT_S`, so the report always ends.
The parsers of ``/proc`` files and ``nvidia-smi`` output are pure functions of text. Use::

    report = collect_env(nvme_path="/mnt/nvme"); print(render_text(report)); report.to_json()
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import glob
import importlib.metadata
import json
import mmap
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import uuid
import warnings as _warnings
from collections.abc import Callable, Mapping
from typing import Any

from hf_zero.utils.host_memory import (  # noqa: F401 -- re-exported: the report's parsers
    cgroup_memory,
    parse_cgroup_limit,
    parse_meminfo,
    parse_proc_self_cgroup,
)

__all__ = ["EnvReport", "check_o_direct", "collect_env", "environment_variables", "find_mount", "format_bytes",
           "parse_cgroup_limit", "parse_meminfo", "parse_nvidia_smi_csv", "parse_proc_self_cgroup", "render_text"]

TIMEOUT_S = 10.0  # longest wait for one nvidia-smi call or for the whole NVMe probe
SHM_MIN_BYTES = 2**30  # a smaller /dev/shm gets a warning (Docker's default is 64 MiB)
PACKAGES = ("transformers", "accelerate", "peft", "safetensors", "datasets", "deepspeed")
ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
             "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF",
             "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED", "HF_ZERO_", "ACCELERATE_")
SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD")
REDACTED, UNSET = "<redacted>", "(unset)"
NVIDIA_SMI_FIELDS = ("index", "mig_mode", "driver_version", "ecc_mode")
_NVIDIA_SMI_QUERY = ["nvidia-smi", "--query-gpu=index,mig.mode.current,driver_version,ecc.mode.current",
                     "--format=csv,noheader"]
_PAGE = 4096  # O_DIRECT needs buffer, offset and length aligned to the logical block (4K disks)


@dataclasses.dataclass
class EnvReport:
    """The sections of ``hf-zero env``. Values are strings, lists of dicts (one per GPU) or a
    matrix of strings (P2P); ``nvme`` is ``None`` when no path was given."""

    versions: dict[str, str]
    gpus: dict[str, Any]
    distributed: dict[str, str]
    host: dict[str, str]
    environment: dict[str, str]
    nvme: dict[str, str] | None
    warnings: list[str]

    def to_dict(self) -> dict[str, Any]:
        """The report as plain dicts and lists."""
        return dataclasses.asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        """The report as JSON text (what ``hf-zero env --json`` prints)."""
        return json.dumps(self.to_dict(), indent=indent)


def find_mount(path: str, mounts_text: str) -> dict[str, str] | None:
    """The ``/proc/mounts`` entry (``{"device", "mount_point", "fstype"}``, or ``None``) holding absolute
    ``path``: the longest mount point that is a whole-component prefix of it; of equal ones the last,
    since a later mount hides an earlier one."""
    best: dict[str, str] | None = None
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        # /proc/mounts writes spaces, tabs and backslashes in names as octal escapes (\040).
        device, mount_point, fstype = (re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), f)
                                       for f in fields[:3])
        inside = mount_point == "/" or path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
        if inside and (best is None or len(mount_point) >= len(best["mount_point"])):
            best = {"device": device, "mount_point": mount_point, "fstype": fstype}
    return best


def parse_nvidia_smi_csv(text: str) -> list[dict[str, str]]:
    """Rows of ``nvidia-smi --query-gpu=index,mig.mode.current,driver_version,ecc.mode.current
    --format=csv,noheader`` as dicts keyed by :data:`NVIDIA_SMI_FIELDS`; ``ValueError`` for a bad line."""
    rows = []
    for line in filter(str.strip, text.splitlines()):
        values = [v.strip() for v in line.split(",")]
        if len(values) != len(NVIDIA_SMI_FIELDS):
            raise ValueError(f"unexpected nvidia-smi line {line!r}")
        rows.append(dict(zip(NVIDIA_SMI_FIELDS, values)))
    return rows


def environment_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that change a run: :data:`ENV_NAMES` (``(unset)`` when absent) and all those
    starting with one of :data:`ENV_PREFIXES`. Values of names containing TOKEN, KEY, SECRET or
    PASSWORD read ``<redacted>``: the report is meant to be pasted in public."""
    names = list(ENV_NAMES) + sorted(n for n in environ if n.startswith(ENV_PREFIXES) and n not in ENV_NAMES)
    return {n: UNSET if n not in environ else REDACTED if any(m in n.upper() for m in SECRET_MARKERS)
            else environ[n] for n in names}


def format_bytes(num_bytes: float) -> str:
    """``num_bytes`` in binary units: ``"512 B"``, ``"64.00 MiB"``."""
    units, exponent = ("B", "KiB", "MiB", "GiB", "TiB"), 0
    while num_bytes >= 1024 ** (exponent + 1) and exponent < len(units) - 1:
        exponent += 1
    return f"{num_bytes / 1024**exponent:.2f} {units[exponent]}" if exponent else f"{int(num_bytes)} B"


def _unknown(exc: BaseException) -> str:
    return f"unknown ({type(exc).__name__}: {exc})"


def _try(fn: Callable[[], Any]) -> Any:
    """``fn()``, or ``"unknown (<error>)"``: one unreadable fact must not lose the rest."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 -- the reason is reported instead
        return _unknown(exc)


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _run(cmd: list[str]) -> str:
    """stdout of ``cmd``; raises for a missing binary, a non-zero exit, or after :data:`TIMEOUT_S`."""
    if shutil.which(cmd[0]) is None:
        raise FileNotFoundError(f"{cmd[0]} not found on PATH")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    if proc.returncode != 0:  # nvidia-smi explains a missing driver on stdout
        raise RuntimeError(f"{cmd[0]} exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[:300]}")
    return re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout)  # `nvidia-smi topo -m` underlines its header


def _bounded(fn: Callable[[], dict[str, Any]], timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """``_section(fn)`` in a daemon thread, given up after ``timeout`` s: I/O on a hung network mount
    blocks in the kernel, where nothing can interrupt it, so the report only stops waiting."""
    result: list[dict[str, Any]] = []
    thread = threading.Thread(target=lambda: result.append(_section(fn)), name="hf-zero-env-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return result[0] if result else {"error": f"unknown (no answer after {timeout:g} s: a hung mount?)"}


def check_o_direct(directory: str) -> str:
    """Whether a file in ``directory`` takes ``O_DIRECT`` I/O: write one aligned 4 KiB page and read
    it back. Returns ``"yes"`` or ``"no (<error>)"``; the probe file is always removed."""
    if not hasattr(os, "O_DIRECT"):
        return "no (os.O_DIRECT does not exist on this platform)"
    path = os.path.join(directory, f".hf_zero_odirect_{os.getpid()}_{uuid.uuid4().hex[:8]}")
    fd = None
    with mmap.mmap(-1, _PAGE) as out, mmap.mmap(-1, _PAGE) as back:  # anonymous maps are page-aligned
        try:
            out.write(bytes(range(256)) * (_PAGE // 256))
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
            if os.write(fd, out) != _PAGE:
                return "no (short write)"
            return "yes" if os.preadv(fd, [back], 0) == _PAGE and back[:] == out[:] else "no (read back differs)"
        except OSError as exc:
            name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
            hint = ": the file system refuses O_DIRECT" if exc.errno == errno.EINVAL else ""
            return f"no ({name}: {exc.strerror or exc}{hint})"
        finally:
            if fd is not None:
                os.close(fd)
            with contextlib.suppress(OSError):  # a refused O_DIRECT open can still have created the file
                os.unlink(path)


def _cgroup_memory_limit() -> tuple[int | None, str]:
    cg = cgroup_memory()
    return cg.limit, cg.source


def _versions(torch: Any, cuda_available: bool) -> dict[str, str]:
    import hf_zero

    def os_name() -> str:
        try:  # the distribution ("Ubuntu 22.04.4 LTS") says more than platform()'s libc
            return f"{platform.freedesktop_os_release()['PRETTY_NAME']} ({platform.platform()})"
        except (OSError, KeyError, AttributeError):
            return platform.platform()

    def cudnn() -> str:
        ver = torch.backends.cudnn.version()
        if ver is None:
            return "not available"
        major, rest = divmod(ver, 10000 if ver >= 90000 else 1000)  # cuDNN 9 changed the encoding
        return f"{major}.{rest // 100}.{rest % 100} ({ver})"

    def dist_version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    out = {"hf_zero": f"{hf_zero.__version__} ({os.path.dirname(hf_zero.__file__)})",
           "python": f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})",
           "os": _try(os_name), "kernel": platform.release() or "unknown (platform.release() is empty)"}
    if torch is not None:
        from hf_zero.distributed import device as accel

        hip = getattr(torch.version, "hip", None)
        out["torch"] = f"{torch.__version__} ({os.path.dirname(torch.__file__)})"
        out["torch_cuda"] = torch.version.cuda or (f"none (ROCm build, HIP {hip})" if hip else "none (CPU-only build)")
        out["cudnn"] = _try(cudnn)
        out["nccl"] = (_try(accel.nccl_version) if cuda_available
                       else "n/a (no CUDA device visible)")
    out.update({name: _try(lambda name=name: dist_version(name)) for name in PACKAGES})
    return out


def _gpu_section(torch: Any, warnings: list[str]) -> dict[str, Any]:
    from hf_zero.distributed import device as accel

    with _warnings.catch_warnings(record=True) as caught:  # torch explains driver problems as warnings
        _warnings.simplefilter("always")
        available = accel.accelerator_available()
    smi = _try(lambda: parse_nvidia_smi_csv(_run(_NVIDIA_SMI_QUERY)))
    gpus: dict[str, Any] = {"cuda_available": "yes"}
    if available:
        count = accel.device_count()
        gpus["count"] = str(count)
        gpus["devices"] = [_section(lambda i=i: _device(torch, i, warnings)) for i in range(count)]
        gpus["p2p"] = _try(lambda: _p2p_matrix(torch, count, warnings))
    else:
        reasons = []
        if torch.version.cuda is None and not getattr(torch.version, "hip", None):
            reasons.append("torch is built without CUDA (torch.version.cuda is None: a CPU-only wheel)")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None and visible.strip() in ("", "-1"):
            reasons.append(f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU")
        reasons += [str(w.message).strip() for w in caught]
        reasons = reasons or [f"torch (CUDA {torch.version.cuda}) found no usable driver or device"]
        gpus["cuda_available"] = "no CUDA device visible: " + "; ".join(reasons)
        if isinstance(smi, list) and smi:
            warnings.append(f"nvidia-smi lists {len(smi)} GPU(s) but torch sees none: {reasons[0]}")
    gpus["nvidia_smi"] = smi  # physical (PCI) numbering, ignoring CUDA_VISIBLE_DEVICES: not torch's indices
    for row in smi if isinstance(smi, list) else []:
        if row["mig_mode"] == "Enabled":
            warnings.append(f"MIG is enabled on GPU {row['index']} (nvidia-smi index): a process sees one "
                            "MIG instance, and NCCL cannot connect MIG instances")
    if available or isinstance(smi, list):
        gpus["topology"] = _try(lambda: _run(["nvidia-smi", "topo", "-m"]).rstrip())
    return gpus


def _device(torch: Any, i: int, warnings: list[str]) -> dict[str, str]:
    from hf_zero.distributed import device as accel

    props = accel.device_properties(i)
    try:
        native = bool(accel.bf16_supported(i))
    except Exception:  # noqa: BLE001 -- an older torch without including_emulation: bf16 needs sm_80+
        native = (props.major, props.minor) >= (8, 0)
    if not native:
        warnings.append(f"GPU {i} ({props.name}, compute capability {props.major}.{props.minor}) has no native "
                        "bf16 (needs 8.0+): train in fp16 instead")
    return {"index": str(i), "name": props.name, "memory": format_bytes(props.total_memory),
            "compute_capability": f"{props.major}.{props.minor}", "bf16_native": "yes" if native else "no"}


def _p2p_matrix(torch: Any, count: int, warnings: list[str]) -> list[list[str]]:
    from hf_zero.distributed import device as accel

    matrix = [["-" if i == j else "yes" if accel.can_access_peer(i, j) else "no"
               for j in range(count)] for i in range(count)]
    missing = [f"{i}->{j}" for i in range(count) for j in range(count) if matrix[i][j] == "no"]
    if missing:
        shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} pairs)" if len(missing) > 8 else "")
        warnings.append(f"P2P unavailable between GPUs {shown}: NCCL routes that traffic through host "
                        "memory (slower, and it needs a large /dev/shm)")
    return matrix


def _host_section(torch: Any, gpu_present: bool, warnings: list[str]) -> dict[str, str]:
    import resource  # Unix only: imported here so that elsewhere only this section says unknown

    def cpu_model() -> str:
        match = re.search(r"^model name\s*:\s*(.+)$", _read("/proc/cpuinfo"), re.MULTILINE)
        return match.group(1).strip() if match else platform.processor() or "unknown (no 'model name' in /proc/cpuinfo)"

    def numa_nodes() -> str:
        count = len(glob.glob("/sys/devices/system/node/node[0-9]*"))
        return str(count) if count else "unknown (no /sys/devices/system/node/node*)"

    def cgroup_limit() -> str:
        limit, source = _cgroup_memory_limit()
        if limit is not None and isinstance(mem, dict) and limit < mem.get("MemTotal", 0):
            warnings.append(f"the cgroup (container) memory limit {format_bytes(limit)} is below host RAM "
                            f"{format_bytes(mem['MemTotal'])}: size CPU offload to the limit, not to `free`")
        return f"{'none' if limit is None else format_bytes(limit)} ({source})"

    def memlock() -> str:
        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        soft_text, hard_text = ("unlimited" if v == resource.RLIM_INFINITY else format_bytes(v) for v in (soft, hard))
        if gpu_present and soft != resource.RLIM_INFINITY:
            warnings.append(f"the locked-memory limit (ulimit -l) is {soft_text}, not unlimited: pinned host memory "
                            "for offload may fail, and NCCL over InfiniBand needs it; use `ulimit -l unlimited` "
                            "(Docker: --ulimit memlock=-1)")
        return f"{soft_text} (hard limit {hard_text})"

    def dev_shm() -> str:
        st = os.statvfs("/dev/shm")
        size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        if size < SHM_MIN_BYTES:
            warnings.append(f"/dev/shm is {format_bytes(size)}: NCCL's shared-memory transport and DataLoader "
                            "workers need more (Docker's default is 64 MiB); run with --shm-size=16g or --ipc=host")
        return f"{format_bytes(size)} total, {format_bytes(free)} free"

    mem = _try(lambda: parse_meminfo(_read("/proc/meminfo")))
    host = {"cpu_model": _try(cpu_model), "logical_cores": str(os.cpu_count()),
            "usable_cores": _try(lambda: str(len(os.sched_getaffinity(0)))), "numa_nodes": _try(numa_nodes)}
    for key, field in (("ram_total", "MemTotal"), ("ram_available", "MemAvailable")):
        if isinstance(mem, str):  # /proc/meminfo unreadable: its reason
            host[key] = mem
        else:
            host[key] = format_bytes(mem[field]) if field in mem else f"unknown (no {field} in /proc/meminfo)"
    host.update(cgroup_memory_limit=_try(cgroup_limit), memlock_limit=_try(memlock), dev_shm=_try(dev_shm))
    host["torch_threads"] = _try(lambda: str(torch.get_num_threads())) if torch is not None else "unknown (no torch)"
    return host


def _nvme_section(path: str, warnings: list[str]) -> dict[str, str]:
    real = os.path.realpath(os.path.expanduser(path))
    out = {"path": path, "realpath": real, "exists": "yes" if os.path.isdir(real) else
           "not a folder" if os.path.exists(real) else "no"}
    if out["exists"] != "yes":
        warnings.append(f"nvme_path {path} is not an existing folder: hf-zero refuses it; create it on a local disk")
        return out
    out["writable"] = "yes" if os.access(real, os.W_OK) else "no"
    if out["writable"] == "no":
        warnings.append(f"nvme_path {path} is not writable by this user")
    mount = _try(lambda: find_mount(real, _read("/proc/mounts")))
    if isinstance(mount, dict):
        out["filesystem"] = f"{mount['fstype']} ({mount['device']} mounted at {mount['mount_point']})"
        if mount["fstype"] in ("tmpfs", "ramfs"):
            warnings.append(f"nvme_path {path} is on {mount['fstype']}: 'NVMe' offload would live in RAM")
    else:
        out["filesystem"] = mount or "unknown (no /proc/mounts entry holds the path)"
    usage = _try(lambda: shutil.disk_usage(real))
    out["free"] = usage if isinstance(usage, str) else f"{format_bytes(usage.free)} free of {format_bytes(usage.total)}"
    out["o_direct"] = check_o_direct(real)
    if out["o_direct"] != "yes":
        warnings.append(f"O_DIRECT fails on nvme_path {path}: hf-zero falls back to buffered I/O, so swapped "
                        "state also fills the page cache (host RAM)")
    return out


def _section(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 -- the other sections still count
        return {"error": _unknown(exc)}


def collect_env(nvme_path: str | None = None) -> EnvReport:
    """Collect the ``hf-zero env`` report: an unreadable fact reads ``unknown (...)``, nothing hangs,
    and ``warnings`` name what a user must act on. ``nvme_path``: a folder to check for NVMe offload
    (file system, free space, O_DIRECT); ``None`` skips that check."""
    warnings: list[str] = []
    no_torch: dict[str, Any] = {}
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 -- a broken torch install is what the report must show
        torch, no_torch = None, {"error": _unknown(exc)}
    if torch is not None:
        gpus = _section(lambda: _gpu_section(torch, warnings))
        distributed = _section(lambda: {
            "torch.distributed": "yes" if torch.distributed.is_available() else "no (torch built without it)",
            "nccl": _try(lambda: "yes" if torch.distributed.is_nccl_available() else "no"),
            "gloo": _try(lambda: "yes" if torch.distributed.is_gloo_available() else "no")})
    else:
        gpus = distributed = no_torch
    cuda_available = gpus.get("cuda_available") == "yes"
    versions = _section(lambda: _versions(torch, cuda_available))
    if torch is None:
        versions["torch"] = no_torch["error"]
    host = _section(lambda: _host_section(torch, cuda_available, warnings))
    nvme, nvme_warnings = None, []
    if nvme_path is not None:
        nvme = {"path": nvme_path, **_bounded(lambda: _nvme_section(nvme_path, nvme_warnings))}
        warnings += list(nvme_warnings)  # a copy: a timed-out probe may still append later
    return EnvReport(versions=versions, gpus=gpus, distributed=distributed, host=host,
                     environment=_section(lambda: environment_variables(os.environ)), nvme=nvme, warnings=warnings)


_TITLES = {"versions": "Versions", "gpus": "GPUs", "distributed": "Distributed backends", "host": "Host",
           "environment": "Environment variables", "nvme": "NVMe path", "warnings": "Warnings"}


def _render_item(key: str, item: Any) -> list[str]:
    if isinstance(item, str) and "\n" in item:
        return [f"- {key}:", "```", item, "```"]
    if isinstance(item, str):
        return [f"- {key}: {item or chr(34) * 2}"]  # an empty value shows as "" (set but empty)
    if isinstance(item, list) and item and all(isinstance(row, dict) for row in item):
        return [f"- {key}:"] + ["  - " + ", ".join(f"{k}: {v}" for k, v in row.items()) for row in item]
    if isinstance(item, list) and item and all(isinstance(row, list) for row in item):  # GPU x GPU
        header = "    " + "".join(f"{j:>5}" for j in range(len(item)))
        return [f"- {key} (row GPU -> column GPU):", "```", header,
                *(f"{i:>4}" + "".join(f"{cell:>5}" for cell in row) for i, row in enumerate(item)), "```"]
    return [f"- {key}: {item}"]


def render_text(report: EnvReport) -> str:
    """The report as Markdown-ish text for a bug report: one ``###`` section per part, warnings last."""
    lines = ["## hf-zero env", ""]
    for name, title in _TITLES.items():
        value = getattr(report, name)
        lines.append(f"### {title}")
        if name == "warnings":
            lines += [f"- {w}" for w in value] or ["- none"]
        elif value is None:
            lines.append("- not checked (pass --nvme_path PATH)")
        else:
            for key, item in value.items():
                lines += _render_item(key, item)
        lines.append("")
    return "\n".join(lines)
