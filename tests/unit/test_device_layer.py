"""The device layer (hf_zero/distributed/device.py) and the offload paths under a fake accelerator.

The fake (tests/fake_accelerator.py) lets asynchronous copies land late with their destination
poisoned, keeps one stream per device, hands freed device blocks out again, and makes pinned storage
non-resizable, so the GPU's hazards show on CPU: a gradient norm read before the device-to-host
copies landed (review finding F2), a copy waited for on the thread's device instead of the data's
(F3), syncs decided by the backend instead of the data (F4), resizing pinned parameter shards for
NVMe swapping (F5), a gradient block handed out again while its copy to the host still reads it
(F6).
"""

from __future__ import annotations

import ast
import concurrent.futures as cf
import math
import threading
import time
from pathlib import Path

import pytest
import torch

import hf_zero
from hf_zero.checkpoint.export16 import gather_full_state_dict
from hf_zero.distributed import device as accel
from tests.fake_accelerator import NoAccelerator, fake_accelerator

PACKAGE = Path(hf_zero.__file__).parent


# ----------------------------------------------------------------------------- one device layer
def _runtime_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """``torch.cuda.*`` uses and calls of stream/pinning methods, by line."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Attribute) and node.value.attr == "cuda" and \
                    isinstance(node.value.value, ast.Name) and node.value.value.id == "torch":
                found.append((node.lineno, f"torch.cuda.{node.attr}"))
            if isinstance(node.value, ast.Name) and node.value.id == "torch" and node.attr in ("cuda", "accelerator"):
                found.append((node.lineno, f"torch.{node.attr}"))
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        receiver = node.func.value
        through_layer = isinstance(receiver, ast.Name) and receiver.id in ("accel", "device")
        if node.func.attr in ("record_stream", "pin_memory", "cuda", "synchronize", "set_device") and not through_layer:
            found.append((node.lineno, f".{node.func.attr}()"))
        if isinstance(receiver, ast.Name) and receiver.id == "torch":  # torch.zeros(..., pin_memory=True)
            for kw in node.keywords:
                if kw.arg == "pin_memory" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                    found.append((node.lineno, "pin_memory="))
    return found


def test_nothing_but_the_device_layer_talks_to_the_accelerator_runtime():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "distributed" / "device.py":
            continue  # the layer itself
        for line, what in _runtime_calls(ast.parse(path.read_text(), str(path))):
            offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {what}")
    assert not offenders, "use hf_zero.distributed.device instead:\n" + "\n".join(offenders)


def test_the_scan_finds_what_it_looks_for():
    code = "import torch\ntorch.cuda.synchronize()\nx.record_stream(s)\ny = torch.zeros(3, pin_memory=True)\n"
    assert sorted(w for _, w in _runtime_calls(ast.parse(code))) == [
        ".record_stream()", ".synchronize()", "pin_memory=", "torch.cuda", "torch.cuda.synchronize"]
    assert _runtime_calls(ast.parse("accel.synchronize(d)\naccel.record_stream(t)\n")) == []


# ----------------------------------------------------------------------------- PendingCopies
def test_async_copy_lands_only_after_wait():
    with fake_accelerator() as fake:
        host = accel.pinned_empty(4 * 4, torch.float32)
        copies = accel.PendingCopies()
        copies.copy(host, torch.arange(4.0))
        assert copies.pending == 1
        assert torch.isnan(host).all()  # in flight: poisoned
        copies.wait()
        assert torch.equal(host, torch.arange(4.0))
        assert fake.async_copies == 1
        assert [kind for kind, _ in fake.events] == ["record", "wait"]


def test_copy_is_synchronous_when_the_host_side_is_pageable_or_both_sides_are_alike():
    with fake_accelerator() as fake:
        copies = accel.PendingCopies()
        pageable = torch.empty(4)
        copies.copy(pageable, torch.arange(4.0))  # "device" -> pageable host
        a, b = accel.pinned_empty(16, torch.float32), accel.pinned_empty(16, torch.float32)
        b.copy_(torch.ones(4))
        copies.copy(a, b)  # host -> host
        assert copies.pending == 0 and fake.async_copies == 0
        assert torch.equal(pageable, torch.arange(4.0)) and torch.equal(a, torch.ones(4))


def _in_a_fresh_thread(fn):
    """``fn()`` on a thread of its own, which (as any thread torch or hf_zero starts) has not
    selected a device: its current device is 0."""
    with cf.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result()


@pytest.mark.parametrize("direction", ["host_to_device", "device_to_host"])
def test_copies_are_waited_for_on_the_datas_device_from_any_thread(direction):
    """Review F3: the copy-back thread waited on its own current device (device 0 on every rank)
    for copies to the rank's device. PendingCopies records each copy's event on the device of the
    data it copies; under the fake, rank 1's copies run on device 1's stream and a wait on device
    0 lands nothing. Mutation checked: with ``record_event(current_device())`` in
    ``PendingCopies.copy`` (device.py, the old bug's shape) both directions fail here (NaN)."""
    with fake_accelerator(count=2) as fake:
        accel.select_device(1)  # rank 1: its tensors live on device 1
        values = torch.arange(4.0)
        if direction == "host_to_device":
            dst, src = torch.zeros(4), accel.pin(values)  # a parameter shard <- a pinned master
        else:
            dst, src = accel.pinned_empty(16, torch.float32), values.clone()

        def copy_and_wait():
            assert accel.current_device() == torch.device("cpu", 0)  # not rank 1's device
            copies = accel.PendingCopies()
            copies.copy(dst, src)
            copies.wait()
            return dst.clone()

        got = _in_a_fresh_thread(copy_and_wait)
        assert fake.async_copies == 1
        assert torch.equal(got, values), f"read {got} after the wait: it waited on the wrong device's stream"
        assert [e for e in fake.events if e[0] == "wait"] == [("wait", torch.device("cpu"))]


def test_the_fake_orders_nothing_with_an_event_on_another_device():
    """Control for the test above: an event recorded on a worker thread's current device (0, not
    rank 1's) does not wait for rank 1's copy; the host buffer is still poison after the wait."""
    with fake_accelerator(count=2):
        accel.select_device(1)
        host = accel.pinned_empty(16, torch.float32)

        def wrong_wait():
            accel.runtime().copy(host, torch.arange(4.0), non_blocking=True)
            event = accel.runtime().record_event(accel.current_device())  # device 0: the thread's
            accel.runtime().wait_event(event)
            return host.clone()

        assert accel.current_device() == torch.device("cpu")  # the main thread is on device 1
        assert _in_a_fresh_thread(accel.current_device) == torch.device("cpu", 0)
        assert torch.isnan(_in_a_fresh_thread(wrong_wait)).all()


@pytest.mark.parametrize("recorded", [False, True])
def test_the_fake_hands_a_freed_block_out_again_unless_its_stream_was_recorded(recorded):
    """The fake's caching allocator (review F6): a device-to-host copy issued on a side stream
    (FSDP2 runs its gradient hooks on its all-reduce stream) from a block that is freed before the
    copy runs reads someone else's data, unless ``record_stream`` kept the block; on the default
    stream the block's next user comes after the copy and nothing is lost."""
    with fake_accelerator() as fake:
        host = accel.pinned_empty(16, torch.float32)
        copies = accel.PendingCopies()
        output = torch.arange(8.0)  # a reduce-scatter output, allocated on another stream
        with torch.cpu.stream(torch.cpu.Stream()):
            grad = output[2:6]
            copies.copy(host, grad)
            if recorded:
                accel.record_stream(grad)
        del output, grad  # FSDP2 drops the output, hf_zero the gradient: the block is free
        copies.wait()
        assert fake.reused == (0 if recorded else 1)
        assert torch.equal(host, torch.arange(2.0, 6.0)) if recorded else torch.isnan(host).all()
        # The default stream: the same copy from a block freed at once reads right.
        temporary = torch.arange(4.0)
        copies.copy(host, temporary)
        del temporary
        copies.wait()
        assert torch.equal(host, torch.arange(4.0)) and fake.reused == (0 if recorded else 1)


def test_pinned_storage_cannot_be_resized_under_the_fake():
    with fake_accelerator():
        t = torch.ones(8).pin_memory()
        assert t.is_pinned()
        with pytest.raises(RuntimeError, match="not resizable"):
            t.untyped_storage().resize_(0)


def test_select_device_refuses_two_ranks_on_one_gpu():
    with fake_accelerator(count=2):
        assert accel.select_device(1).type == "cpu"
        with pytest.raises(RuntimeError, match=r"LOCAL_RANK 2 but only 2 GPU\(s\).*--nproc_per_node 2"):
            accel.select_device(2)


# ----------------------------------------------------------------------------- engine under the fake
def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1))


