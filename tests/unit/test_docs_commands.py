"""Every shell command the user-facing docs show works as written.

The commands are read from the ``bash``/``sh``/``shell`` code blocks of the pages below (``\\``
continuations joined, comments dropped). Each one is either

(a) run by a test: :data:`RUN_BY` maps the command to that test file, and the file must contain
    the command's program, script and every option it passes; or
(b) checked here, cheaply, by the parser of the tool it calls: ``hf-zero run`` lines are planned by
    hf_zero's own launcher parser (torch's torchrun parser, DeepSpeed's launcher options) without
    launching; other ``hf-zero`` lines are parsed by the ``hf-zero`` parser, and ``config check``
    and ``estimate`` run in this process when the files they name exist; ``torchrun`` lines go
    through torch's own parser; ``python`` lines of a script in this repository go through that
    script's own argument parser (stopped before it does anything); ``pip install`` lines must
    name the torch pin CI installs, this project, or packages of its ``test`` extra.

Lines that end in ``# [DeepSpeed]`` are what DeepSpeed users run today, shown for comparison; the
docs say so where they show them. A ``deepspeed``, ``torchrun`` or ``accelerate launch`` line so
marked must become a valid ``hf-zero run`` line when its launcher's name is replaced, as the docs
promise. A ``deepspeed`` line without the marker fails.

The Chinese pages (``docs/zh/``) must show the same commands as their English pages.
"""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = ["quickstart.md", "migration_from_deepspeed.md", "troubleshooting.md", "notebooks.md", "checkpoints.md",
         "offload.md"]
ZH_PAGES = ["quickstart.md", "migration_from_deepspeed.md", "troubleshooting.md"]
MARKER = "# [DeepSpeed]"
A100 = "NVIDIA A100-SXM4-80GB"

# (a) Commands a test runs: command as the docs show it -> (test file, what that file must contain).
RUN_BY: dict[str, tuple[str, tuple[str, ...]]] = {
    "jupyter execute examples/notebook/finetune_in_notebook.ipynb": (
        "integration_tests/test_notebook.py",
        ("jupyter execute examples/notebook/finetune_in_notebook.ipynb", "finetune_in_notebook.ipynb", "nbclient"),
    ),
}

# Set-up lines shown verbatim (the README's set-up; .ci/run does the same in its own venv).
SETUP = {"python3 -m venv .venv", ". .venv/bin/activate"}
# DeepSpeed's own tools, shown (marked) next to hf_zero's replacement.
DEEPSPEED_TOOLS = {"ds_report", "zero_to_fp32.py"}


@dataclass
class Command:
    page: str
    text: str  # without the comment
    before: bool  # marked as what DeepSpeed users run today
    env: dict[str, str] = field(default_factory=dict)
    argv: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.page}: {self.text}"


def commands(path: Path) -> list[Command]:
    """The shell commands of ``path``'s bash/sh/shell code blocks."""
    found = []
    page = str(path.relative_to(DOCS))
    for block in re.findall(r"^```(?:bash|sh|shell)[ \t]*\n(.*?)^```", path.read_text(), flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            before = line.endswith(MARKER)
            argv = shlex.split(line, comments=True)
            env = {}
            while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):
                key, value = argv.pop(0).split("=", 1)
                env[key] = value
            text = " ".join(shlex.quote(a) if a != "." else a for a in [*(f"{k}={v}" for k, v in env.items()), *argv])
            found.append(Command(page, text, before, env, argv))
    return found


def all_commands() -> list[Command]:
    pages = [DOCS / p for p in PAGES] + sorted((DOCS / "zh").glob("*.md"))
    return [c for p in pages for c in commands(p)]


# ------------------------------------------------------------------------------------ checks
def _repo_paths_exist(tokens: list[str]) -> None:
    """Every repository path a line names (examples/..., assets/...) exists."""
    for token in tokens:
        value = token.split("=", 1)[-1]
        if value.startswith(("examples/", "assets/", "docs/", "integration_tests/", "scripts/", "bench/")):
            assert (REPO / value).exists(), f"{value} does not exist in the repository"


def _plan_hf_zero_run(argv: list[str], env: dict[str, str]):
    from hf_zero.cli.launch import plan_launch_line

    # 8 data-centre GPUs: lines that pick GPUs (--include localhost:0,1) have some to pick from.
    return plan_launch_line(argv, gpu_names=[A100] * 8, env=env)


def _check_hf_zero(cmd: Command, capsys) -> None:
    from hf_zero.cli.main import build_parser, main

    sub = cmd.argv[1:]
    _repo_paths_exist(sub)
    if sub[:1] == ["run"]:
        _plan_hf_zero_run(sub[1:], cmd.env)
        return
    parser = build_parser()
    try:
        parser.parse_args(sub)
    except SystemExit as exc:
        pytest.fail(f"{cmd}: the hf-zero parser refuses it (exit {exc.code}): {capsys.readouterr().err}")
    named = [t for t in sub[1:] if "/" in t or t.endswith((".json", ".yaml"))]
    if sub[0] in ("estimate", "config") and all((REPO / t).exists() for t in named):
        assert main(sub) == 0, capsys.readouterr()  # pure CPU, no process group: run it


def _check_torchrun(argv: list[str]) -> None:
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(argv)
    assert parsed.training_script


def _check_python(cmd: Command) -> None:
    script = cmd.argv[1]
    path = REPO / script
    assert path.is_file(), f"{cmd}: {script} is not a script of this repository"

    class Parsed(Exception):
        pass

    real = argparse.ArgumentParser.parse_known_args

    def parse_then_stop(self, args=None, namespace=None):
        result = real(self, args, namespace)  # the script's own parser: argparse exits on an error
        raise Parsed(result)

    argv0 = sys.argv
    sys.argv = [str(path), *cmd.argv[2:]]
    argparse.ArgumentParser.parse_known_args = parse_then_stop
    try:
        with pytest.raises(Parsed) as parsed:
            runpy.run_path(str(path), run_name="__main__")
    finally:
        argparse.ArgumentParser.parse_known_args = real
        sys.argv = argv0
    namespace, extra = parsed.value.args[0]
    assert not extra, f"{cmd}: arguments the script does not take: {extra}"


