"""FSDP2's own gradient copies to host memory (``offload_param: cpu``) and the offloaded
optimizer's hooks that read them (review N3).

On torch 2.9-2.11 FSDP2 copies each reduced gradient to pinned host memory with
``non_blocking=True`` and calls the post-accumulate-grad hooks before the copy lands (it waits only
in ``finalize_backward``); torch 2.13 copies synchronously when a hook exists. The CPU suite runs
2.13, so the older behaviour is reproduced here at the hook: the host gradient is poisoned and an
event stands for the copy in flight, whose ``synchronize()`` lands the values, as
``FSDPParam.grad_offload_event`` does on a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_zero.distributed import device as accel
from hf_zero.distributed.fsdp_internals import HostGradCopies, fsdp_params_by_param
from tests.fake_accelerator import NoAccelerator
from tests.unit.test_device_layer import _config, _train


class _CopyInFlight:
    """Stands for FSDP2's ``grad_offload_event``: the host gradient holds NaN until it is waited for."""

    def __init__(self, host: torch.Tensor, values: torch.Tensor, log: list[str]):
        self.host, self.values, self.log = host, values, log
        host.fill_(float("nan"))

    def synchronize(self) -> None:
        if self.values is not None:
            self.host.copy_(self.values)
            self.values = None
            self.log.append("landed")


def _late_fsdp_host_copies(monkeypatch) -> list[str]:
    """Make FSDP2's copy of every gradient to the host land only when its event is waited for, as
    on torch 2.9-2.11 with a pinned ``CPUOffloadPolicy``. Returns the log of landed copies."""
    from hf_zero.offload.grad_feeds import FsdpGradFeed

    log: list[str] = []
    on_grad = FsdpGradFeed._on_grad

    def late(self, param):
        local = param.grad.to_local()
        assert not accel.is_accelerator(local), "offload_param: the gradient FSDP2 hands over is a host copy"
        fsdp_param = fsdp_params_by_param(self._modules)[id(param)]
        fsdp_param.grad_offload_event = _CopyInFlight(local, local.clone(), log)
        on_grad(self, param)

    monkeypatch.setattr(FsdpGradFeed, "_on_grad", late)  # before the engine registers it
    return log


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gradients_are_read_after_fsdp2s_copy_to_the_host_landed(precision, tmp_path, monkeypatch):
    """Stage 3, offload_param cpu (pinned) + offload_optimizer cpu, with accumulation (the micro-steps
    after the first add on the host): the same losses, norms and weights as when the copies are
    synchronous (torch 2.13), bit for bit. fp32 reads FSDP2's host gradient itself; bf16 reads the
    fp32 device output and compares FSDP2's 16-bit host copy with it once per parameter (the layout
    check, which would fail on a copy in flight)."""
    cfg = _config(3, tmp_path, "cpu", "cpu")
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    with accel.use_runtime(NoAccelerator()):
        synchronous = _train(cfg, steps=2, accumulation=2)
        landed = _late_fsdp_host_copies(monkeypatch)
        late = _train(cfg, steps=2, accumulation=2)
    assert landed, "no gradient was copied late: the test would prove nothing"
    assert late[0] == synchronous[0] and late[1] == synchronous[1]
    for name, value in synchronous[2].items():
        assert torch.equal(late[2][name], value), name


def test_the_late_copies_show_without_the_wait(tmp_path, monkeypatch):
    """Control: the hook reading FSDP2's host gradient without waiting (the code before the fix)
    trains on the poisoned values."""
    monkeypatch.setattr(HostGradCopies, "wait", lambda self, param, grad: None)
    _late_fsdp_host_copies(monkeypatch)
    with accel.use_runtime(NoAccelerator()):
        _, norms, _ = _train(_config(3, tmp_path, "cpu", "cpu"), steps=1)
    assert not math.isfinite(norms[0])


def test_a_gradient_fsdp2_does_not_know_is_waited_for_with_a_device_synchronize(monkeypatch):
    """Should FSDP2's internals move (no FSDPParam found for the parameter), the wait falls back to
    synchronizing the device: slower, never stale."""
    synced, waited = [], []
    monkeypatch.setattr(accel, "synchronize", lambda device: synced.append(device))
    monkeypatch.setattr(accel, "wait_event", lambda event: waited.append(event))
    copies = HostGradCopies([torch.nn.Linear(2, 2)])  # not fully_shard-ed: no FSDPParam
    param = torch.nn.Parameter(torch.zeros(2))
    with accel.use_runtime(NoAccelerator()):
        copies.wait(param, torch.zeros(2))
    assert len(synced) == 1 and waited == []