def _config(stage: int, tmp_path: Path, opt: str = "cpu", param: str | None = None,
            dtype: str = "fp32") -> dict:
    zo: dict = {"stage": stage, "offload_optimizer": {"device": opt, "pin_memory": True}}
    if opt == "nvme":
        zo["offload_optimizer"]["nvme_path"] = str(tmp_path / "nvme")
    if param:
        zo["offload_param"] = {"device": param, "pin_memory": True}
        if param == "nvme":
            zo["offload_param"].update(nvme_path=str(tmp_path / "nvme"), max_in_cpu=1000)
    return {"zero_optimization": zo, "gradient_clipping": 0.05, "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "bf16": {"enabled": dtype == "bf16"}}


def _train(cfg: dict, steps: int = 3, accumulation: int = 1) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    cfg = {**cfg, "gradient_accumulation_steps": accumulation}
    engine = hf_zero.initialize(_tiny(), cfg)
    gen = torch.Generator().manual_seed(1)
    losses, norms = [], []
    try:
        for _ in range(steps):
            for _ in range(accumulation):  # DeepSpeed's loop: step() after every micro-batch
                ids = torch.randint(0, 64, (2, 8), generator=gen)
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.detach()))
            norms.append(float(engine.get_global_grad_norm()))
        weights = {k: v.float().clone() for k, v in gather_full_state_dict(engine).items()}
    finally:
        engine.close()
    return losses, norms, weights