def _extras() -> dict[str, list[str]]:
    """pyproject.toml's optional dependencies (read with a regex: tomllib is Python 3.11+)."""
    text = (REPO / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return {name: re.findall(r'"([^"]+)"', body)
            for name, body in re.findall(r"^(\w+)\s*=\s*\[(.*?)\]", section, flags=re.M | re.S)}


def _check_pip(cmd: Command) -> None:
    assert cmd.argv[1] == "install", cmd
    args = cmd.argv[2:]
    extras = _extras()
    ci = (REPO / ".ci" / "run").read_text()
    if args[:1] == ["-e"]:
        spec = args[1]
        assert spec == "." or re.fullmatch(r"\.\[[\w,]+\]", spec), cmd
        assert set(spec[2:-1].split(",") if spec != "." else []) <= set(extras), cmd
        return
    test_extra = {re.split(r"[<>=!~\[]", r)[0].lower() for r in extras["test"]}
    for name in args:
        if name.startswith("torch=="):
            assert f"pip install -q {name}" in ci, f"{cmd}: CI installs another torch"
        else:
            assert name.lower() in test_extra, f"{cmd}: {name} is not in the test extra of pyproject.toml"


def _check_before(cmd: Command) -> None:
    """A DeepSpeed-era line: with `hf-zero run` in place of its launcher it must plan."""
    prog = cmd.argv[0]
    if prog in ("deepspeed", "torchrun"):
        rest = cmd.argv[1:]
        if prog == "torchrun":
            _check_torchrun(rest)
    elif cmd.argv[:2] == ["accelerate", "launch"]:
        rest = cmd.argv[2:]
    else:
        tool = Path(cmd.argv[1]).name if prog in ("python", "python3") and len(cmd.argv) > 1 else prog
        assert tool in DEEPSPEED_TOOLS, f"{cmd}: marked {MARKER!r} but not a launcher or DeepSpeed tool"
        return
    _plan_hf_zero_run(rest, cmd.env)


COMMANDS = all_commands()


def test_pages_show_commands():
    assert {c.page for c in COMMANDS} >= {*PAGES, *(f"zh/{p}" for p in ZH_PAGES)}
    assert len(COMMANDS) > 40  # the extraction found the blocks, not nothing


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: f"{c.page}:{c.text[:60]}")
def test_command_is_run_by_a_test_or_checked(cmd: Command, capsys):
    prog = cmd.argv[0]
    if cmd.text in RUN_BY:
        test_file, needles = RUN_BY[cmd.text]
        source = (REPO / test_file).read_text()
        missing = [n for n in needles if n not in source]
        assert not missing, f"{cmd}: {test_file} does not contain {missing}"
        _repo_paths_exist(cmd.argv)
    elif cmd.before:
        _check_before(cmd)
    elif cmd.text in SETUP:
        pass
    elif prog == "hf-zero":
        _check_hf_zero(cmd, capsys)
    elif prog == "torchrun":
        _check_torchrun(cmd.argv[1:])
        _repo_paths_exist(cmd.argv[1:])
    elif prog in ("python", "python3"):
        _check_python(cmd)
    elif prog == "pip":
        _check_pip(cmd)
    elif prog in ("deepspeed", "accelerate"):
        pytest.fail(f"{cmd}: a DeepSpeed/accelerate line must end in {MARKER!r} or use hf-zero run")
    else:
        pytest.fail(f"{cmd}: no test runs or checks this command; add it to RUN_BY or a check here")


def test_run_by_table_has_no_stale_rows():
    shown = {c.text for c in COMMANDS}
    assert not set(RUN_BY) - shown


@pytest.mark.parametrize("page", ZH_PAGES)
def test_chinese_page_shows_the_same_commands(page):
    english = Counter((c.text, c.before) for c in commands(DOCS / page))
    chinese = Counter((c.text, c.before) for c in commands(DOCS / "zh" / page))
    assert chinese == english, (f"docs/zh/{page} and docs/{page} differ: only in English "
                                f"{sorted(english - chinese)}, only in Chinese {sorted(chinese - english)}")


def test_a_marked_line_that_hf_zero_run_cannot_take_fails():
    """The checks can fail: a DeepSpeed multi-node line and a misspelt option are refused."""
    from hf_zero.cli.launch import LaunchLineError

    bad = Command("x", "deepspeed --hostfile hosts train.py", True, {}, ["deepspeed", "--hostfile", "hosts", "train.py"])
    with pytest.raises(LaunchLineError):
        _check_before(bad)
    with pytest.raises(LaunchLineError):
        _plan_hf_zero_run(["--num-gpus", "2", "train.py"], {})
    with pytest.raises(SystemExit):
        _check_torchrun(["--no_such_option", "2", "train.py"])


def test_consumer_cards_get_the_nccl_variables_troubleshooting_shows():
    from hf_zero.cli.launch import plan_launch_line

    text = (DOCS / "troubleshooting.md").read_text()
    plan = plan_launch_line(["--nproc_per_node", "2", "train.py"], gpu_names=["NVIDIA GeForce RTX 4090"] * 2,
                            p2p_ok=False, env={})
    assert plan.env["NCCL_P2P_DISABLE"] == "1" and plan.env["NCCL_IB_DISABLE"] == "1"
    assert plan.notes and plan.notes[0] in text  # the note the page quotes is the one printed
