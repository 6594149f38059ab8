"""bench/_memory_profile.py: the replay of CUDA's allocator trace and the callback's bookkeeping,
driven on CPU by a fake ``torch.cuda`` namespace in the order the Trainer calls its callbacks."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
try:
    import _memory_profile as mp
finally:
    sys.path.remove(str(BENCH))


def _frames(*names):
    return [{"filename": f"/site-packages/{n.split(':')[0]}", "line": int(n.split(':')[1]), "name": "f"} for n in names]


def test_live_at_peak_replays_allocs_and_frees():
    act = _frames("transformers/models/qwen2/modeling_qwen2.py:10")
    grad = _frames("hf_zero/offload/grad_feeds.py:99")
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": act},
        {"action": "alloc", "addr": 2, "size": 50, "frames": grad},
        {"action": "free_requested", "addr": 1, "size": 100, "frames": act},  # not yet free
        {"action": "alloc", "addr": 3, "size": 30, "frames": grad},  # peak: 1000 + 180 - 0
        {"action": "free_completed", "addr": 1, "size": 100, "frames": act},
        {"action": "free_completed", "addr": 77, "size": 400, "frames": []},  # from before the recording
        {"action": "alloc", "addr": 4, "size": 60, "frames": act},
    ]
    r = mp.live_at_peak(trace, allocated_at_start=1000)
    assert r["peak_bytes"] == 1180 and r["peak_event_index"] == 3
    assert r["before_recording_bytes"] == 1000 and r["recorded_live_bytes"] == 180
    sites = {g["site"]: (g["bytes"], g["blocks"]) for g in r["groups"]}
    assert sites == {"hf_zero/offload/grad_feeds.py:99 f": (80, 2), "transformers/models/qwen2/modeling_qwen2.py:10 f": (100, 1)}
    assert [b["bytes"] for b in r["largest_blocks"]] == [100, 50, 30]


def test_frame_key_skips_wrappers_and_names_autograd():
    frames = _frames("torch/nn/modules/module.py:1", "torch/nn/functional.py:5", "accelerate/x.py:7", "hf_zero/a.py:3")
    assert mp.frame_key(frames, depth=2) == "torch/nn/functional.py:5 f < accelerate/x.py:7 f"
    assert mp.frame_key([]).startswith("(no Python frame")


class _FakeCuda:
    """torch.cuda's memory counters over a number the test moves by hand."""

    def __init__(self):
        self.allocated = 0
        self.peak = 0
        self.recording = False
        self.trace = []
        self.memory = SimpleNamespace(_record_memory_history=self._record, _snapshot=lambda: {"device_traces": [self.trace]})

    def _record(self, enabled="all", **kw):
        self.recording = enabled is not None

    def alloc(self, addr, size):
        self.allocated += size
        self.peak = max(self.peak, self.allocated)
        if self.recording:
            self.trace.append({"action": "alloc", "addr": addr, "size": size, "frames": _frames("hf_zero/x.py:1")})

    def free(self, addr, size):
        self.allocated -= size
        if self.recording:
            self.trace.append({"action": "free_completed", "addr": addr, "size": size, "frames": []})

    def synchronize(self):
        pass

    def max_memory_allocated(self):
        return self.peak

    def reset_peak_memory_stats(self):
        self.peak = self.allocated

    def memory_allocated(self):
        return self.allocated

    def current_device(self):
        return 0


def test_callback_records_phase_peaks_and_the_chosen_step():
    cuda = _FakeCuda()
    model = torch.nn.Linear(2, 2)
    prof = mp.MemoryProfile(model, record_step=2, cuda=cuda)
    cb = prof.callback
    state = SimpleNamespace(global_step=0)
    cuda.alloc(0, 1000)  # parameters
    cuda.alloc(5, 4000)  # a setup transient (fp32 weights on the way to 16 bit)
    cuda.free(5, 4000)
    for step in (1, 2):
        cb.on_step_begin(None, state, None)
        cuda.alloc(10 * step, 300)  # activations
        model(torch.zeros(1, 2))  # the forward hook closes the forward phase
        cuda.alloc(10 * step + 1, 200)  # gradients
        cuda.free(10 * step, 300)
        cb.on_pre_optimizer_step(None, state, None)
        cuda.alloc(10 * step + 2, 50)  # a step temporary
        cuda.free(10 * step + 2, 50)
        cuda.free(10 * step + 1, 200)
        cb.on_optimizer_step(None, state, None)
        state.global_step += 1
        cb.on_step_end(None, state, None)
    out = prof.result()
    assert out["error"] is None
    assert [p["step"] for p in out["phases"]] == [1, 2]
    p2 = out["phases"][1]
    assert (p2["forward_peak"], p2["backward_peak"], p2["step_peak"], p2["after_step"]) == (1300, 1500, 1250, 1000)
    assert out["peak"]["peak_bytes"] == 1500 and out["peak"]["before_recording_bytes"] == 1000
    assert not cuda.recording  # stopped after the recorded step
    assert out["setup_peak"] == 5000 and out["overall_peak"] == 5000
    md = mp.render_markdown("zero3_opt_cpu", out["phases"], out["peak"], out["setup_peak"])
    assert "first step (model placement, the engine's setup): 0.000 GiB" in md
    assert "| 2 | 0.000 GiB" in md and "hf_zero/x.py:1" in md


def test_host_meter_reads_this_process(tmp_path):
    """The CPU meter: VmRSS/VmHWM of this process, the high-water mark reset (clear_refs 5), and
    glibc's bytes in use growing with a live allocation."""
    meter = mp.HostMeter()
    before = meter.in_use()
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, live
    assert meter.peak() >= meter.current() > 0
    if before is not None:  # glibc (mallinfo2): the block counts as in use
        assert meter.in_use() - before >= 60 * 2**20
    del block
    meter.reset()
    assert meter.peak() - meter.current() < 32 * 2**20  # the mark starts again near the current RSS


def test_phase_summary_accelerator_takes_the_busiest_rank():
    recs = [{"memory_profile": {"meter": "accelerator", "setup_peak": s, "phases": [{"forward_peak": f, "backward_peak": b,
                                                                                     "step_peak": 1}]}}
            for s, f, b in ((10, 20, 30), (12, 18, 35))]
    out = mp.phase_summary(recs)
    assert not out["host"] and out["bytes"] == {"setup": 12, "forward": 20, "backward": 35, "step": 1}
