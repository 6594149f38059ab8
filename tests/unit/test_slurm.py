"""``hf-zero run`` inside SLURM: hostlists expanded as SLURM expands them, SLURM's variables read,
the torchrun options completed from them (planned, not run), and one real two-"node" launch on
this machine with the variables ``srun`` would set on each node."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hf_zero.cli.launch import LaunchLineError, plan_launch_line, torchrun_namespace
from tests.distributed._launch import run_nodes
from hf_zero.cli.launch.slurm import MAX_RANGE, SlurmEnvError, expand_hostlist, in_slurm_job, read_slurm_env

REPO = Path(__file__).resolve().parents[2]
A100 = "NVIDIA A100-SXM4-80GB"

# --------------------------------------------------------------------------------------------
# Hostlists: the expansions `scontrol show hostnames` gives (SLURM's hostlist.c).

HOSTLISTS = [
    ("gpu01", ["gpu01"]),
    ("node1,node2", ["node1", "node2"]),
    ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
    ("gpu[1-3]", ["gpu1", "gpu2", "gpu3"]),
    ("gpu[8-11]", ["gpu8", "gpu9", "gpu10", "gpu11"]),  # no padding: the width is that of "8"
    ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),  # padded to the first number's width
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("n[7]", ["n7"]),
    ("a[1-2]-ib,b3", ["a1-ib", "a2-ib", "b3"]),  # text after the bracket
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),  # first bracket slowest
    ("r[1,3]n[5-6]x", ["r1n5x", "r1n6x", "r3n5x", "r3n6x"]),
    ("gpu[03,01]", ["gpu03", "gpu01"]),  # SLURM's order, not sorted
    ("a,a", ["a", "a"]),  # duplicates kept
    ("  gpu[01-02] , ,cpu1\tcpu2\n", ["gpu01", "gpu02", "cpu1", "cpu2"]),  # whitespace separates; empty entries skipped
    ("gpu[01, 03]", ["gpu01", "gpu03"]),
    ("[1-2]", ["1", "2"]),
    ("", []),
    ("localhost,127.0.0.1", ["localhost", "127.0.0.1"]),
]


@pytest.mark.parametrize("text, hosts", HOSTLISTS)
def test_hostlists_expand_as_slurm_expands_them(text, hosts):
    assert expand_hostlist(text) == hosts


BAD_HOSTLISTS = [
    ("gpu[01-04", "'[' is never closed"),
    ("gpu01]", "']' without '[' at position 5"),
    ("gpu[01-04]],b", "']' without '['"),
    ("a[1[2]]", "brackets do not nest"),
    ("gpu[5-2]", "the range 5-2 in [5-2] runs backwards (write 2-5)"),
    ("gpu[]", "[] holds an empty element"),
    ("gpu[1,,3]", "[1,,3] holds an empty element"),
    ("gpu[a-c]", "'a-c', which is not a number or a range N-M"),
    ("gpu[1-2-3]", "'1-2-3', which is not"),
    ("gpu[-1]", "'-1', which is not"),
    (f"gpu[0-{MAX_RANGE}]", f"more than {MAX_RANGE} hosts"),
]


@pytest.mark.parametrize("text, problem", BAD_HOSTLISTS)
def test_bad_hostlists_are_refused_naming_the_variable_its_value_and_what_to_do(text, problem):
    with pytest.raises(SlurmEnvError) as info:
        expand_hostlist(text, variable="SLURM_JOB_NODELIST")
    message = str(info.value)
    assert message.startswith(f"SLURM_JOB_NODELIST={text!r}: ")
    assert problem in message
    assert "correct it or unset it" in message and "--master_addr on the hf-zero run line" in message
    assert isinstance(info.value, LaunchLineError)  # hf-zero run reports it like a bad line (exit 2)


# --------------------------------------------------------------------------------------------
# SLURM's variables.

JOB = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NNODES": "2", "SLURM_NODEID": "1"}


def test_a_job_is_read_into_an_allocation():
    env = {**JOB, "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_GPUS_ON_NODE": "8"}
    job = read_slurm_env(env)
    assert (job.job_id, job.hosts, job.nnodes, job.node_id) == ("4242", ("gpu01", "gpu02"), 2, 1)
    assert (job.nodelist_var, job.nnodes_var, job.ntasks_var) == ("SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_NTASKS")
    assert (job.proc_id, job.ntasks, job.ntasks_per_node, job.gpus_on_node) == (1, 2, 1, 8)
    bare = read_slurm_env(JOB)
    assert (bare.proc_id, bare.ntasks, bare.ntasks_per_node, bare.gpus_on_node) == (None, None, None, None)
    with pytest.raises(Exception):  # frozen
        job.node_id = 0


def test_outside_slurm_there_is_no_allocation():
    assert read_slurm_env({}) is None and not in_slurm_job({})
    assert read_slurm_env({"SLURM_JOB_ID": "1"}) is None  # no node list: nothing to read
    assert read_slurm_env({"SLURM_JOB_NODELIST": "gpu01", "SLURM_NNODES": "1"}) is None  # no job id
    assert read_slurm_env({**JOB, "SLURM_JOB_ID": "  "}) is None


def test_the_steps_variables_come_before_the_jobs():
    """In `srun -N2` inside a 4-node allocation SLURM_NODEID counts within the step's 2 nodes."""
    env = {**JOB, "SLURM_JOB_NODELIST": "gpu[01-04]", "SLURM_JOB_NUM_NODES": "4", "SLURM_NNODES": "2",
           "SLURM_NODELIST": "gpu[03-04]", "SLURM_STEP_NODELIST": "gpu[03-04]", "SLURM_STEP_NUM_NODES": "2",
           "SLURM_NTASKS": "32", "SLURM_STEP_NUM_TASKS": "2"}
    job = read_slurm_env(env)
    assert (job.hosts, job.nnodes, job.ntasks) == (("gpu03", "gpu04"), 2, 2)
    assert (job.nodelist_var, job.nnodes_var, job.ntasks_var) == ("SLURM_STEP_NODELIST", "SLURM_STEP_NUM_NODES",
                                                                  "SLURM_STEP_NUM_TASKS")
    # SLURM_NODELIST alone (older scripts), SLURM_JOB_NUM_NODES alone
    old = read_slurm_env({"SLURM_JOB_ID": "1", "SLURM_NODELIST": "a,b,c", "SLURM_JOB_NUM_NODES": "3",
                          "SLURM_NODEID": "2"})
    assert (old.hosts, old.nnodes, old.node_id, old.nodelist_var) == (("a", "b", "c"), 3, 2, "SLURM_NODELIST")


