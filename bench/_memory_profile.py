"""Where a configuration's peak accelerator memory lives: per-phase peaks and the blocks alive at the peak.

``bench/run_bench.py --memory_profile`` asks each worker for :class:`MemoryProfile`: a
TrainerCallback (plus a forward hook on the model) that records, for every optimizer step, the
peak of ``torch.cuda.max_memory_allocated`` in the forward, the backward and the optimizer step,
and records CUDA's allocator history (``torch.cuda.memory._record_memory_history``, Python stacks)
over one step after the warm-up. :func:`live_at_peak` replays that history: the moment the
allocated bytes peaked and, grouped by the Python frames that allocated them, the blocks alive
then. The worker writes both to ``memory_profile.json`` and a readable ``memory_profile.md``.

The replay is plain Python over the snapshot's dictionaries (tested on CPU with a synthetic
trace); only the recording needs CUDA.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

__all__ = ["CudaMeter", "HostMeter", "MemoryProfile", "live_at_peak", "frame_key", "phase_summary", "render_markdown"]

PHASES = ("setup", "forward", "backward", "step")

# Frames worth naming a block by, most specific first: our code, then the libraries that allocate.
_INTERESTING = ("hf_zero/", "deepspeed/", "peft/", "transformers/models/", "transformers/", "accelerate/",
                "torch/distributed/fsdp/", "torch/distributed/", "torch/optim/", "torch/nn/", "torch/utils/checkpoint")
_SKIP = ("torch/cuda/memory.py", "bench/_memory_profile.py", "torch/_tensor.py", "torch/utils/_contextlib.py",
         "torch/nn/modules/module.py")


def frame_key(frames: list[dict[str, Any]], depth: int = 3) -> str:
    """A short label for an allocation: the first ``depth`` interesting Python frames, innermost first.

    >>> frame_key([{"filename": "/x/torch/nn/functional.py", "line": 10, "name": "linear"},
    ...            {"filename": "/x/transformers/models/qwen2/modeling_qwen2.py", "line": 50, "name": "forward"}], 2)
    'torch/nn/functional.py:10 linear < transformers/models/qwen2/modeling_qwen2.py:50 forward'
    """
    picked = []
    for f in frames or []:
        name = f.get("filename", "")
        if any(s in name for s in _SKIP):
            continue
        for marker in _INTERESTING:
            i = name.find(marker)
            if i >= 0:
                picked.append(f"{name[i:]}:{f.get('line', '?')} {f.get('name', '?')}")
                break
        if len(picked) >= depth:
            break
    return " < ".join(picked) if picked else "(no Python frame: autograd engine or C++)"


def live_at_peak(trace: list[dict[str, Any]], allocated_at_start: int, top: int = 25) -> dict[str, Any]:
    """Replay one device's allocator trace; the peak and what was alive at it.

    ``trace`` is ``torch.cuda.memory._snapshot()["device_traces"][device]``: entries with
    ``action`` (``alloc``, ``free_completed``, ...), ``addr``, ``size`` and ``frames``.
    ``allocated_at_start`` is ``torch.cuda.memory_allocated()`` when the recording began: blocks
    allocated before it have no entry until they are freed, and count as "before the recording".

    >>> t = [{"action": "alloc", "addr": 1, "size": 10, "frames": []},
    ...      {"action": "alloc", "addr": 2, "size": 5, "frames": []},
    ...      {"action": "free_completed", "addr": 1, "size": 10, "frames": []},
    ...      {"action": "free_completed", "addr": 99, "size": 7, "frames": []}]
    >>> r = live_at_peak(t, allocated_at_start=100)
    >>> r["peak_bytes"], r["before_recording_bytes"], r["recorded_live_bytes"]
    (115, 100, 15)
    """
    live: dict[int, tuple[int, str]] = {}
    before = allocated_at_start
    current = allocated_at_start
    peak = current
    peak_live: dict[int, tuple[int, str]] = {}
    peak_before = before
    peak_index = -1
    for index, entry in enumerate(trace):
        action = entry.get("action")
        addr, size = entry.get("addr"), int(entry.get("size", 0))
        if action == "alloc":
            live[addr] = (size, frame_key(entry.get("frames", [])))
            current += size
            if current > peak:
                peak, peak_live, peak_before, peak_index = current, dict(live), before, index
        elif action == "free_completed":
            if addr in live:
                current -= live.pop(addr)[0]
            else:  # allocated before the recording
                before -= size
                current -= size
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, key in peak_live.values():
        groups[key][0] += size
        groups[key][1] += 1
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    largest = sorted(peak_live.values(), key=lambda v: -v[0])[:top]
    return {
        "peak_bytes": peak,
        "peak_event_index": peak_index,
        "events": len(trace),
        "before_recording_bytes": peak_before,
        "recorded_live_bytes": sum(s for s, _ in peak_live.values()),
        "groups": [{"site": k, "bytes": v[0], "blocks": v[1]} for k, v in ranked[:top]],
        "other_groups_bytes": sum(v[0] for _, v in ranked[top:]),
        "largest_blocks": [{"bytes": s, "site": k} for s, k in largest],
    }


def phase_summary(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """One row's memory by phase from its ranks' ``memory_profile`` records: the setup's peak and
    the last step's forward/backward/step peaks. Accelerator memory: the busiest rank's. Host
    memory: summed over the ranks, each above its import baseline (``baseline_rss_bytes``), like
    the bench's RSS columns; plus glibc's bytes in use after the step, summed.

    >>> r = {"baseline_rss_bytes": 100, "memory_profile": {"meter": "host (VmHWM / VmRSS)", "setup_peak": 400,
    ...      "phases": [{"forward_peak": 300, "backward_peak": 350, "step_peak": 320, "in_use_after_step": 90}]}}
    >>> phase_summary([r, r])["bytes"]
    {'setup': 600, 'forward': 400, 'backward': 500, 'step': 440, 'in_use_after_step': 180}
    """
    profiles = [(r, r["memory_profile"]) for r in records if r.get("memory_profile") and r["memory_profile"].get("phases")]
    if not profiles:
        return None
    host = profiles[0][1].get("meter", "").startswith("host")
    keys = {"setup": None, "forward": "forward_peak", "backward": "backward_peak", "step": "step_peak"}
    out: dict[str, int | None] = {}
    for phase, key in keys.items():
        values = []
        for r, mp in profiles:
            v = mp.get("setup_peak") if key is None else mp["phases"][-1].get(key)
            if v is None:
                values = []
                break
            values.append(v - (r.get("baseline_rss_bytes", 0) if host else 0))
        out[phase] = (sum(values) if host else max(values)) if values else None
    if host:
        in_use = [mp["phases"][-1].get("in_use_after_step") for _, mp in profiles]
        out["in_use_after_step"] = sum(in_use) if all(v is not None for v in in_use) else None
    return {"meter": profiles[0][1].get("meter"), "host": host, "bytes": out}


def render_markdown(name: str, phases: list[dict[str, Any]], peak: dict[str, Any] | None,
                    setup_peak: int | None = None) -> str:
    """The profile as Markdown: the setup's peak, per-step phase peaks, then the blocks alive at the recorded peak."""
    gib = 2**30
    lines = [f"# Memory profile: {name}", ""]
    if setup_peak is not None:
        lines += [f"Peak before the first step (model placement, the engine's setup): {setup_peak / gib:.3f} GiB.", ""]
    keys = ["forward_peak", "backward_peak", "step_peak", "after_step"]
    heads = ["forward peak", "backward peak", "optimizer step peak", "allocated (RSS on a CPU) after step"]
    if any(p.get("in_use_after_step") is not None for p in phases):
        keys.append("in_use_after_step")
        heads.append("malloc in use after step")
    lines += ["| step | " + " | ".join(heads) + " |", "|---:|" + "---:|" * len(heads)]
    for p in phases:
        cells = [f"{p[k] / gib:.3f} GiB" if p.get(k) is not None else "-" for k in keys]
        lines.append(f"| {p['step']} | " + " | ".join(cells) + " |")
    if peak:
        lines += ["", f"Recorded step: peak {peak['peak_bytes'] / gib:.2f} GiB at event {peak['peak_event_index']} of "
                  f"{peak['events']}; allocated before the recording and still alive: "
                  f"{peak['before_recording_bytes'] / gib:.2f} GiB; allocated during it: {peak['recorded_live_bytes'] / gib:.2f} GiB.",
                  "", "| GiB | blocks | allocated at |", "|---:|---:|---|"]
        for g in peak["groups"]:
            lines.append(f"| {g['bytes'] / gib:.3f} | {g['blocks']} | `{g['site']}` |")
        lines.append(f"| {peak['other_groups_bytes'] / gib:.3f} | | (other sites) |")
        lines += ["", "Largest blocks alive at the peak:", "", "| MiB | allocated at |", "|---:|---|"]
        for b in peak["largest_blocks"]:
            lines.append(f"| {b['bytes'] / 2**20:.1f} | `{b['site']}` |")
    return "\n".join(lines) + "\n"


