"""Offloaded runs on 2 gloo ranks equal non-offloaded runs of the same config, and put the state
where the config says.

One torchrun launch trains every offload case of :data:`CASES` and, once per (stage, dtype,
accumulation, model), the same config without offload (``offload_worker.py parity``). The
offloaded optimizer steps the same torch kernel on the same fp32 values (exact reduce-scatter
gradients, fp32 masters, the engine's gradient-norm arithmetic), so losses, gradient norms and
final weights agree to the last bit in practice; the tolerances below leave room for nothing more
than a different summation order. A second launch resumes checkpoints across offload on/off.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from _launch import torchrun
from offload_worker import OffloadCase

pytestmark = pytest.mark.slow

WORLD = 2
C = OffloadCase
CASES = [
    # optimizer -> cpu, stages 1-3
    C(stage=1, dtype="fp32", gas=1, model="qwen2_tied", optimizer="cpu"),
    C(stage=1, dtype="bf16", gas=2, model="llama", optimizer="cpu"),
    C(stage=2, dtype="fp32", gas=2, model="llama", optimizer="cpu"),
    C(stage=2, dtype="bf16", gas=1, model="qwen2_tied", optimizer="cpu"),
    C(stage=3, dtype="fp32", gas=1, model="llama", optimizer="cpu"),
    C(stage=3, dtype="bf16", gas=2, model="qwen2_tied", optimizer="cpu"),
    # optimizer -> nvme, stages 2-3
    C(stage=2, dtype="fp32", gas=1, model="qwen2_tied", optimizer="nvme"),
    C(stage=2, dtype="bf16", gas=2, model="llama", optimizer="nvme"),
    C(stage=3, dtype="fp32", gas=2, model="qwen2_tied", optimizer="nvme"),
    C(stage=3, dtype="bf16", gas=1, model="llama", optimizer="nvme"),
    # params -> cpu / nvme (stage 3), with the optimizer offloaded too, and params -> cpu alone
    C(stage=3, dtype="fp32", gas=1, model="llama", optimizer="cpu", params="cpu"),
    C(stage=3, dtype="bf16", gas=2, model="qwen2_tied", optimizer="cpu", params="cpu"),
    C(stage=3, dtype="fp32", gas=1, model="qwen2_tied", optimizer="nvme", params="nvme", max_in_cpu=30_000),
    C(stage=3, dtype="bf16", gas=2, model="llama", optimizer="nvme", params="nvme", max_in_cpu=30_000),
    C(stage=3, dtype="fp32", gas=1, model="llama", optimizer="none", params="cpu"),
    # partial offload, fp16 with loss scaling, and the aio knobs switched the other way
    C(stage=3, dtype="bf16", gas=1, model="llama", optimizer="cpu", ratio=0.5),
    C(stage=2, dtype="fp16", gas=2, model="qwen2_tied", optimizer="cpu"),
    C(stage=1, dtype="fp16", gas=2, model="llama", optimizer="cpu"),
    C(stage=3, dtype="bf16", gas=1, model="llama", optimizer="nvme", buffer_count=1,
      extra={"single_submit": True, "overlap_events": False, "thread_count": 1}),
]
RESUME_CASES = [
    C(stage=1, dtype="fp32", gas=1, model="llama", optimizer="cpu"),
    # 16-bit parameters on the device, fp32 masters on the host: the checkpoint must hold the masters.
    C(stage=1, dtype="bf16", gas=1, model="llama", optimizer="cpu", load_dtype="bf16", steps=5),
    C(stage=2, dtype="fp32", gas=1, model="llama", optimizer="nvme"),
    C(stage=3, dtype="bf16", gas=1, model="qwen2_tied", optimizer="cpu"),
    C(stage=3, dtype="bf16", gas=1, model="llama", optimizer="nvme", params="nvme", max_in_cpu=30_000),
]
RTOL = 1e-6


def _launch(mode: str, cases: list[OffloadCase], tmp, env: dict | None = None) -> dict:
    nvme = tmp / "nvme"
    nvme.mkdir()
    (tmp / "cases.json").write_text(json.dumps([c.to_dict() for c in cases]))
    torchrun("tests/distributed/offload_worker.py", mode, str(tmp / "cases.json"), str(tmp / "out.pt"), str(nvme),
             nproc=WORLD, timeout=300, env=env)
    result = torch.load(tmp / "out.pt", weights_only=False)
    result["_leftover"] = sorted(os.listdir(nvme))
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _launch("parity", CASES, tmp_path_factory.mktemp("offload"))


@pytest.fixture(scope="module")
def resumes(tmp_path_factory):
    return _launch("resume", RESUME_CASES, tmp_path_factory.mktemp("offload_resume"))


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-8, msg=what)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.full_name)
def test_offloaded_run_equals_non_offloaded(case: OffloadCase, runs):
    got = runs[case.full_name]
    base = runs["baselines"][case.base.name]
    _close(got["losses"], base["losses"], "losses")
    _close(got["grad_norms"], base["grad_norms"], "grad norms")
    assert set(got["final_state"]) == set(base["final_state"])
    for name, tensor in base["final_state"].items():
        _close(got["final_state"][name], tensor, name)
    # The weights moved (4 real steps): a run that never stepped would not match the baseline.
    assert got["losses"][0] != got["losses"][-1]


# The same comparison with the GPU's control flow (tests/fake_accelerator.py in each rank: pinned
# buffers, device<->host copies that land late and leave poison until their event completes) and
# strict collectives (no host tensor in a collective), on the paths the fake changes: every tier
# at stages 2/3 with accumulation (staged host accumulation), the stage-1 broadcast, fp16 unscale.
FAKE_CASES = [
    C(stage=1, dtype="bf16", gas=2, model="llama", optimizer="cpu"),
    C(stage=2, dtype="fp32", gas=2, model="llama", optimizer="cpu"),
    C(stage=3, dtype="bf16", gas=2, model="qwen2_tied", optimizer="cpu", params="cpu"),
    C(stage=3, dtype="fp32", gas=2, model="qwen2_tied", optimizer="nvme"),
    C(stage=2, dtype="fp16", gas=2, model="qwen2_tied", optimizer="cpu"),
]


@pytest.fixture(scope="module")
def fake_runs(tmp_path_factory):
    return _launch("parity", FAKE_CASES, tmp_path_factory.mktemp("offload_fake"),
                   env={"HF_ZERO_FAKE_ACCELERATOR": "1", "HF_ZERO_STRICT_COLLECTIVES": "1"})


@pytest.mark.parametrize("case", FAKE_CASES, ids=lambda c: c.full_name)
def test_offloaded_run_under_the_fake_accelerator_equals_non_offloaded(case: OffloadCase, fake_runs):
    assert fake_runs["fake_async_copies"] > 0, "no asynchronous copy: the fake was not installed"
    got, base = fake_runs[case.full_name], fake_runs["baselines"][case.base.name]
    assert all(torch.isfinite(torch.tensor(got["grad_norms"]))), "host gradients read before their copies landed"
    _close(got["losses"], base["losses"], "losses")
    _close(got["grad_norms"], base["grad_norms"], "grad norms")
    for name, tensor in base["final_state"].items():
        _close(got["final_state"][name], tensor, name)
    assert got["losses"][0] != got["losses"][-1]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.full_name)
def test_state_sits_in_the_configured_tier(case: OffloadCase, runs):
    ranks = runs[case.full_name]["ranks"]
    base_ranks = runs["baselines"][case.base.name]["ranks"]
    mem = [r["memory"] for r in ranks]
    base_mem = [r["memory"] for r in base_ranks]
    total = lambda kind, tier, reports=mem: sum(m[kind][tier] for m in reports)
    base_state = total("optimizer_state", "accelerator", base_mem)  # moments, all ranks together
    moments_and_master = base_state * 3 // 2

    if case.optimizer == "cpu" and case.ratio == 1.0:
        assert total("optimizer_state", "accelerator") == 0
        assert total("optimizer_state", "nvme") == 0
        # fp32 master + the moments of every trainable element, plus scalar step counters.
        assert moments_and_master <= total("optimizer_state", "host") <= moments_and_master + 4096
    if case.optimizer == "nvme":
        assert total("optimizer_state", "accelerator") == 0
        assert total("optimizer_state", "nvme") >= moments_and_master  # files padded to 4 KiB
        assert 0 < total("optimizer_state", "host")  # swap buffers and step counters only
    if case.ratio < 1.0:
        on_device, on_host = total("optimizer_state", "accelerator"), total("optimizer_state", "host")
        assert 0 < on_device < base_state and on_host > 0
    if case.optimizer != "none" and case.ratio == 1.0:
        # Gradients go to fp32 host buffers as they are produced; none stays on a sharded device.
        assert total("grads", "host") > 0
        if case.stage >= 2:
            assert total("grads", "accelerator") == 0
    if case.params == "none" and case.stage >= 2 and case.optimizer != "none" and case.ratio == 1.0:
        # The accelerator keeps 16-bit shards (fp32 when training in fp32).
        factor = 2 if case.dtype == "fp32" else 1
        assert total("params", "accelerator") * 2 == total("params", "accelerator", base_mem) * factor
    if case.params == "cpu":
        assert total("params", "accelerator") == 0 and total("params", "host") > 0
    if case.params == "nvme":
        assert total("params", "accelerator") == 0 and total("params", "nvme") > 0
        assert max(m["params"]["host"] for m in mem) <= case.max_in_cpu * 4


@pytest.mark.parametrize("case", [c for c in CASES if "nvme" in (c.optimizer, c.params)], ids=lambda c: c.full_name)
def test_swap_files_exist_during_the_run_and_are_gone_after(case: OffloadCase, runs):
    for rank, r in enumerate(runs[case.full_name]["ranks"]):
        assert r["files"] and r["files_exist"], r
        assert all(f"rank{rank}" in f for f in r["files"])  # per rank, in a run folder
        assert all(os.path.basename(os.path.dirname(os.path.dirname(f))).startswith("hf_zero-") for f in r["files"])
        assert r["dirs_after_close"] == [] and r["run_dirs_after_close"] == []
    assert runs["_leftover"] == []


def test_runs_never_share_a_swap_folder(runs):
    folders = [
        os.path.dirname(os.path.dirname(r["files"][0]))
        for case in CASES if "nvme" in (case.optimizer, case.params)
        for r in runs[case.full_name]["ranks"]
    ]
    # Both ranks of a run share the run folder; different runs never do.
    assert len(set(folders)) == len(folders) // WORLD


@pytest.mark.parametrize("case", [c for c in CASES if c.params == "nvme"], ids=lambda c: c.full_name)
def test_swapped_parameters_export_under_params_resident(case: OffloadCase, runs):
    """The model's (16-bit) shards, swapped to NVMe between uses and updated through the swapper,
    gather to the fp32 masters rounded to the compute dtype."""
    got = runs[case.full_name]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[case.dtype]
    for name, master in got["final_state"].items():
        assert torch.equal(got["gathered"][name], master.to(dtype).float()), name


@pytest.mark.parametrize("case", RESUME_CASES, ids=lambda c: c.full_name)
@pytest.mark.parametrize("direction", ["offloaded_to_plain", "plain_to_offloaded"])
def test_checkpoints_resume_across_offload(case: OffloadCase, direction: str, resumes):
    got = resumes[case.full_name][direction]
    if case.load_dtype == "fp32":
        _close(got["resumed"], got["uninterrupted"], f"{direction} resumed losses")
    else:
        # 16-bit device parameters (offloaded) and fp32 ones under autocast (plain) differ in the
        # ops autocast leaves in fp32 (norms): ~1e-5 of the loss, even from the same weights.
        torch.testing.assert_close(got["resumed"], got["uninterrupted"], rtol=1e-4, atol=0, msg=direction)


@pytest.mark.parametrize("case", [c for c in RESUME_CASES if c.load_dtype != "fp32"], ids=lambda c: c.full_name)
def test_offloaded_16bit_parameters_checkpoint_fp32_masters(case: OffloadCase, resumes):
    """Stage 1 with an offloaded optimizer computes with 16-bit parameters and keeps the fp32
    masters on the host of the rank owning each parameter: the checkpoint holds the masters (not
    the 16-bit copies), so a resume continues exactly as the run that never stopped."""
    got = resumes[case.full_name]["offloaded_to_offloaded"]
    assert got["saved_fp32"] and all(got["saved_fp32"].values()), got["saved_fp32"]
    _close(got["resumed"], got["uninterrupted"], "resumed losses")
    assert got["final"].keys() == got["final_resumed"].keys()
    for name, weight in got["final"].items():
        assert torch.equal(got["final_resumed"][name], weight), name