def test_counts_left_out_are_counted_from_the_list_and_one_node_is_node_0():
    job = read_slurm_env({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "gpu[1-3]", "SLURM_NODEID": "0"})
    assert (job.nnodes, job.nnodes_var) == (3, None)
    one = read_slurm_env({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "gpu1"})
    assert (one.nnodes, one.node_id) == (1, 0)


BAD_ENVS = [
    ({"SLURM_NNODES": "3"}, ["SLURM_NNODES='3' but SLURM_JOB_NODELIST='gpu[01-02]' names 2 host(s) (gpu01, gpu02)",
                             "Make them agree"]),
    ({"SLURM_NODEID": "2"}, ["SLURM_NODEID='2' but the job has 2 node(s)", "node ids run 0..1", "--node_rank"]),
    ({"SLURM_NODEID": None}, ["SLURM_NODEID is not set, in a 2-node job", "srun --ntasks-per-node=1 hf-zero run"]),
    ({"SLURM_NODEID": "-1"}, ["SLURM_NODEID='-1': expected a whole number >= 0"]),
    ({"SLURM_NNODES": "two"}, ["SLURM_NNODES='two': expected a whole number >= 1", "unset it"]),
    ({"SLURM_NTASKS": "2(x2)"}, ["SLURM_NTASKS='2(x2)'"]),
    ({"SLURM_GPUS_ON_NODE": "x"}, ["SLURM_GPUS_ON_NODE='x'"]),
    ({"SLURM_JOB_NODELIST": "gpu[02-01]"}, ["SLURM_JOB_NODELIST='gpu[02-01]'", "runs backwards"]),
    ({"SLURM_JOB_NODELIST": " , "}, ["SLURM_JOB_NODELIST=' , ': it names no host"]),
]


