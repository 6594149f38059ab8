"""hf-zero run's launch plan and its NCCL settings for consumer cards (pure functions)."""

from __future__ import annotations

from hf_zero.cli.launch import nccl_env_for_gpus, plan_launch


def test_consumer_cards_without_p2p_get_the_nccl_variables_and_a_note():
    env, notes = nccl_env_for_gpus(["NVIDIA GeForce RTX 3090"] * 2, p2p_ok=False, env={})
    assert env == {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"}
    assert len(notes) == 1 and "NCCL_P2P_DISABLE=1" in notes[0] and "RTX 3090" in notes[0]


def test_user_values_win_and_datacenter_cards_are_left_alone():
    env, _ = nccl_env_for_gpus(["NVIDIA GeForce RTX 4090"] * 2, p2p_ok=False, env={"NCCL_P2P_DISABLE": "0"})
    assert env == {"NCCL_IB_DISABLE": "1"}
    assert nccl_env_for_gpus(["NVIDIA H100 80GB HBM3"] * 8, p2p_ok=False, env={}) == ({}, [])
    assert nccl_env_for_gpus(["NVIDIA GeForce RTX 3090"] * 2, p2p_ok=True, env={}) == ({}, [])
    assert nccl_env_for_gpus(["NVIDIA GeForce RTX 3090"], p2p_ok=False, env={}) == ({}, [])


def test_single_node_is_standalone_and_runs_the_bootstrap():
    plan = plan_launch("train.py", ["--zero_config", "ds.json"], nproc_per_node=2, env={})
    assert plan.torchrun_args == [
        "--nproc_per_node=2", "--standalone", "-m", "hf_zero.integration.bootstrap", "train.py", "--zero_config", "ds.json",
    ]
    assert plan.env["OMP_NUM_THREADS"]  # CPU ranks: threads split between them


def test_multi_node_passes_the_rendezvous():
    plan = plan_launch("t.py", [], nproc_per_node=8, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29501,
                       gpu_names=["NVIDIA A100"] * 8, env={})
    assert plan.torchrun_args[:5] == ["--nproc_per_node=8", "--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.1", "--master_port=29501"]
    assert plan_launch("t.py", [], gpu_names=["NVIDIA A100"] * 4, env={}).torchrun_args[0] == "--nproc_per_node=4"


def test_missing_script_is_reported(tmp_path, capsys):
    from hf_zero.cli.main import main

    assert main(["run", str(tmp_path / "nope.py")]) == 2
    assert "nope.py" in capsys.readouterr().err


def test_gpu_ranks_get_their_share_of_the_cores_not_one_thread(monkeypatch):
    """torchrun sets OMP_NUM_THREADS=1 for every rank when it is unset (review F7): the offloaded
    optimizer step would run on one core. A user's own value is kept."""
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    plan = plan_launch("t.py", [], gpu_names=["NVIDIA A100"] * 4, env={})
    assert plan.env["OMP_NUM_THREADS"] == "8"
    assert "OMP_NUM_THREADS" not in plan_launch("t.py", [], gpu_names=["NVIDIA A100"] * 4, env={"OMP_NUM_THREADS": "2"}).env
    assert "OMP_NUM_THREADS" not in plan_launch("t.py", [], gpu_names=["NVIDIA A100"], env={}).env  # one rank: torchrun leaves it


def test_launch_lines_keep_the_planning(monkeypatch):
    """Counts parsed by torch's parser (gpu, auto, MIN:MAX nodes) still drive the OMP share, the
    NCCL variables for consumer cards and the one-GPU-per-rank check."""
    import os

    import pytest

    from hf_zero.cli.launch import LaunchLineError, plan_launch_line

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    rtx = ["NVIDIA GeForce RTX 4090"] * 2
    plan = plan_launch_line(["--nproc-per-node", "gpu", "--nnodes", "1:2", "t.py"], gpu_names=rtx, p2p_ok=False, env={})
    assert plan.env == {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1", "OMP_NUM_THREADS": "8"}
    assert any("RTX 4090" in n for n in plan.notes)
    plan = plan_launch_line(["--num_gpus", "2", "t.py"], gpu_names=rtx, p2p_ok=False, env={"NCCL_P2P_DISABLE": "0"})
    assert plan.env["NCCL_IB_DISABLE"] == "1" and "NCCL_P2P_DISABLE" not in plan.env
    assert plan_launch_line(["--nproc_per_node=auto", "t.py"], gpu_names=rtx, env={}).env["OMP_NUM_THREADS"] == "8"
    with pytest.raises(LaunchLineError, match="LOCAL_RANK"):
        plan_launch_line(["--nproc_per_node=3", "t.py"], gpu_names=rtx, env={})


def test_rtx40_peer_access_is_not_trusted_on_old_drivers():
    """Review F10: RTX 40xx report P2P, and NCCL hangs over it before driver 550.40.07 (the rule
    accelerate applies). Then the launch line gets the NCCL variables as if P2P were off."""
    from hf_zero.cli.launch.plan import p2p_usable

    rtx40 = ["NVIDIA GeForce RTX 4090"] * 2
    assert not p2p_usable(rtx40, True, "535.54.03")
    assert not p2p_usable(rtx40, True, "545.23.08")
    assert p2p_usable(rtx40, True, "550.40.07") and p2p_usable(rtx40, True, "560.35.03")
    assert p2p_usable(rtx40, True, None)  # nvidia-smi not there: the driver's answer stands
    assert p2p_usable(["NVIDIA H100 80GB HBM3"] * 8, True, "535.54.03")
    assert not p2p_usable(["NVIDIA H100 80GB HBM3"] * 8, False, "560.35.03")
    env, notes = nccl_env_for_gpus(rtx40, p2p_ok=p2p_usable(rtx40, True, "535.54.03"), env={})
    assert env == {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"} and notes
