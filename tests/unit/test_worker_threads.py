"""The worker threads hf_zero starts run on the rank's accelerator device (review N4).

A new thread's current CUDA device is 0 whatever its process selected: a copy-back, accumulation or
swap thread whose first runtime call (an event wait, a copy) runs there creates a context on GPU 0
from every rank (about 0.5 GiB each). The fake accelerator (tests/fake_accelerator.py) keeps a
current device per thread, starting at 0, as CUDA does; these tests record, per thread, the device
current at its first call into the runtime, with the rank on device 1.
"""

from __future__ import annotations

import ast
import concurrent.futures as cf
import threading
from pathlib import Path

import pytest
import torch

import hf_zero
from hf_zero.distributed import device as accel
from tests.fake_accelerator import NoAccelerator, fake_accelerator
from tests.unit.test_device_layer import _config, _train

PACKAGE = Path(hf_zero.__file__).parent
# Runtime calls that create a context on the thread's current device (device queries do not).
_DEVICE_CALLS = ("copy", "record_event", "wait_event", "synchronize", "record_stream", "is_pinned", "pin",
                 "pinned_empty")
# hf-zero env's probe thread touches the runtime under a timeout on purpose (a hung driver must not
# hang the report); it runs in no rank, so there is no rank's device to select.
_EXEMPT = {"diagnostics/env_report.py"}


def _record_first_device(fake) -> dict[str, int]:
    """Thread name -> the fake's current device index at that thread's first device call."""
    first: dict[str, int] = {}
    for name in _DEVICE_CALLS:
        method = getattr(fake, name)

        def call(*args, _method=method, **kwargs):
            first.setdefault(threading.current_thread().name, fake.current_index())
            return _method(*args, **kwargs)

        setattr(fake, name, call)  # the instance's attribute, ahead of the class's method
    return first


def test_a_thread_from_the_initializer_starts_on_the_device_of_the_thread_that_made_it():
    with fake_accelerator(count=2) as fake:
        first = _record_first_device(fake)
        accel.select_device(1)
        with cf.ThreadPoolExecutor(1, thread_name_prefix="plain") as plain:
            plain.submit(accel.pinned_empty, 16).result()
        with cf.ThreadPoolExecutor(1, thread_name_prefix="rank", initializer=accel.thread_initializer()) as pool:
            pool.submit(accel.pinned_empty, 16).result()
    assert first["plain_0"] == 0  # what the fake models: a CUDA thread starts on device 0
    assert first["rank_0"] == 1
    with accel.use_runtime(NoAccelerator()):
        accel.thread_initializer()()  # no accelerator: nothing to select, no runtime call


CASES = {  # each starts the threads named: copy-back and accumulation, or copy-back and NVMe swaps
    "stage2-accumulation": (2, "cpu", None, 2, {"hf_zero-copyback", "hf_zero-accumulate"}),
    "stage3-optimizer-nvme": (3, "nvme", None, 1, {"hf_zero-copyback"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_hf_zero_thread_makes_its_first_device_call_on_the_ranks_device(case, tmp_path, monkeypatch):
    stage, opt, param, accumulation, expected = CASES[case]
    (tmp_path / "nvme").mkdir()
    monkeypatch.setenv("LOCAL_RANK", "1")  # the rank's device is 1: a thread left on device 0 shows
    with fake_accelerator(count=2) as fake:
        first = _record_first_device(fake)
        accel.select_device(1)  # as the rank does at start (initialize may find its process group made)
        losses, _, _ = _train(_config(stage, tmp_path, opt, param), steps=2, accumulation=accumulation)
    ours = {name: index for name, index in first.items() if name.startswith("hf_zero-")}
    assert expected <= {name.rsplit("_", 1)[0] for name in ours}, f"threads seen: {sorted(first)}"
    assert first["MainThread"] == 1
    assert all(index == 1 for index in ours.values()), f"first device call on device 0: {ours}"
    assert all(torch.isfinite(torch.tensor(losses)))


def _thread_starts(tree: ast.AST) -> list[tuple[int, str, bool]]:
    """(line, what, selects the device) for each ThreadPoolExecutor(...) / Thread(...) call."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if name not in ("ThreadPoolExecutor", "Thread"):
            continue
        init = next((kw.value for kw in node.keywords if kw.arg == "initializer"), None)
        selects = isinstance(init, ast.Call) and isinstance(init.func, ast.Attribute) and \
            init.func.attr == "thread_initializer"
        found.append((node.lineno, name, selects))
    return found


def test_every_thread_hf_zero_starts_selects_the_ranks_device():
    """Every pool in the package passes initializer=accel.thread_initializer(), so a thread added
    later cannot start on device 0 unnoticed."""
    starts, offenders = 0, []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for line, what, selects in _thread_starts(ast.parse(path.read_text(), str(path))):
            starts += 1
            if not selects and rel not in _EXEMPT:
                offenders.append(f"hf_zero/{rel}:{line}: {what}(...) without initializer=accel.thread_initializer()")
    assert starts >= 3, "the scan found no thread start: it would prove nothing"
    assert not offenders, "\n".join(offenders)
    code = "import concurrent.futures as cf\ncf.ThreadPoolExecutor(1)\ncf.ThreadPoolExecutor(1, initializer=accel.thread_initializer())\n"
    assert [s for _, _, s in _thread_starts(ast.parse(code))] == [False, True]


def test_a_staged_add_keeps_its_source_block_until_its_copy_has_run():
    """The staged accumulation copy (offload/grad_accumulation.py) reads a slice of FSDP2's
    reduce-scatter output on the hook's side stream, and its worker lands it later. If the output
    is dropped first, the caching allocator may hand the block out again before the copy has run
    (review F6): the add must protect its own source (record_stream), not rely on the feed's
    release of the whole output. On torch 2.9.1 the test_fp16_skips staged case failed about every
    other run without it. Here the worker is held until the output is gone; without the
    record_stream in StagedAccumulation.add the added values are the fake's poison."""
    from hf_zero.offload.grad_accumulation import StagedAccumulation

    gate = threading.Event()
    with fake_accelerator() as fake:
        accel.select_device(1)
        acc = StagedAccumulation(largest_numel=8, pin=True, setting="offload_optimizer.pin_memory",
                                 before_add=lambda: gate.wait(10))
        assert acc.usable()
        dst = accel.pinned_empty(16, torch.float32)  # bytes: 4 floats
        dst.fill_(1.0)
        try:
            output = torch.arange(8.0)  # FSDP2's reduce-scatter output, allocated on another stream
            with torch.cpu.stream(torch.cpu.Stream()):  # the hook runs on FSDP2's all-reduce stream
                acc.add(dst, output[2:6])
            del output  # FSDP2 and the feed drop it; the copy has not run yet
            gate.set()
            acc.drain()
        finally:
            gate.set()
            acc.close()
        assert fake.reused == 0
        assert torch.equal(dst, torch.arange(3.0, 7.0))