@pytest.mark.parametrize("change, expected", BAD_ENVS)
def test_variables_that_cannot_be_used_are_refused_by_name_and_value(change, expected):
    env = {k: v for k, v in {**JOB, **change}.items() if v is not None}
    with pytest.raises(SlurmEnvError) as info:
        read_slurm_env(env)
    for text in expected:
        assert text in str(info.value)


# --------------------------------------------------------------------------------------------
# Planning: the torchrun options hf-zero run completes from SLURM (nothing is started).

def _plan(line: str, env: dict, gpus: int = 0):
    return plan_launch_line(shlex.split(line), gpu_names=[A100] * gpus, env=env)


def _options(plan) -> list[str]:
    return plan.torchrun_args[:plan.torchrun_args.index("-m")]


def test_a_node_of_a_two_node_job_is_told_its_place_from_slurm():
    plan = _plan("--nproc_per_node 8 train.py --zero_config ds.json", JOB, gpus=8)
    assert _options(plan) == ["--nproc_per_node=8", "--nnodes=2", "--node_rank=1", "--master_addr=gpu01",
                              "--master_port=29500"]
    assert plan.torchrun_args[-3:] == ["train.py", "--zero_config", "ds.json"]
    notes = [n for n in plan.notes if "SLURM" in n]
    assert notes == ["hf-zero run: from SLURM: --nnodes 2 --node_rank 1 --master_addr gpu01 --master_port 29500 "
                     "(job 4242: SLURM_NNODES=2, SLURM_NODEID=1, first host of SLURM_JOB_NODELIST=gpu[01-02]); "
                     "port 29500 is torchrun's default, --master_port on the line chooses another"]
    torch_args = torchrun_namespace(plan)  # what torch's launcher is handed
    assert (torch_args.nnodes, torch_args.node_rank, torch_args.master_addr, torch_args.master_port) == (
        "2", 1, "gpu01", 29500)
    assert not torch_args.standalone and torch_args.rdzv_backend == "static"
    node0 = _plan("--nproc_per_node 8 train.py", {**JOB, "SLURM_NODEID": "0"}, gpus=8)
    assert _options(node0)[1:4] == ["--nnodes=2", "--node_rank=0", "--master_addr=gpu01"]


@pytest.mark.parametrize("line, env, expected, in_note", [
    ("--master_addr gpu01-ib t.py", {}, ["--master_addr=gpu01-ib", "--nnodes=2", "--node_rank=1", "--master_port=29500"],
     "--nnodes 2 --node_rank 1 --master_port 29500 ("),
    ("--master_port 29611 t.py", {}, ["--master_port=29611", "--nnodes=2", "--node_rank=1", "--master_addr=gpu01"],
     "--nnodes 2 --node_rank 1 --master_addr gpu01 ("),
    ("--nnodes 4 t.py", {}, ["--nnodes=4", "--node_rank=1", "--master_addr=gpu01", "--master_port=29500"],
     "the line's --nnodes 4 is kept, though the SLURM job has 2 nodes"),
    ("--node-rank 0 t.py", {}, ["--node-rank=0", "--nnodes=2", "--master_addr=gpu01", "--master_port=29500"],
     "--nnodes 2 --master_addr gpu01 --master_port 29500 ("),
    # torchrun's own PET_* variables count as given: torchrun reads them for the options
    ("t.py", {"PET_MASTER_ADDR": "10.0.0.9", "PET_MASTER_PORT": "29700"}, ["--nnodes=2", "--node_rank=1"],
     "from SLURM: --nnodes 2 --node_rank 1 (job 4242: SLURM_NNODES=2, SLURM_NODEID=1)"),
    # a rendezvous endpoint says where the nodes meet; c10d numbers the nodes itself
    ("--rdzv_endpoint gpu02:29400 t.py", {}, ["--rdzv_endpoint=gpu02:29400", "--nnodes=2", "--node_rank=1"],
     "from SLURM: --nnodes 2 --node_rank 1 ("),
    ("--rdzv_backend c10d --rdzv_endpoint gpu02:29400 --rdzv_id 7 t.py", {},
     ["--rdzv_backend=c10d", "--rdzv_endpoint=gpu02:29400", "--rdzv_id=7", "--nnodes=2"], "from SLURM: --nnodes 2 ("),
])
def test_what_the_line_gives_wins_and_only_the_rest_comes_from_slurm(line, env, expected, in_note):
    plan = _plan(line, {**JOB, **env})
    assert _options(plan) == ["--nproc_per_node=1", *expected]
    assert "--standalone" not in plan.torchrun_args
    assert sum("from SLURM" in n for n in plan.notes) == 1
    assert any(in_note in n for n in plan.notes), plan.notes


