"""mics_shard_size / zero_hpz_partition_size: parsed, checked against the launch, and turned into
FSDP2's mesh shape and reshard_after_forward (hf_zero/distributed/mesh.py). The runs themselves:
tests/distributed/test_hierarchical.py (4 ranks as 2 nodes x 2); with offload:
tests/unit/test_hierarchical_offload_setup.py and tests/distributed/test_hierarchical_offload.py."""

from __future__ import annotations

import pytest

from hf_zero.config import load_config
from hf_zero.config.errors import ZeroConfigError
from hf_zero.config.no_effect import describe_no_effect
from hf_zero.distributed.mesh import MeshError, plan_mesh


@pytest.mark.parametrize("stage, world, per_node, mics, hpz, want", [
    (3, 16, 8, -1, 1, (16, 1, True)),       # flat ZeRO-3
    (2, 16, 8, -1, 1, (16, 1, False)),      # flat ZeRO-2
    (3, 16, 8, 8, 1, (8, 2, True)),         # MiCS: a node per shard group
    (3, 16, 8, 16, 1, (16, 1, True)),       # a group of the whole world is the flat mesh
    (3, 32, 8, 16, 1, (16, 2, True)),       # groups of two whole nodes
    (3, 16, 8, 4, 1, (4, 4, True)),         # half a node
    (2, 16, 8, 8, 1, (8, 2, False)),        # MiCS at stage 2: the same layout, gathered through the step
    (3, 16, 8, -1, 8, (16, 1, 8)),          # hpZ: the backward gathers inside a node
    (3, 32, 8, 16, 8, (16, 2, 8)),          # both
    (2, 16, 8, -1, 8, (16, 1, False)),      # hpZ is a stage-3 feature (reported as no effect at 2)
    (3, 16, 8, 0, 1, (16, 1, True)),        # 0 is off, as in DeepSpeed (> 0 enables)
])
def test_plans(stage, world, per_node, mics, hpz, want):
    plan = plan_mesh(stage, world, per_node, mics, hpz)
    assert (plan.shard, plan.replicate, plan.reshard_after_forward) == want
    assert plan.world == world


@pytest.mark.parametrize("world, per_node, mics, hpz, message", [
    (16, 8, 6, 1, "mics_shard_size=6 does not divide the world size 16"),
    (16, 8, 32, 1, "mics_shard_size=32 does not divide the world size 16"),
    (24, 8, 12, 1, "mics_shard_size=12 splits the 8 ranks of a node"),
    (16, 8, -1, 32, "zero_hpz_partition_size=32 must divide the shard group of 16 ranks (the world size)"),
    (16, 8, -1, 3, "zero_hpz_partition_size=3 must divide"),
    (32, 8, 8, 16, "zero_hpz_partition_size=16 must divide the shard group of 8 ranks (zero_optimization.mics_shard_size)"),
    (24, 8, -1, 5, "zero_hpz_partition_size=5 must divide"),
    (48, 8, -1, 12, "zero_hpz_partition_size=12 splits the 8 ranks of a node"),
])
def test_refused_with_the_key_and_what_to_use(world, per_node, mics, hpz, message):
    with pytest.raises(MeshError) as err:
        plan_mesh(3, world, per_node, mics, hpz)
    assert message in str(err.value)


def test_hpz_of_the_whole_shard_group_changes_nothing():
    """ZeRO++'s one-node example (zero_hpz_partition_size 8 on 8 GPUs): the secondary partition is
    the primary one; accepted, said at start-up, and the run is plain ZeRO-3 (also with offload)."""
    plan = plan_mesh(3, 8, 8, hpz_partition_size=8)
    assert (plan.shard, plan.replicate, plan.reshard_after_forward, plan.hpz_same_as_shard) == (8, 1, True, True)
    assert "equals the shard group of 8 ranks" in plan.describe() and "nothing changes" in plan.describe()
    also = plan_mesh(3, 16, 8, mics_shard_size=8, hpz_partition_size=8)
    assert (also.shard, also.replicate, also.reshard_after_forward) == (8, 2, True)


def test_describe_says_what_each_key_became():
    text = plan_mesh(3, 32, 8, 16, 8).describe()
    assert "mics_shard_size=16" in text and "2 groups of 16 ranks" in text and "2 x 16 replicate x shard mesh" in text
    assert "zero_hpz_partition_size=8" in text and "reshard_after_forward=8" in text


def test_config_keys_parse_and_report():
    cfg = load_config({"zero_optimization": {"stage": 3, "mics_shard_size": 8, "zero_hpz_partition_size": 4,
                                             "mics_hierarchical_params_gather": True}})
    assert cfg.zero_optimization.mics_shard_size == 8 and cfg.zero_optimization.hpz_partition_size == 4
    lines = describe_no_effect(cfg)
    assert not any(line.startswith(("zero_optimization.mics_shard_size:", "zero_optimization.zero_hpz_partition_size:")) for line in lines)
    assert any("mics_hierarchical_params_gather" in line and "one collective" in line for line in lines)
    low = describe_no_effect(load_config({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 4}}))
    assert any("zero_hpz_partition_size" in line and "stage-3 feature" in line for line in low)


def test_a_group_of_one_is_refused():
    with pytest.raises(ZeroConfigError, match="mics_shard_size") as err:
        load_config({"zero_optimization": {"stage": 3, "mics_shard_size": 1}})
    assert "-1" in str(err.value)
