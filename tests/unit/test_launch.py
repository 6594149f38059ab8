"""hf-zero run's launch plan, its NCCL settings for consumer cards, and the OpenMP threads of the
offloaded optimizer step under plain torchrun (pure functions, and one in-process optimizer)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

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
    assert plan.env == {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1", "OMP_NUM_THREADS": "8",
                        "HF_ZERO_OMP_NUM_THREADS_CHOSEN": "1"}
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


# --------------------------------------------------------------------------------------------
# Plain torchrun / accelerate launch give each rank OMP_NUM_THREADS=1 (review F7): the offloaded
# optimizer step takes the rank's share of the cores while it runs, unless the 1 is the user's.

def _decide(env=None, launcher=None, **kw):
    from hf_zero.offload.step_threads import plan_step_threads

    args = {"current": 1, "cores": 32, "local_world": 4, "openmp": True, **kw}
    return plan_step_threads(env={"OMP_NUM_THREADS": "1", **(env or {})}, launcher_env=launcher, **args)


def test_torchruns_default_gets_the_share_of_the_cores_in_the_step_and_says_so():
    decided = _decide(launcher={"PATH": "/usr/bin"})  # the launcher was started without OMP_NUM_THREADS
    assert decided.threads == 8  # 32 cores / 4 ranks
    for part in ("OMP_NUM_THREADS=1", "8 threads per rank", "32 cores / 4 ranks", "OMP_NUM_THREADS=8 torchrun",
                 "--num_cpu_threads_per_process 8", "hf-zero run"):
        assert part in decided.message, decided.message


@pytest.mark.parametrize("case, env, launcher, kw", [
    ("the user's OMP_NUM_THREADS=1 torchrun", {}, {"OMP_NUM_THREADS": "1"}, {}),
    ("chosen by hf-zero run (its plan, or accelerate's --num_cpu_threads_per_process)",
     {"HF_ZERO_OMP_NUM_THREADS_CHOSEN": "1"}, {}, {}),
    ("the script's torch.set_num_threads(4)", {}, {}, {"current": 4}),
    ("one rank per node (torchrun leaves the variable)", {}, {}, {"local_world": 1}),
    ("no core to spare", {}, {}, {"cores": 4, "local_world": 4}),
    ("the user's OMP_NUM_THREADS=2", {"OMP_NUM_THREADS": "2"}, {"OMP_NUM_THREADS": "2"}, {"current": 2}),
])
def test_a_thread_count_someone_chose_is_left_alone_and_not_mentioned(case, env, launcher, kw):
    decided = _decide(env, launcher, **kw)
    assert (decided.threads, decided.message) == (None, None), case


@pytest.mark.parametrize("launcher, openmp, why", [(None, True, "cannot be read"), ({}, False, "not OpenMP")])
def test_when_the_default_cannot_be_told_or_changed_the_step_keeps_one_thread_and_says_how_to_fix_it(
        launcher, openmp, why):
    decided = _decide(launcher=launcher, openmp=openmp)
    assert decided.threads is None
    assert "1 of the 8 cores per rank" in decided.message and why in decided.message
    assert "OMP_NUM_THREADS=8 torchrun" in decided.message and "hf-zero run" in decided.message


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="reads /proc (Linux)")
def test_the_launchers_environment_is_what_it_was_started_with():
    """How a rank tells torchrun's 1 from the user's: torchrun sets the variable in its own
    os.environ after it started, which /proc/<pid>/environ does not show."""
    import subprocess
    import sys

    from hf_zero.offload.step_threads import launcher_environ

    code = "import os, sys, time; os.environ['OMP_NUM_THREADS'] = '1'; print('set', flush=True); time.sleep(60)"
    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    for env, expected in ((base, None), ({**base, "OMP_NUM_THREADS": "1"}, "1")):
        proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "set"
            seen = launcher_environ(proc.pid)
            assert seen is not None and seen.get("OMP_NUM_THREADS") == expected
            assert seen.get("PATH") == env.get("PATH")
        finally:
            proc.kill()
            proc.wait()
    assert launcher_environ(1) is None  # an orphaned rank: no launcher to ask


def test_plan_marks_the_thread_count_it_chose(monkeypatch):
    from hf_zero.offload.step_threads import CHOSEN_ENV

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    assert plan_launch("t.py", [], nproc_per_node=4, env={}).env[CHOSEN_ENV] == "1"  # its 1 is chosen, not a default
    assert CHOSEN_ENV not in plan_launch("t.py", [], nproc_per_node=4, env={"OMP_NUM_THREADS": "1"}).env


class _RecordingSGD(torch.optim.SGD):
    seen: list[int] = []

    def step(self, closure=None):
        _RecordingSGD.seen.append(torch.get_num_threads())
        return super().step(closure)


def test_the_offloaded_step_runs_on_the_share_and_gives_the_thread_back(monkeypatch, caplog):
    """One rank of a 2-rank torchrun on 8 cores, in-process: OMP_NUM_THREADS=1 from torchrun, a
    launcher started without it. The inner optimizer steps on 4 threads; torch has 1 again after;
    the update is plain SGD's; rank 0 says so once."""
    from hf_zero.config.schema import AioConfig
    from hf_zero.offload import step_threads
    from hf_zero.offload.cpu_optimizer import HostOffloadConfig, OffloadedOptimizer, ParamPlan

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv(step_threads.CHOSEN_ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(step_threads, "launcher_environ", lambda pid=None: {"PATH": "/usr/bin"})
    monkeypatch.setattr(step_threads, "_said", set())
    openmp = "OpenMP" in torch.__config__.parallel_info()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        params = [nn.Parameter(torch.randn(40, 3, generator=g)), nn.Parameter(torch.randn(7, generator=g))]
        grads = [torch.randn(p.shape, generator=g) for p in params]
        plain = [p.detach().clone().requires_grad_() for p in params]
        build = lambda groups: _RecordingSGD(groups, lr=0.1)
        host = HostOffloadConfig(device="cpu", sub_group_size=64, buffer_count=2, nvme_path=None,
                                 aio=AioConfig(block_size=4096, thread_count=2), run_id="test")
        with caplog.at_level("WARNING", logger="hf_zero"):
            for _ in range(2):  # a second engine in the same process does not repeat the message
                opt = OffloadedOptimizer(build([{"params": params}]), build, {id(p): f"p{i}" for i, p in enumerate(params)},
                                         host, ParamPlan(host=list(params)))
        said = [r.getMessage() for r in caplog.records if "OMP_NUM_THREADS" in r.getMessage()]
        assert len(said) == 1 and "4 threads per rank" in said[0] and "OMP_NUM_THREADS=4 torchrun" in said[0]
        _RecordingSGD.seen = []
        for p, grad in zip(params, grads):
            opt.accumulate_grad(p, grad)
        opt.step()
        assert _RecordingSGD.seen and set(_RecordingSGD.seen) == {4 if openmp else 1}
        assert torch.get_num_threads() == 1
        for p, grad in zip(plain, grads):
            p.grad = grad.clone()
        torch.optim.SGD(plain, lr=0.1).step()
        for p, q in zip(params, plain):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)  # same kernel, same inputs
        opt.close()
    finally:
        torch.set_num_threads(before)