CASES = {
    "stage1-optimizer-cpu": (1, "cpu", None, "fp32"),
    "stage2-optimizer-cpu": (2, "cpu", None, "fp32"),
    # 16-bit parameter shards: the fp32 gradients are read from FSDP2's reduce-scatter output
    "stage2-optimizer-cpu-bf16": (2, "cpu", None, "bf16"),
    "stage3-optimizer-and-params-cpu": (3, "cpu", "cpu", "fp32"),
    "stage3-params-nvme": (3, "cpu", "nvme", "fp32"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_offload_under_the_fake_accelerator_matches_the_plain_cpu_run(case, tmp_path):
    """As rank 1 of a 2-GPU node (its tensors on device 1; a worker thread that did not select it
    waits on device 0 and sees poison): equal to the plain CPU run bit for bit, no copy read a
    reused block, no device-wide synchronize. Mutations checked (F6): without the fp32 path's
    ``record_stream(local)`` (offload/manager.py) the fp32 stage 2/3 cases and the accumulation
    test fail, without ``release()``'s ``record_stream(flat)`` the bf16 case fails (poisoned host
    gradients, NaN norms). (F3's mutation is caught by the PendingCopies test above: hf_zero's own threads select
    the rank's device, review N4, so here they wait on the right device either way.)"""
    stage, opt, param, dtype = CASES[case]
    (tmp_path / "nvme").mkdir()
    with accel.use_runtime(NoAccelerator()):  # the CPU reference, on a GPU machine too
        plain = _train(_config(stage, tmp_path, opt, param, dtype))
    with fake_accelerator() as fake:
        accel.select_device(1)
        faked = _train(_config(stage, tmp_path, opt, param, dtype))
    assert fake.async_copies > 0, "the fake saw no asynchronous copy: the test would prove nothing"
    assert fake.reused == 0, f"{fake.reused} device-to-host copies read a block the allocator had handed out again"
    assert all(math.isfinite(n) for n in faked[1]), f"gradient norms {faked[1]}: host gradients read before they landed"
    assert faked[0] == plain[0] and faked[1] == plain[1]
    for name, value in plain[2].items():
        assert torch.equal(faked[2][name], value), name
    assert not any(kind == "sync" for kind, _ in fake.events), "device-wide synchronize in the step path"


def _staged_adds(monkeypatch) -> list[int]:
    """Counts the gradients each engine's optimizer added through its staging blocks."""
    from hf_zero.offload.grad_accumulation import StagedAccumulation

    counts: list[int] = []
    close = StagedAccumulation.close

    def counting_close(self):
        counts.append(self.staged)
        close(self)

    monkeypatch.setattr(StagedAccumulation, "close", counting_close)
    return counts


# (Stage 1 accumulates on the device, as DDP does, and copies once per window: nothing to stage.)
@pytest.mark.parametrize("stage", [2, 3])
def test_accumulated_micro_steps_under_the_fake_match_the_plain_cpu_run(stage, tmp_path, monkeypatch):
    """Review F11: from the 2nd micro-step on, each gradient was added on the host after a blocking
    copy inside the backward. Now it is copied to a pinned staging block and added by a worker once
    its copy has landed; under the fake (copies land late, poisoned until then) the run equals the
    CPU run bit for bit, and the staged path was taken."""
    from hf_zero.offload.host_optimizer import OffloadedOptimizer

    staged = _staged_adds(monkeypatch)
    # Every wait for copies that happens inside the gradient hook, i.e. inside the backward.
    inside, waits_in_backward = threading.local(), []
    accumulate, wait = OffloadedOptimizer.accumulate_grad, accel.PendingCopies.wait

    def traced_accumulate(self, param, grad):
        inside.on = True
        try:
            accumulate(self, param, grad)
        finally:
            inside.on = False

    def traced_wait(self):
        if getattr(inside, "on", False) and self.pending:
            waits_in_backward.append(self.pending)
        wait(self)

    cfg = _config(stage, tmp_path, "cpu", "cpu" if stage == 3 else None)
    with accel.use_runtime(NoAccelerator()):
        plain = _train(cfg, steps=2, accumulation=3)
    monkeypatch.setattr(OffloadedOptimizer, "accumulate_grad", traced_accumulate)
    monkeypatch.setattr(accel.PendingCopies, "wait", traced_wait)
    with fake_accelerator() as fake:
        accel.select_device(1)  # rank 1: the accumulation worker (device 0) waits on device 1's copies
        faked = _train(cfg, steps=2, accumulation=3)
    assert fake.async_copies > 0 and fake.reused == 0
    assert not waits_in_backward, f"the backward waited for {sum(waits_in_backward)} copies in flight"
    assert staged and staged[-1] > 0, "no gradient went through the staging blocks: the test would prove nothing"
    assert faked[0] == plain[0] and faked[1] == plain[1]
    for name, value in plain[2].items():
        assert torch.equal(faked[2][name], value), name


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_fake_catches_a_gradient_block_reused_before_its_copy_landed(dtype, tmp_path, monkeypatch):
    """Control for review F6: without ``record_stream`` (offload/manager.py: the fp32 gradient
    view, and the reduce-scatter output of 16-bit shards) the allocator hands FSDP2's gradient
    blocks out again while their copies to the host are queued, and the host gradients are poison."""
    monkeypatch.setattr(accel, "record_stream", lambda t: None)
    with fake_accelerator() as fake:
        _, norms, _ = _train(_config(2, tmp_path, dtype=dtype), steps=1)
    assert fake.reused > 0 and not math.isfinite(norms[0])


def test_the_fake_catches_an_add_before_its_copy_landed(tmp_path, monkeypatch):
    """Control for the test above: an add that does not wait for its staging copy adds poison."""
    monkeypatch.setattr(accel.PendingCopies, "wait", lambda self: None)
    with fake_accelerator():
        _, norms, _ = _train(_config(2, tmp_path), steps=1, accumulation=2)
    assert not math.isfinite(norms[0])


def test_the_fake_catches_a_read_before_the_copies_landed(tmp_path, monkeypatch):
    """Control: with the waits removed (what the code did before the device layer, where the
    norm and clipping ran before the step's synchronize), the poisoned gradients show."""
    monkeypatch.setattr(accel.PendingCopies, "wait", lambda self: None)
    with fake_accelerator() as fake:
        _, norms, _ = _train(_config(2, tmp_path), steps=1)
        assert fake.async_copies > 0
    assert not math.isfinite(norms[0])


def test_nvme_eviction_waits_for_the_units_read_not_the_whole_device(tmp_path, monkeypatch):
    """Review F11: evicting a parameter unit to NVMe synchronized the whole device each time.
    Now it waits on the event recorded after the unit's all-gather was waited for (its host shard
    has been read by then). Recorded here: every event made for a unit and every wait."""
    (tmp_path / "nvme").mkdir()
    made, waited, synced = [], [], []

    def record_event(device):
        made.append(object())
        return made[-1]

    monkeypatch.setattr(accel, "record_event", record_event)
    monkeypatch.setattr(accel, "wait_event", lambda event: waited.append(event))
    monkeypatch.setattr(accel, "synchronize", lambda device: synced.append(device))
    with accel.use_runtime(NoAccelerator()):
        losses, _, _ = _train(_config(3, tmp_path, "cpu", "nvme"))
    assert all(math.isfinite(x) for x in losses)
    evictions = [e for e in waited if e is not None]
    assert evictions, "no unit was evicted: max_in_cpu too large for the test to prove anything"
    assert set(map(id, evictions)) <= set(map(id, made)), "waited on an event the unit did not record"
    assert synced == [], f"device-wide synchronize on eviction: {synced}"


def test_a_failed_staged_add_is_raised_by_drain_not_inside_the_backward():
    """An error of the accumulation worker must not surface in the gradient hook of one rank (the
    other ranks would wait in the next reduce-scatter): the next add goes on, drain() raises it."""
    from hf_zero.offload.grad_accumulation import StagedAccumulation

    def failing():
        raise RuntimeError("device fault while waiting")

    with fake_accelerator():
        acc = StagedAccumulation(4, pin=True, setting="offload_optimizer.pin_memory", before_add=failing)
        assert acc.usable()
        host = accel.pinned_empty(16).view(torch.float32).zero_()
        acc.add(host, torch.ones(4))
        time.sleep(0.05)  # the worker has failed by now
        acc.add(host, torch.ones(4))  # not raised here
        with pytest.raises(RuntimeError, match="device fault"):
            acc.drain()
        acc.close()
