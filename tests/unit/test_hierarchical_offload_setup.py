"""Offload on the hierarchical layouts (mics_shard_size, zero_hpz_partition_size), the parts one
process can check: the stage no longer refuses the combination, and the offload code sizes by the
shard group, not the world. The runs themselves: tests/distributed/test_hierarchical_offload.py
(4 ranks as 2 nodes x 2)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_zero.config import load_config
from hf_zero.distributed import device as accel
from hf_zero.distributed.env import DistEnv
from hf_zero.offload import param_offload
from hf_zero.offload.base import OffloadError
from hf_zero.offload.manager import make_offload_manager, shard_group
from hf_zero.offload.param_offload import planned_shard_bytes
from hf_zero.precision.policy import PrecisionPolicy

OFFLOADS = {
    "optimizer_cpu": {"offload_optimizer": {"device": "cpu"}},
    "optimizer_nvme": {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/hf_zero_unit"}},
    "param_cpu": {"offload_param": {"device": "cpu"}},
    "param_nvme": {"offload_optimizer": {"device": "cpu"},
                   "offload_param": {"device": "nvme", "nvme_path": "/tmp/hf_zero_unit"}},
}


class _ReachedTheMesh(Exception):
    pass


def _env(world: int = 4) -> DistEnv:
    return DistEnv(rank=0, world_size=world, local_rank=0, device=torch.device("cpu"), backend="gloo")


@pytest.mark.parametrize("offload", sorted(OFFLOADS))
@pytest.mark.parametrize("layout", [{"mics_shard_size": 2}, {"zero_hpz_partition_size": 2}],
                         ids=["mics", "hpz"])
def test_offload_on_a_hierarchical_layout_is_not_refused(offload, layout, monkeypatch):
    """The stage goes on to build the 2 x 2 (or hpZ's flat) mesh; it used to raise "... with
    offload_optimizer or offload_param is not supported yet" before that."""
    from hf_zero.distributed import mesh as mesh_module
    from hf_zero.engine.stages import FullyShardedStage

    cfg = load_config({"zero_optimization": {"stage": 3, **layout, **OFFLOADS[offload]}})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # 2 nodes x 2 ranks

    def build_mesh(device_type, plan):
        raise _ReachedTheMesh(plan)

    monkeypatch.setattr(mesh_module, "build_mesh", build_mesh)
    stage = FullyShardedStage(3, cfg.zero_optimization, _env(), PrecisionPolicy.from_config(cfg), offload=object())
    with pytest.raises(_ReachedTheMesh) as reached:
        stage.wrap(nn.Linear(4, 4))
    plan = reached.value.args[0]
    assert (plan.shard, plan.replicate, plan.reshard_after_forward) == (
        (2, 2, True) if "mics_shard_size" in layout else (4, 1, 2))


class _Mesh:
    """The DeviceMesh calls shard_group makes, on a mesh of ``shape``."""

    def __init__(self, *shape: int):
        self.shape = shape
        self.ndim = len(shape)

    def size(self, dim: int | None = None) -> int:
        return self.shape[dim] if dim is not None else int(torch.tensor(self.shape).prod())

    def get_group(self, dim: int) -> str:
        return f"group of mesh dimension {dim}"


def test_shard_group_is_the_second_dimension_of_a_2d_mesh():
    assert shard_group(None, 8) == (8, None)
    assert shard_group(_Mesh(8), 8) == (8, None)  # flat: the default group, as the fill from rank 0 uses
    assert shard_group(_Mesh(2, 4), 8) == (4, "group of mesh dimension 1")  # (replicate, shard)
    with pytest.raises(OffloadError, match="1-D or a 2-D"):
        shard_group(_Mesh(2, 2, 2), 8)


def test_pinned_parameter_shards_are_planned_per_shard_group(monkeypatch):
    """offload_param with pin_memory on a 2 x 2 mesh: each rank pins 1/2 of every parameter (dim 0
    padded to 2), not the 1/4 a world of 4 would give it."""
    cfg = load_config({"zero_optimization": {"stage": 3, "mics_shard_size": 2,
                                             "offload_param": {"device": "cpu", "pin_memory": True}}})
    manager = make_offload_manager(cfg, _env(), PrecisionPolicy.from_config(cfg))
    planned: list[int] = []
    monkeypatch.setattr(accel, "native_pinning", lambda: True)
    monkeypatch.setattr(param_offload, "pinning_fits", lambda nbytes, setting, **kw: planned.append(nbytes) or True)
    model = nn.Sequential(nn.Linear(6, 10), nn.Linear(10, 6))  # first dimensions 10 and 6: 5 / 3 rows of 2
    policy = manager.prepare_fsdp(model, [], mesh=_Mesh(2, 2))["offload_policy"]
    assert policy.pin_memory
    assert planned == [planned_shard_bytes(model, 2, gradients=True)]
    assert planned[0] != planned_shard_bytes(model, 4, gradients=True)