@pytest.mark.parametrize("line", [
    "--nnodes 2 --node_rank 1 --master_addr 10.0.0.1 t.py",
    "--nnodes=2 --node_rank=0 --master_addr=10.0.0.1 --master_port=29501 t.py",
])
def test_a_line_that_gives_its_place_takes_nothing_and_is_not_checked(line):
    """Nothing is taken, so the tasks-per-node rule does not apply (the line has its own layout)."""
    env = {**JOB, "SLURM_NTASKS": "16"}
    plan = _plan(line, env)
    assert plan.torchrun_args == _plan(line, {}).torchrun_args
    assert not any("SLURM" in n for n in plan.notes)


@pytest.mark.parametrize("env", [
    {},
    {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "gpu07", "SLURM_NNODES": "1", "SLURM_NODEID": "0"},
    {"SLURM_JOB_ID": "9", "SLURM_NODELIST": "gpu07", "SLURM_NTASKS": "8", "SLURM_GPUS_ON_NODE": "8"},
    {"SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NNODES": "2", "SLURM_NODEID": "1"},  # no SLURM_JOB_ID
])
@pytest.mark.parametrize("line", ["--nproc_per_node 2 t.py", "--num_gpus 2 t.py", "t.py", "--master_port 29501 t.py"])
def test_one_node_or_no_job_changes_nothing(env, line):
    plan, outside = _plan(line, env, gpus=2), _plan(line, {}, gpus=2)
    assert plan == outside
    assert plan.torchrun_args[0] == "--nproc_per_node=2"


def test_one_task_per_gpu_is_refused_with_the_srun_line_that_works(capsys, tmp_path, monkeypatch):
    env = {**JOB, "SLURM_NTASKS": "16", "SLURM_NTASKS_PER_NODE": "8", "SLURM_PROCID": "9"}
    with pytest.raises(SlurmEnvError) as info:
        _plan("--nproc_per_node 8 train.py", env, gpus=8)
    message = str(info.value)
    assert message.startswith("SLURM_NTASKS=16 tasks on SLURM_NNODES=2 nodes: ")
    assert "hf-zero run starts each node's per-GPU processes itself" in message
    assert "srun --ntasks-per-node=1 hf-zero run" in message and "#SBATCH --ntasks-per-node=1" in message
    # the step's own count decides: `srun --ntasks-per-node=1` inside `#SBATCH --ntasks-per-node=8`
    step = _plan("--nproc_per_node 8 train.py", {**env, "SLURM_STEP_NUM_TASKS": "2"}, gpus=8)
    assert "--node_rank=1" in step.torchrun_args
    # as the command line reports it: exit 2, the message on stderr, nothing started
    from hf_zero.cli.main import main

    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["run", "--nproc_per_node", "1", str(script)]) == 2
    assert "hf-zero run: SLURM_NTASKS=16 tasks on SLURM_NNODES=2 nodes" in capsys.readouterr().err