class CudaMeter:
    """Accelerator memory: ``torch.cuda``'s allocated bytes and their resettable peak."""

    name = "accelerator (torch.cuda.max_memory_allocated)"
    history = True

    def __init__(self, cuda: Any = None):
        if cuda is None:
            import torch

            cuda = torch.cuda
        self.cuda = cuda

    def peak(self) -> int:
        self.cuda.synchronize()
        return self.cuda.max_memory_allocated()

    def reset(self) -> None:
        self.cuda.reset_peak_memory_stats()

    def current(self) -> int:
        return self.cuda.memory_allocated()

    def in_use(self) -> int | None:
        return None


class HostMeter:
    """Host memory of this process: the resident set and its high-water mark, which writing 5 to
    ``/proc/self/clear_refs`` resets (Linux), and glibc's bytes in use (``mallinfo2``), which leave
    out the heap's free but resident pages (fragmentation)."""

    name = "host (VmHWM / VmRSS)"
    history = False

    def __init__(self, status_path: str = "/proc/self/status", clear_refs: str = "/proc/self/clear_refs"):
        self.status_path, self.clear_refs = status_path, clear_refs
        self._mallinfo2 = None
        try:
            import ctypes

            libc = ctypes.CDLL(None)
            fn = libc.mallinfo2

            class _Info(ctypes.Structure):
                _fields_ = [(k, ctypes.c_size_t) for k in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                           "fsmblks", "uordblks", "fordblks", "keepcost")]

            fn.restype = _Info
            self._mallinfo2 = fn
        except (OSError, AttributeError):
            pass

    def _status(self, key: str) -> int:
        with open(self.status_path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        return 0

    def peak(self) -> int:
        return self._status("VmHWM")

    def reset(self) -> None:
        try:
            with open(self.clear_refs, "w") as f:
                f.write("5")
        except OSError:
            pass

    def current(self) -> int:
        return self._status("VmRSS")

    def in_use(self) -> int | None:
        if self._mallinfo2 is None:
            return None
        info = self._mallinfo2()
        return int(info.uordblks + info.hblkhd)


class MemoryProfile:
    """Per-phase peaks every step (forward, backward, optimizer step), the peak before the first
    step (model placement and the engine's setup), and -- on CUDA -- the allocator history of step
    ``record_step`` (1-based).

    Install with ``profile = MemoryProfile(model, record_step)``, pass ``profile.callback`` to the
    Trainer, and read ``profile.result()`` after ``train()``. ``meter`` is a :class:`CudaMeter`
    (the default with CUDA) or a :class:`HostMeter` (the default without).
    """

    def __init__(self, model: Any, record_step: int, max_entries: int = 400_000, cuda: Any = None, meter: Any = None):
        from transformers import TrainerCallback

        if meter is None:
            if cuda is None:
                import torch

                meter = CudaMeter() if torch.cuda.is_available() else HostMeter()
            else:
                meter = CudaMeter(cuda)
        self.meter = meter
        self._cuda = getattr(meter, "cuda", None)
        self.error: str | None = None
        self.record_step = record_step
        self.max_entries = max_entries
        self.phases: list[dict[str, Any]] = []
        self.peak: dict[str, Any] | None = None
        self.setup_peak: int | None = None  # before the first step: the engine's setup, the model's move
        self.overall_peak = 0  # what the meter's peak would say without the resets below
        self._current: dict[str, Any] = {}
        self._recording_start = 0
        profile = self
        model.register_forward_hook(lambda *_: profile._forward_done())

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                profile._step_begin(state.global_step + 1)

            def on_pre_optimizer_step(self, args, state, control, **kw):
                profile._mark("backward_peak")

            def on_optimizer_step(self, args, state, control, **kw):
                profile._mark("step_peak")

            def on_step_end(self, args, state, control, **kw):
                profile._step_end()

        self.callback = _Callback()

    def loaded(self) -> None:
        """Call once the model is loaded: the setup's peak then starts here (not at the load)."""
        self.overall_peak = max(self.overall_peak, self.meter.peak())
        self.meter.reset()

    def _mark(self, key: str) -> None:
        self._current[key] = self.meter.peak()
        self.overall_peak = max(self.overall_peak, self._current[key])
        self.meter.reset()

    def _forward_done(self) -> None:
        if self._current and "forward_peak" not in self._current:
            self._mark("forward_peak")

    def _step_begin(self, step: int) -> None:
        before = self.meter.peak()  # since the last reset: the setup, or the end of the last step
        if self.setup_peak is None:
            self.setup_peak = before
        self.overall_peak = max(self.overall_peak, before)
        self.meter.reset()
        self._current = {"step": step, "before_step": self.meter.current()}
        if step == self.record_step and self.meter.history:
            self._recording_start = self.meter.current()
            self._cuda.memory._record_memory_history(max_entries=self.max_entries, stacks="python")

    def _step_end(self) -> None:
        self._current["after_step"] = self.meter.current()
        self._current["in_use_after_step"] = self.meter.in_use()
        self.overall_peak = max(self.overall_peak, self.meter.peak())
        self.phases.append(self._current)
        if self._current.get("step") == self.record_step and self.meter.history:
            cuda = self._cuda
            try:  # a profile is a bonus: the row's timing must not fail with it
                snapshot = cuda.memory._snapshot()
                cuda.memory._record_memory_history(enabled=None)
                traces = snapshot.get("device_traces") or [[]]
                trace = traces[cuda.current_device()] if len(traces) > cuda.current_device() else traces[0]
                self.peak = live_at_peak(trace, self._recording_start)
            except Exception as exc:  # noqa: BLE001
                self.error = repr(exc)
        self._current = {}

    def result(self) -> dict[str, Any]:
        return {"meter": self.meter.name, "record_step": self.record_step, "setup_peak": self.setup_peak,
                "overall_peak": self.overall_peak, "phases": self.phases, "peak": self.peak, "error": self.error}
