"""``hf-zero run`` launch lines: torchrun's options (checked against torch's own parser), the
DeepSpeed launcher's one-node options (checked against DeepSpeed 0.19.8's launcher), and errors.

The references are torch's ``get_args_parser()`` (what plain torchrun makes of the same line) and,
where /tmp/ds-venv holds DeepSpeed, its launcher's own resource functions; the expectations written
out by hand follow deepspeed/launcher/runner.py and launch.py.
"""

from __future__ import annotations

import ast
import collections
import copy
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from hf_zero.cli.launch import BOOTSTRAP_MODULE, LaunchLineError, plan_launch_line
from hf_zero.cli.launch.torchrun_form import HANDLED_BY_HF_ZERO
from hf_zero.integration.bootstrap import PASS_LOCAL_RANK_ENV

REPO = Path(__file__).resolve().parents[2]
A100 = "NVIDIA A100-SXM4-80GB"


def _plan(line: str, gpus: int = 0, env: dict | None = None):
    return plan_launch_line(shlex.split(line), gpu_names=[A100] * gpus, env=env or {})


def _torch(argv: list[str]):
    return get_args_parser().parse_args(argv)


def _error(line: str, gpus: int = 0, env: dict | None = None) -> str:
    with pytest.raises(LaunchLineError) as info:
        _plan(line, gpus, env)
    return str(info.value)


# --------------------------------------------------------------------------------------------
# torchrun form: whatever torch's parser makes of the user's line, it makes of hf-zero's argv.

TORCHRUN_LINES = [
    # source 001 (ChatGLM3 finetune_hf.py), positional script arguments included
    "--standalone --nnodes=1 --nproc_per_node=2 finetune_hf.py data/AdvertiseGen_fix/ THUDM/chatglm3-6b "
    "configs/lora.yaml configs/ds_zero_2.json",
    "--nproc_per_node=8 --master_port=29501 finetune.py --deepspeed ds.json --bf16 True",
    "--nproc-per-node 2 --rdzv_backend c10d --rdzv-endpoint localhost:29400 --rdzv_id job1 --rdzv-conf timeout=60 t.py",
    "--rdzv-backend=c10d --rdzv_endpoint=localhost:29400 --rdzv-id=job1 --rdzv_conf=join_timeout=10,timeout=60 t.py",
    "--max_restarts 3 --monitor-interval 0.5 --nproc_per_node 2 t.py --x 1",
    "--max-restarts=3 --monitor_interval=0.5 --nproc-per-node=2 t.py",
    "--nnodes 1:2 --nproc-per-node 2 t.py",
    "--nnodes=2 --node_rank=1 --master_addr=10.0.0.1 --master_port=29500 --nproc_per_node=2 t.py",
    "--nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 t.py",
    "--log_dir /tmp/logs --redirects 3 --tee 0:1 t.py",
    "--log-dir=/tmp/logs -r 3 -t 1 t.py",
    "--local-ranks-filter 0 --nproc_per_node 2 t.py",
    "--local_ranks_filter=0,1 --nproc_per_node=2 t.py",
    "--start_method fork --role trainer --local_addr 127.0.0.1 --event-log-handler null t.py",
    "--virtual-local-rank --numa_binding node --signals-to-handle SIGTERM --shutdown_timeout 10 t.py",
    "--nproc_per_node 2 t.py --nproc_per_node 5 --standalone",  # after SCRIPT: the script's own
]