def test_slurm_gpus_on_node_sets_the_process_count_when_the_line_does_not():
    env = {**JOB, "SLURM_GPUS_ON_NODE": "4"}
    plan = _plan("t.py", env, gpus=4)
    assert _options(plan)[:3] == ["--nproc_per_node=4", "--nnodes=2", "--node_rank=1"]
    assert any(n.startswith("hf-zero run: from SLURM: --nproc_per_node 4 --nnodes 2") and "SLURM_GPUS_ON_NODE=4" in n
               for n in plan.notes)
    on_cpu = _plan("t.py", env)  # a CPU node: SLURM's count of GPUs still says how many ranks
    assert on_cpu.torchrun_args[0] == "--nproc_per_node=4"
    line_wins = _plan("--nproc_per_node 2 t.py", env, gpus=4)
    assert line_wins.torchrun_args[0] == "--nproc_per_node=2" and "SLURM_GPUS_ON_NODE" not in " ".join(line_wins.notes)
    assert _plan("--num_gpus 1 t.py", env, gpus=4).torchrun_args[0] == "--nproc_per_node=1"
    unset = _plan("t.py", JOB, gpus=3)  # without it, one per visible GPU as before
    assert unset.torchrun_args[0] == "--nproc_per_node=3" and "SLURM_GPUS_ON_NODE" not in " ".join(unset.notes)
    with pytest.raises(SlurmEnvError, match=r"SLURM_GPUS_ON_NODE=4 but 2 GPU\(s\) are visible .* --nproc_per_node 2"):
        _plan("t.py", env, gpus=2)


@pytest.mark.parametrize("line, spelling", [("--standalone --nproc_per_node 2 t.py", "--standalone"),
                                            ("--nnodes 1 --nproc_per_node 2 t.py", "--nnodes 1"),
                                            ("--nnodes=1:1 --nproc_per_node 2 t.py", "--nnodes 1:1")])
def test_a_line_for_one_node_takes_nothing_and_says_the_job_has_more(line, spelling):
    plan = _plan(line, {**JOB, "SLURM_NTASKS": "16"})
    assert plan.torchrun_args == _plan(line, {}).torchrun_args
    assert plan.notes == [f"hf-zero run: the SLURM job has 2 nodes, but {spelling} runs this node's ranks on their "
                          f"own: nothing is taken from SLURM (drop {spelling} to train on all 2 nodes)"]
    # variables that cannot be read are not needed by such a line: no error, no note
    assert _plan(line, {**JOB, "SLURM_NNODES": "5"}).notes == []


def test_deepspeed_and_accelerate_lines_are_completed_too():
    plan = _plan("--num_gpus 2 --master_port 29502 t.py --deepspeed ds.json", JOB, gpus=2)
    assert _options(plan) == ["--nproc_per_node=2", "--master_port=29502", "--nnodes=2", "--node_rank=1",
                              "--master_addr=gpu01"]
    assert plan.torchrun_args[-3:] == ["t.py", "--deepspeed", "ds.json"]
    assert plan.env["HF_ZERO_PASS_LOCAL_RANK"] == "1"  # still a DeepSpeed line: the script gets --local_rank
    # DeepSpeed's launcher drops --master_addr on one node; on several SLURM nodes the line's address wins
    kept = _plan("--num_gpus 2 --master_addr gpu02 t.py", JOB, gpus=2)
    assert _options(kept) == ["--nproc_per_node=2", "--master_addr=gpu02", "--nnodes=2", "--node_rank=1",
                              "--master_port=29500"]
    assert not any("is ignored on one node" in n for n in kept.notes)
    alone = _plan("--num_gpus 2 --master_addr gpu02 t.py", {}, gpus=2)
    assert not any(a.startswith("--master_addr") for a in alone.torchrun_args)
    assert any("is ignored on one node" in n for n in alone.notes)
    # accelerate: one machine in the config or on the line is completed; several machines are its own layout
    acc = _plan("--num_processes 2 --main_process_port 29511 t.py", JOB, gpus=2)
    assert _options(acc) == ["--nproc_per_node=2", "--master_port=29511", "--nnodes=2", "--node_rank=1",
                             "--master_addr=gpu01"]
    line = "--num_processes 8 --num_machines 2 --machine_rank 1 --main_process_ip 10.0.0.1 --same_network t.py"
    assert _plan(line, JOB).torchrun_args == _plan(line, {}).torchrun_args


# --------------------------------------------------------------------------------------------
# One real launch: two `hf-zero run` processes on this machine, each with the variables srun sets
# on its node, meet as one 2-node job.