@pytest.mark.parametrize("line", TORCHRUN_LINES)
def test_torchrun_line_means_to_torch_what_plain_torchrun_would(line):
    argv = shlex.split(line)
    known = {spelling for action in _torch_options() for spelling in action.option_strings}
    script_at = next(i for i, a in enumerate(argv) if a.endswith(".py"))
    missing = [a for a in argv[:script_at] if a.startswith("-") and a.split("=")[0] not in known]
    if missing:  # options newer than the installed torch (the version matrix runs older ones)
        pytest.skip(f"this torch's torchrun has no {missing}")
    reference = _torch(argv)  # plain `torchrun LINE`
    plan = _plan(line)
    ours = _torch(plan.torchrun_args)
    # the ranks run the bootstrap as a module, with the user's script and arguments behind it
    assert (ours.module, ours.training_script) == (True, BOOTSTRAP_MODULE)
    assert ours.training_script_args == [reference.training_script, *reference.training_script_args]
    added = {"nproc_per_node"} if not any(a.startswith("--nproc") for a in argv[: argv.index(reference.training_script)]) else set()
    for dest, value in vars(reference).items():
        if dest in {"module", "training_script", "training_script_args", "standalone", *added}:
            continue
        assert getattr(ours, dest) == value, (dest, plan.torchrun_args)
    assert ours.standalone or not reference.standalone
    assert PASS_LOCAL_RANK_ENV not in plan.env  # torchrun sets LOCAL_RANK only, no --local_rank argument


def _sample_value(action) -> str:
    """A value torch's parser accepts for ``action`` (and that hf-zero can plan with)."""
    if action.choices:
        return list(action.choices)[0]
    return {"nnodes": "1:2", "nproc_per_node": "2", "local_ranks_filter": "0"}.get(
        action.dest, {int: "3", float: "0.5"}.get(action.type, "value1"))


def _torch_options():
    return [a for a in get_args_parser()._actions if a.option_strings and a.dest != "help"]


def _every_spelling_of_every_torchrun_option():
    for action in _torch_options():
        for spelling in action.option_strings:
            if action.nargs == 0:
                yield action, [spelling]
            else:
                value = _sample_value(action)
                yield action, [spelling, value]
                yield action, [f"{spelling}={value}"]


def test_every_option_of_torchs_launcher_parser_is_accepted():
    """Enumerates torch's parser, so an option torch adds is covered without touching this test."""
    torch_dests = {a.dest for a in _torch_options()}
    assert set(HANDLED_BY_HF_ZERO) <= torch_dests  # torch renamed one: hf-zero's handling must follow
    checked = 0
    for action, option in _every_spelling_of_every_torchrun_option():
        line = [*option, "t.py", "--a"]
        if action.dest in ("no_python", "run_path"):
            with pytest.raises(LaunchLineError, match=option[0].split("=")[0]):
                plan_launch_line(line, env={})
            continue
        try:
            reference = _torch(line)
        except SystemExit:  # plain torchrun prints and exits (torch 2.15's --print-completion): so does hf-zero run
            with pytest.raises(SystemExit):
                plan_launch_line(line, env={})
            continue
        ours = _torch(plan_launch_line(line, env={}).torchrun_args)
        if action.dest == "module":  # the user's module runs behind the bootstrap's own -m
            assert ours.training_script_args == ["-m", "t.py", "--a"]
            continue
        assert getattr(ours, action.dest) == getattr(reference, action.dest), option
        assert ours.training_script_args == ["t.py", "--a"]
        checked += 1
    assert checked >= 50  # 30-odd options, most with two spellings and two value forms


def test_help_lists_torchs_options_and_the_deepspeed_ones(capsys):
    from hf_zero.cli.main import main

    assert main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    for action in _torch_options():
        for spelling in action.option_strings:
            assert spelling in out
    for spelling in ("--num_gpus", "--num_accelerators", "--include", "--exclude", "--num_nodes", "--hostfile",
                     "--no_local_rank"):
        assert spelling in out


def test_default_process_count_and_rendezvous():
    # no count: one rank per visible GPU, one on a CPU machine; one node: a free port (--standalone)
    assert _plan("t.py", gpus=4).torchrun_args[:2] == ["--nproc_per_node=4", "--standalone"]
    assert _plan("t.py").torchrun_args[:2] == ["--nproc_per_node=1", "--standalone"]
    # a port, an endpoint or several nodes: torch's static/c10d rendezvous as given, no --standalone
    assert "--standalone" not in _plan("--master_port 29501 t.py").torchrun_args
    assert "--standalone" not in _plan("--nnodes 1:2 t.py").torchrun_args
    assert "--standalone" not in _plan("--rdzv_backend c10d --rdzv_endpoint h:1 t.py").torchrun_args


def test_nproc_names_resolve_like_torchrun(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    # gpu/auto count GPUs; auto and cpu count cores without GPUs (torch's determine_local_world_size)
    assert _plan("--nproc-per-node gpu t.py", gpus=4).env["OMP_NUM_THREADS"] == "2"
    assert _plan("--nproc_per_node auto t.py", gpus=2).env["OMP_NUM_THREADS"] == "4"
    assert _plan("--nproc_per_node auto t.py").env["OMP_NUM_THREADS"] == "1"  # 8 CPU ranks on 8 cores
    assert _plan("--nproc_per_node=cpu t.py").env["OMP_NUM_THREADS"] == "1"
    assert "--nproc-per-node=gpu" in _plan("--nproc-per-node gpu t.py", gpus=4).torchrun_args  # torch resolves it


def test_module_runs_behind_the_bootstrap():
    plan = _plan("-m pkg.train --lr 1")
    assert plan.torchrun_args[-5:] == ["-m", BOOTSTRAP_MODULE, "-m", "pkg.train", "--lr", "1"][-5:]
    assert plan.torchrun_args.count("-m") == 2


# --------------------------------------------------------------------------------------------
# DeepSpeed form


def _devices(plan) -> list[str]:
    """GPUs the ranks use: CUDA_VISIBLE_DEVICES when the plan sets it, else the first N visible."""
    nproc = int(next(a for a in plan.torchrun_args if a.startswith("--nproc_per_node=")).split("=")[1])
    listed = plan.env.get("CUDA_VISIBLE_DEVICES")
    return listed.split(",") if listed else [str(i) for i in range(nproc)]


DEEPSPEED_LINES = {  # line -> GPUs used on a 4-GPU node, by deepspeed/launcher/runner.py
    "--num_gpus 2": ["0", "1"],
    "--num_gpus=4": ["0", "1", "2", "3"],
    "--num_accelerators 3": ["0", "1", "2"],
    "--include localhost:1,3": ["1", "3"],
    "-i localhost:3,1,1": ["1", "3"],  # sorted, duplicates dropped
    "--include=localhost": ["0", "1", "2", "3"],
    "--include localhost:0@localhost:2": ["0", "2"],
    "--exclude localhost:0": ["1", "2", "3"],
    "-e localhost:1,2": ["0", "3"],
    "--num_nodes 1": ["0", "1", "2", "3"],
    "--num_nodes=1 --num_gpus 3": ["0", "1", "2"],
    "--no_local_rank --num_gpus 2": ["0", "1"],
}


@pytest.mark.parametrize("line", sorted(DEEPSPEED_LINES))
def test_deepspeed_line_uses_the_gpus_deepspeed_would(line):
    plan = _plan(f"{line} --master_port 29501 train.py --deepspeed ds.json", gpus=4)
    assert _devices(plan) == DEEPSPEED_LINES[line]
    torch_view = _torch(plan.torchrun_args)
    assert torch_view.master_port == 29501 and torch_view.nnodes == "1:1"
    assert torch_view.training_script_args == ["train.py", "--deepspeed", "ds.json"]
    # DeepSpeed's launch.py gives the script --local_rank=N unless --no_local_rank
    assert plan.env.get(PASS_LOCAL_RANK_ENV) == (None if "--no_local_rank" in line else "1")


def _deepspeed_runner_functions():
    """DeepSpeed 0.19.8's own resource functions (runner.py), loaded without importing deepspeed."""
    runner = Path("/tmp/ds-venv/lib/python3.11/site-packages/deepspeed/launcher/runner.py")
    if not runner.is_file():
        pytest.skip("DeepSpeed's launcher source is not at /tmp/ds-venv")
    tree = ast.parse(runner.read_text())
    wanted = {"_stable_remove_duplicates", "parse_node_config", "parse_node_config_list", "parse_resource_filter",
              "parse_inclusion_exclusion", "apply_num_nodes_and_gpus"}
    module = ast.Module(body=[n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted],
                        type_ignores=[])
    quiet = type("Logger", (), {"info": staticmethod(print), "error": staticmethod(print)})
    namespace = {"collections": collections, "deepcopy": copy.deepcopy, "defaultdict": collections.defaultdict,
                 "Tuple": tuple, "List": list, "Dict": dict, "logger": quiet}
    exec(compile(module, str(runner), "exec"), namespace)
    return namespace


def test_every_option_of_deepspeeds_launcher_parser_is_known():
    """Each option string DeepSpeed's runner.py declares is one hf-zero run parses (used, refused
    with a message, or noted as without effect), read from DeepSpeed's source, not from our table."""
    from hf_zero.cli.launch import build_launch_parser

    runner = Path("/tmp/ds-venv/lib/python3.11/site-packages/deepspeed/launcher/runner.py")
    if not runner.is_file():
        pytest.skip("DeepSpeed's launcher source is not at /tmp/ds-venv")
    parse_args = next(n for n in ast.parse(runner.read_text()).body
                      if isinstance(n, ast.FunctionDef) and n.name == "parse_args")
    declared = [arg.value for call in ast.walk(parse_args) if isinstance(call, ast.Call)
                and getattr(call.func, "attr", None) == "add_argument" for arg in call.args
                if isinstance(arg, ast.Constant) and str(arg.value).startswith("-")]
    assert len(declared) > 25
    known = build_launch_parser()[0]._option_string_actions
    assert [s for s in declared if s not in known] == []


@pytest.mark.parametrize("line", sorted(DEEPSPEED_LINES))
def test_deepspeed_line_against_deepspeeds_own_resource_functions(line):
    ds = _deepspeed_runner_functions()
    opts = {"include": "", "exclude": "", "num_nodes": -1, "num_gpus": -1}
    tokens = shlex.split(line.replace("=", " "))
    for flag, value in zip(tokens, tokens[1:] + [""]):
        name = {"-i": "include", "-e": "exclude", "--num_accelerators": "num_gpus"}.get(flag, flag.lstrip("-"))
        if name in opts:
            opts[name] = type(opts[name])(value)
    active = ds["parse_inclusion_exclusion"]({"localhost": 4}, opts["include"], opts["exclude"])
    active = ds["apply_num_nodes_and_gpus"](active, opts["num_nodes"], opts["num_gpus"])
    assert _devices(_plan(f"{line} train.py", gpus=4)) == [str(i) for i in active["localhost"]]


def test_deepspeed_lines_from_readmes():
    # source 002: CUDA_VISIBLE_DEVICES=0 deepspeed --num_gpus=1 ./finetune_trainer.py ...
    plan = _plan("--num_gpus=1 ./finetune_trainer.py --deepspeed ds.json", gpus=1, env={"CUDA_VISIBLE_DEVICES": "0"})
    assert plan.torchrun_args[:2] == ["--nproc_per_node=1", "--standalone"]
    assert plan.env[PASS_LOCAL_RANK_ENV] == "1"
    # deepspeed --include localhost:0,1 --master_port 29501 train.py, on a CPU machine
    plan = _plan("--include localhost:0,1 --master_port 29501 train.py --deepspeed ds.json")
    assert plan.torchrun_args[:2] == ["--nproc_per_node=2", "--master_port=29501"]
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    # on CPU, --num_gpus still gives that many (gloo) processes
    assert _torch(_plan("--num_gpus 2 train.py").torchrun_args).nproc_per_node == "2"


def test_deepspeed_master_addr_is_ignored_on_one_node_and_said_so():
    plan = _plan("--num_gpus 2 --master_addr 10.1.2.3 t.py")
    assert _torch(plan.torchrun_args).master_addr == "127.0.0.1"
    assert any("--master_addr 10.1.2.3 is ignored" in n for n in plan.notes)


def test_cuda_visible_devices_is_the_pool_deepspeed_options_pick_from():
    env = {"CUDA_VISIBLE_DEVICES": "2,3"}
    plan = _plan("--num_gpus 1 t.py", gpus=2, env=env)  # DeepSpeed would take GPU 0: said in a note
    assert "CUDA_VISIBLE_DEVICES" not in plan.env and any("CUDA_VISIBLE_DEVICES=2,3" in n for n in plan.notes)
    assert _plan("--num_gpus 1 t.py", gpus=1, env={"CUDA_VISIBLE_DEVICES": "0"}).notes == []  # same GPU either way
    assert _plan("--include localhost:3 t.py", gpus=2, env=env).env["CUDA_VISIBLE_DEVICES"] == "3"
    assert _plan("--exclude localhost:2 t.py", gpus=2, env=env).env["CUDA_VISIBLE_DEVICES"] == "3"
    message = _error("--include localhost:0 t.py", gpus=2, env=env)
    assert "GPU 0" in message and "CUDA_VISIBLE_DEVICES=2,3" in message


def test_deepspeed_rank_logs_and_no_effect_options():
    plan = _plan("--num_gpus 2 --enable_each_rank_log logs --launcher pdsh --bind_cores_to_rank -q t.py")
    torch_view = _torch(plan.torchrun_args)
    assert (torch_view.log_dir, torch_view.redirects) == ("logs", "3")
    notes = "\n".join(plan.notes)
    for option in ("--launcher", "--bind_cores_to_rank", "-q:"):  # named as typed
        assert option in notes


def test_shared_options_alone_make_a_torchrun_line():
    # --master_port/--master_addr/--node_rank/--module exist in both launchers: no --local_rank then
    plan = _plan("--master_port 29501 t.py")
    assert PASS_LOCAL_RANK_ENV not in plan.env
    assert PASS_LOCAL_RANK_ENV in _plan("--master_port 29501 --num_gpus 1 t.py").env


# --------------------------------------------------------------------------------------------
# everything after SCRIPT is the script's (issue 26): in every form, whatever it looks like

_ACCELERATE_YAML = """\
compute_environment: LOCAL_MACHINE
deepspeed_config:
  zero_stage: 2
distributed_type: DEEPSPEED
num_machines: 1
num_processes: 2
"""


def _launcher_lookalikes() -> list[str]:
    """Script arguments that are every launcher option's exact name, and that prefix-match them
    (``--log`` prefixes --log_dir, --log-dir, --logs_specs, --log_level; ``--num`` --num_gpus...)."""
    from hf_zero.cli.launch import build_launch_parser

    parser, _ = build_launch_parser()
    exact = sorted(s for s in parser._option_string_actions if s.startswith("--"))
    prefixes = sorted({s[:n] for s in exact for n in (len(s) - 1, 5) if n > 2} - set(exact))
    return ["--log", "steps.jsonl", *prefixes, *exact, "--nproc_per_node=3", "-r3", "-m", "x", "--", "-h"]


@pytest.mark.parametrize("form", ["--nproc_per_node 2", "--num_gpus 2", "--config_file {yaml}",
                                  "--num_processes 2 --use_deepspeed"])
def test_script_arguments_go_to_the_script_whatever_they_look_like(form, tmp_path):
    from accelerate.commands.launch import launch_command_parser

    from hf_zero.cli.launch import torchrun_namespace

    yaml = tmp_path / "cfg.yaml"
    yaml.write_text(_ACCELERATE_YAML)
    launcher = shlex.split(form.format(yaml=yaml))
    script_args = _launcher_lookalikes()
    plan = plan_launch_line([*launcher, "train.py", *script_args], env={})
    ranks = torchrun_namespace(plan)  # what torch's launcher runs: the bootstrap, with these arguments
    assert (ranks.module, ranks.training_script) == (True, plan.torchrun_args[plan.rank_args_at - 1])
    assert ranks.training_script_args == ["train.py", *script_args]
    # accelerate's own parser (no abbreviations) gives its script the same list
    assert launch_command_parser().parse_args(["train.py", *script_args]).training_script_args == script_args
    assert int(ranks.nproc_per_node) == 2  # the script's --nproc_per_node=3 changed nothing


@pytest.mark.parametrize("line, whole", [("--nproc 2 t.py", "--nproc_per_node"), ("--num_g 2 t.py", "--num_gpus"),
                                         ("--num_proc 2 t.py", "--num_processes"),
                                         ("--config cfg.yaml t.py", "--config_file"),
                                         ("--master_p 29501 t.py", "--master_port")])
def test_launcher_options_are_never_abbreviated(line, whole):
    """Three launchers' options share prefixes; a prefix before SCRIPT is refused with the whole names
    (accelerate launch takes no abbreviation either)."""
    message = _error(line)
    assert f"unknown launcher option {line.split()[0]}" in message and whole in message, message


def test_module_scripts_and_a_double_dash_keep_their_arguments():
    from hf_zero.cli.launch import torchrun_namespace

    ranks = torchrun_namespace(_plan("--nproc_per_node 2 -m pkg.train --log x --module"))
    assert ranks.training_script_args == ["-m", "pkg.train", "--log", "x", "--module"]
    ranks = torchrun_namespace(_plan("--num_gpus 2 -- train.py --num_gpus 3"))
    assert ranks.training_script_args == ["train.py", "--num_gpus", "3"]
    assert int(ranks.nproc_per_node) == 2


# --------------------------------------------------------------------------------------------
# errors name the option and what to do


def test_hostfile_gets_the_command_for_each_node(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# cluster\nworker-0 slots=4\nworker-1 slots=4\n")
    message = _error(f"--hostfile {hostfile} --master_port 29600 train.py --deepspeed ds.json")
    assert "--hostfile" in message
    assert ("on worker-1: hf-zero run --nnodes 2 --node_rank 1 --master_addr worker-0 --master_port 29600 "
            "--nproc_per_node 4 train.py --deepspeed ds.json") in message


@pytest.mark.parametrize("line, names", [
    ("--num_nodes 2 --num_gpus 8 t.py", ["--num_nodes 2", "--nnodes 2 --node_rank R"]),
    ("-H /no/such/hostfile t.py", ["-H /no/such/hostfile", "--nnodes N --node_rank R"]),
    ("--force_multi t.py", ["--force_multi", "--node_rank R"]),
    ("--num_gpus 2 --node_rank 1 t.py", ["--node_rank 1", "--nnodes N"]),
])
def test_multi_node_deepspeed_lines_are_refused_with_per_node_commands(line, names):
    message = _error(line)
    for name in names:
        assert name in message


@pytest.mark.parametrize("line, names", [
    ("--standalone --num_gpus 2 t.py", ["--standalone", "--num_gpus", "torchrun", "DeepSpeed"]),
    ("--nproc_per_node 2 --include localhost:0 t.py", ["--nproc_per_node", "--include"]),
    ("--foo t.py", ["--foo", "--help"]),
    ("--num-gpus 2 t.py", ["--num-gpus", "did you mean --num_gpus"]),
    ("--include localhost:0 --exclude localhost:1 t.py", ["--include", "--exclude", "mutually exclusive"]),
    ("--num_gpus 2 --include localhost:0 t.py", ["--num_gpus", "--include"]),
    ("--include worker-1:0 t.py", ["worker-1", "localhost"]),
    ("--include localhost:a t.py", ["--include", "integers"]),
    ("--exclude localhost:1 t.py", ["--exclude", "no GPU"]),
    ("--no-python t.py", ["--no-python", "bootstrap"]),
    ("--run_path t.py", ["--run_path", "bootstrap"]),
    ("--no_python --num_gpus 2 t.py", ["--no_python"]),
    ("--autotuning tune --num_gpus 2 t.py", ["--autotuning"]),
    ("--nproc-per-node gpu t.py", ["gpu", "no GPU"]),
    ("--nnodes 3:2 t.py", ["--nnodes 3:2", "MIN:MAX"]),
    ("--max_restarts many t.py", ["--max_restarts", "many"]),
    ("--num_gpus two t.py", ["--num_gpus", "two"]),
    ("", ["no SCRIPT"]),
])
def test_bad_lines_name_the_option(line, names):
    message = _error(line)
    for name in names:
        assert name in message, message


def test_more_ranks_than_gpus_is_refused_before_launching():
    message = _error("--nproc_per_node 4 t.py", gpus=2)
    assert "--nproc_per_node 4" in message and "2 GPU(s)" in message
    assert "--num_gpus 4" in _error("--num_gpus 4 t.py", gpus=2)
    assert "GPU 5" in _error("--include localhost:5 t.py", gpus=2)


def test_cli_reports_bad_lines_and_missing_scripts(tmp_path, capsys):
    from hf_zero.cli.main import main

    assert main(["run", "--foo", str(tmp_path / "t.py")]) == 2
    assert "--foo" in capsys.readouterr().err
    assert main(["run", "--num_gpus", "2", str(tmp_path / "nope.py")]) == 2
    assert "nope.py" in capsys.readouterr().err
    assert main(["run", "-m", "no_such_module_xyz"]) == 2
    assert "no_such_module_xyz" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# the bootstrap end of it (one process, no launcher)

_RECORD = "import json, sys; print(json.dumps(sys.argv))\n"


def _bootstrap(args: list[str], cwd: Path, **env: str) -> list[str]:
    full_env = {k: v for k, v in os.environ.items() if k != PASS_LOCAL_RANK_ENV}
    full_env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **env)
    proc = subprocess.run([sys.executable, "-m", BOOTSTRAP_MODULE, *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bootstrap_gives_local_rank_first_like_deepspeed_and_runs_modules(tmp_path):
    (tmp_path / "record.py").write_text(_RECORD)
    argv = _bootstrap(["record.py", "--deepspeed", "ds.json"], tmp_path, LOCAL_RANK="3", **{PASS_LOCAL_RANK_ENV: "1"})
    assert argv == ["record.py", "--local_rank=3", "--deepspeed", "ds.json"]  # deepspeed/launcher/launch.py order
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text(_RECORD)
    argv = _bootstrap(["-m", "pkg.train", "--x", "1"], tmp_path, LOCAL_RANK="0")
    assert argv == [str(tmp_path / "pkg" / "train.py"), "--x", "1"]  # as `python -m pkg.train --x 1`


# --------------------------------------------------------------------------------------------
# end to end: two CPU ranks per line, against plain torchrun running the same script

_RANK_RECORDER = """\
import json, os, sys
out = sys.argv[sys.argv.index("--out") + 1]
transformers = sys.modules.get("transformers")  # imported by hf_zero's bootstrap only
record = {"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")},
          "trainer_module": transformers.Trainer.__module__ if transformers else None}
# whether this rank's OMP_NUM_THREADS=1 is taken for the launcher's default (as if it had 8 cores);
# the module alone (stdlib only), so that the plain run imports neither hf_zero nor torch
import importlib.util
path = os.path.join(importlib.util.find_spec("hf_zero").submodule_search_locations[0], "offload", "step_threads.py")
spec = importlib.util.spec_from_file_location("step_threads", path)
threads = sys.modules["step_threads"] = importlib.util.module_from_spec(spec)  # (dataclasses look it up)
spec.loader.exec_module(threads)
record["step_threads"] = threads.plan_step_threads(
    current=1, cores=8, local_world=int(os.environ["LOCAL_WORLD_SIZE"]), env=os.environ,
    launcher_env=threads.launcher_environ()).threads
with open(os.path.join(out, "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump(record, f)
"""


def _launch_and_read(prefix: list[str], script: Path, out: Path, *extra: str) -> dict[int, dict]:
    import json

    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(PASS_LOCAL_RANK_ENV, None)
    env.pop("OMP_NUM_THREADS", None)  # each launcher sets it for its 2 ranks (1 on this test's 2 cores)
    proc = subprocess.run([*prefix, str(script), "--out", str(out), "--flag", *extra], cwd=script.parent, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{prefix} exited {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    records = {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert sorted(records) == [0, 1], records
    return records


def _argv(record: dict, out: Path) -> list[str]:
    return ["OUT" if a == str(out) else a for a in record["argv"]]


@pytest.mark.slow
def test_torchrun_and_deepspeed_lines_start_two_ranks_like_their_launchers(tmp_path):
    script = tmp_path / "record.py"
    script.write_text(_RANK_RECORDER)
    line = ["--standalone", "--nnodes=1", "--nproc_per_node=2"]
    plain = _launch_and_read([sys.executable, "-m", "torch.distributed.run", *line], script, tmp_path / "plain")
    hf_zero_run = [sys.executable, "-m", "hf_zero.cli.main", "run"]
    # Script arguments that prefix-match or equal launcher options are the script's (issue 26). Plain
    # torchrun cannot take --log on Python 3.11 (its parser abbreviates): the reference goes without them.
    lookalikes = ["--log", "steps.jsonl", "--nproc_per_node", "3", "--num", "1", "--master_p", "9"]
    torchrun_form = _launch_and_read([*hf_zero_run, *line], script, tmp_path / "torchrun_form", *lookalikes)
    deepspeed_form = _launch_and_read([*hf_zero_run, "--num_gpus", "2"], script, tmp_path / "deepspeed_form",
                                      *lookalikes)
    for rank in (0, 1):
        # the torchrun line: what plain torchrun gives the script, with transformers' Trainer swapped
        assert _argv(plain[rank], tmp_path / "plain") == ["--out", "OUT", "--flag"]
        assert _argv(torchrun_form[rank], tmp_path / "torchrun_form") == ["--out", "OUT", "--flag", *lookalikes]
        assert torchrun_form[rank]["env"] == plain[rank]["env"] == {"RANK": str(rank), "LOCAL_RANK": str(rank),
                                                                    "WORLD_SIZE": "2"}
        assert plain[rank]["trainer_module"] is None
        assert torchrun_form[rank]["trainer_module"].startswith("hf_zero.")
        # the DeepSpeed line: 2 processes on CPU too, --local_rank=N first (deepspeed/launcher/launch.py)
        assert _argv(deepspeed_form[rank], tmp_path / "deepspeed_form") == [f"--local_rank={rank}", "--out", "OUT",
                                                                            "--flag", *lookalikes]
        assert deepspeed_form[rank]["env"] == plain[rank]["env"]
        # torchrun's own OMP_NUM_THREADS=1 is told from a chosen one (read from the launcher's environment):
        # the offloaded step would take 8 cores / 2 ranks under plain torchrun, and keep hf-zero run's count
        assert plain[rank]["step_threads"] == 4
        assert torchrun_form[rank]["step_threads"] is None and deepspeed_form[rank]["step_threads"] is None
        assert deepspeed_form[rank]["trainer_module"].startswith("hf_zero.")