_NODE_RECORDER = """\
import json, os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # from the environment torchrun gives each rank
total = torch.tensor([dist.get_rank() + 1])
dist.all_reduce(total)  # the two nodes really talk
record = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "node_rank": int(os.environ["GROUP_RANK"]),
          "master_addr": os.environ["MASTER_ADDR"], "sum": int(total.item())}
with open(os.path.join(sys.argv[sys.argv.index("--out") + 1], "rank%d.json" % dist.get_rank()), "w") as f:
    json.dump(record, f)
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_hf_zero_runs_with_slurms_variables_form_one_two_node_job(tmp_path):
    script = tmp_path / "record.py"
    script.write_text(_NODE_RECORDER)
    out = tmp_path / "out"
    out.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_", "MASTER_"))}
    base.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2",
                 "SLURM_JOB_NODELIST": "localhost,localhost", "SLURM_NTASKS": "2"})
    # The port is the line's (a free one: 29500 may be taken here); the rest comes from SLURM.
    line = [sys.executable, "-m", "hf_zero.cli.main", "run", "--nproc_per_node", "1", "--master_port",
            str(_free_port()), str(script), "--out", str(out)]
    results = run_nodes([line, line], [{**base, "SLURM_NODEID": str(i), "SLURM_PROCID": str(i)} for i in (0, 1)],
                        tmp_path, timeout=120)
    for node_id, (code, stdout, stderr) in enumerate(results):
        assert code == 0, f"node {node_id} exited {code}\n{stdout[-2000:]}\n{stderr[-4000:]}"
        assert (f"hf-zero run: from SLURM: --nnodes 2 --node_rank {node_id} --master_addr localhost "
                "(job 4242: SLURM_NNODES=2") in stderr, stderr[-2000:]
    records = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert sorted(records) == [0, 1], records
    assert {r["world_size"] for r in records.values()} == {2}
    assert sorted(r["node_rank"] for r in records.values()) == [0, 1]  # one rank on each "node"
    assert all(records[rank]["node_rank"] == rank for rank in (0, 1))  # one rank per node: rank = node rank
    assert {r["master_addr"] for r in records.values()} == {"localhost"}
    assert {r["sum"] for r in records.values()} == {3}


def test_the_sbatch_example_asks_for_one_task_per_node_and_its_line_plans_on_each_node():
    """examples/slurm/train.sbatch: valid bash, 2 nodes x 8 GPUs with one srun task per node, and
    its `hf-zero run` line is what each node plans from SLURM's variables (8 ranks, node 0 or 1)."""
    path = REPO / "examples" / "slurm" / "train.sbatch"
    subprocess.run(["bash", "-n", str(path)], check=True)
    text = path.read_text()
    directives = {line.split()[1] for line in text.splitlines() if line.startswith("#SBATCH ")}
    assert {"--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8"} <= directives
    commands = [line.strip() for line in text.replace("\\\n", " ").splitlines() if line.strip().startswith("srun ")]
    assert len(commands) == 1
    argv = shlex.split(commands[0])
    run_at = argv.index("hf-zero")
    assert argv[run_at + 1] == "run" and "--ntasks-per-node=1" in argv[:run_at]
    line = argv[run_at + 2:]
    script = next(a for a in line if a.endswith(".py"))
    assert (REPO / script).is_file()
    zero_config = re.search(r'"\$\{ZERO_CONFIG:=([^}]+)\}"', text).group(1)
    assert (REPO / zero_config).is_file()
    for node in (0, 1):
        env = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NNODES": "2", "SLURM_NTASKS": "2",
               "SLURM_NODEID": str(node), "SLURM_GPUS_ON_NODE": "8"}
        plan = plan_launch_line(line, gpu_names=[A100] * 8, env=env)
        assert _options(plan) == ["--nproc_per_node=8", "--nnodes=2", f"--node_rank={node}", "--master_addr=gpu07",
                                  "--master_port=29500"]
        assert plan.torchrun_args[plan.rank_args_at:][:3] == [script, "--zero_config", "$ZERO_CONFIG"]


def test_the_messages_the_docs_quote_are_the_ones_hf_zero_run_prints():
    docs = (REPO / "docs" / "launch.md").read_text() + (REPO / "examples" / "slurm" / "README.md").read_text()
    assert _plan("t.py", JOB).notes[0] in docs
    for env in ({**JOB, "SLURM_NTASKS": "16"}, {**JOB, "SLURM_NNODES": "3"}):
        with pytest.raises(SlurmEnvError) as info:
            _plan("t.py", env)
        assert f"hf-zero run: {info.value}" in docs
