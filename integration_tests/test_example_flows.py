"""The source documents' flows end to end, launched as their users launch them, on 2 CPU ranks.

- The README's first command (its ``hf-zero run`` part, output folder moved to a temporary one):
  ZeRO-3 on 2 ranks with ``examples/finetune_qwen/finetune.py``; a progress bar, the closing
  lines from rank 0 only, a model that ``from_pretrained`` loads and ``inference_hf.py`` runs.
- Source 000: ``CPU_DEMO=1 bash examples/finetune_qwen/run.sh`` (the guide's command under
  ``hf-zero run``): the guide's output-folder handling, ``--warmup_ratio`` + cosine as transformers
  schedules them, the guide's ZeRO-3 config, fp32 on a CPU.
- The two-import change under plain ``torchrun``: ``finetune.py`` with ``ZeroTrainer`` /
  ``ZeroTrainingArguments`` resumes the README run's ``checkpoint-10`` and logs the losses the
  uninterrupted run logged.
- Source 001: ``examples/chatglm_lora/finetune_hf.py DATA MODEL configs/lora.yaml configs/ds_zero_2.json``
  (the tutorial's ``torchrun --standalone --nnodes=1 --nproc_per_node=2`` replaced by ``hf-zero run``)
  and the same with ``configs/ds_zero_3.json``, on the tiny GLM-4 (``assets/tiny-glm4``): the loss
  falls, both stages take the same first step, the adapter loads with ``PeftModel.from_pretrained`` and
  trained only the LoRA weights, and ``inference_hf.py`` generates from a checkpoint folder and from
  the final output.

Five 2-rank launches, each reused by several tests through module-scoped fixtures.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _run import REPO, run

pytestmark = pytest.mark.slow

ASSETS = REPO / "assets"
QWEN_DIR = REPO / "examples" / "finetune_qwen"
GLM_DIR = REPO / "examples" / "chatglm_lora"
INFERENCE = "examples/chatglm_lora/inference_hf.py"
GLM_PROMPT = "类型#裙*颜色#蓝色*风格#清新*图案#蝴蝶结"


def hf_zero_bin() -> list[str]:
    """``hf-zero`` as the user types it: the console script of this environment."""
    script = Path(sys.executable).parent / "hf-zero"
    return [str(script)] if script.exists() else [sys.executable, "-m", "hf_zero.cli.main"]


def readme_first_command() -> list[str]:
    """The ``hf-zero run ...`` part of the first command in README.md's "Set-up" section (the
    virtualenv and pip parts before it are this test environment's own set-up)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    setup = text[text.index("## Set-up"):]
    block = re.search(r"```bash\n(.*?)\n```", setup, re.S).group(1)
    parts = [p.strip() for p in block.split(" && ")]
    launch = [p for p in parts if p.startswith("hf-zero run ")]
    assert len(launch) == 1, f"README's first command has no single `hf-zero run` part: {block}"
    return shlex.split(launch[0])


def with_output_dir(argv: list[str], out: Path) -> list[str]:
    i = argv.index("--output_dir")
    return [*argv[: i + 1], str(out), *argv[i + 2:]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def logged(output_dir: Path, key: str) -> list[tuple[int, float]]:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return [(h["step"], h[key]) for h in state["log_history"] if key in h and "train_runtime" not in h]


def generate(model_dir: Path, *extra: str) -> list[int]:
    """Run inference_hf.py as a user does; return the new token ids it printed (8 of them)."""
    proc = run([sys.executable, INFERENCE, str(model_dir), *extra, "--max_new_tokens", "8", "--min_new_tokens", "8"])
    ids = json.loads(proc.stdout.split("new token ids: ", 1)[1].split("\n", 1)[0])
    assert len(ids) == 8 and all(0 <= i < 512 for i in ids), proc.stdout
    assert "response: " in proc.stdout
    return ids


# ----------------------------------------------------------------------- README's first command
@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("readme") / "qwen"
    argv = with_output_dir(readme_first_command(), out)
    proc = run([*hf_zero_bin(), *argv[1:]])
    return out, proc


def test_readme_command_trains_zero3_with_a_progress_bar_and_says_where_the_model_went(readme_run):
    out, proc = readme_run
    assert "ZeRO stage 3" in proc.stdout + proc.stderr
    assert re.search(r"100%\|[^\n\r]*\| 20/20", proc.stderr), "no tqdm progress bar reaching 20/20"
    # the closing lines come from rank 0 only and name this run's folder
    assert proc.stdout.count("The fine-tuned model is in") == 1, proc.stdout[-2000:]
    tail = proc.stdout[proc.stdout.index("The fine-tuned model is in"):]
    assert str(out) in tail and "from_pretrained" in tail and "inference_hf.py" in tail
    losses = [loss for _, loss in logged(out, "loss")]
    assert len(losses) == 4 and losses[0] > 5.5 and losses[-1] < losses[0] - 0.3, losses
    assert (out / "checkpoint-10" / "zero_state").is_dir() and (out / "checkpoint-20").is_dir()


def test_readme_model_loads_and_generates_as_the_closing_lines_say(readme_run):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, proc = readme_run
    model = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(ASSETS / "tiny-qwen2")
    saved = load_file(out / "model.safetensors")
    for key, value in model.state_dict().items():
        if key in saved:
            torch.testing.assert_close(value, saved[key], rtol=0, atol=0)
    changed = [k for k, v in base.state_dict().items() if not torch.equal(v, model.state_dict()[k])]
    assert len(changed) > len(saved) // 2, changed
    # the "Try it" line, run as printed (it names this output folder)
    try_line = next(line for line in proc.stdout.splitlines() if "Try it:" in line)
    argv = shlex.split(try_line.split("Try it:", 1)[1])
    assert argv[:2] == ["python", INFERENCE] and argv[2] == str(out), argv
    ids = generate(Path(argv[2]), *argv[3:])
    # the reference: the prompt in the training script's own Alpaca format, transformers' greedy search
    spec = importlib.util.spec_from_file_location("finetune_under_test", QWEN_DIR / "finetune.py")
    finetune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(finetune)
    prompt = finetune.PROMPT_DICT["prompt_no_input"].format(instruction=argv[argv.index("--prompt") + 1])
    tokenizer = AutoTokenizer.from_pretrained(out)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        expected = model.eval().generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                         pad_token_id=tokenizer.pad_token_id)
    assert ids == expected[0, inputs["input_ids"].shape[1]:].tolist()


def test_two_import_change_under_plain_torchrun_resumes_the_readme_run(readme_run, tmp_path):
    """finetune.py with hf_zero's two classes, launched by torchrun itself, resumes checkpoint-10 of
    the README run and logs the same losses for steps 11-20 as the run that never stopped."""
    out, _ = readme_run
    source = (QWEN_DIR / "finetune.py").read_text(encoding="utf-8")
    edited = source.replace("from transformers import Trainer\n",
                            "from hf_zero import ZeroTrainer as Trainer, ZeroTrainingArguments\n")
    edited = edited.replace("transformers.HfArgumentParser((ModelArguments, DataArguments, transformers.TrainingArguments))",
                            "transformers.HfArgumentParser((ModelArguments, DataArguments, ZeroTrainingArguments))")
    assert edited.count("ZeroTrainer") == 1 and edited.count("ZeroTrainingArguments") == 2, "finetune.py changed"
    script = tmp_path / "finetune.py"
    script.write_text(edited, encoding="utf-8")
    resumed = tmp_path / "resumed"
    shutil.copytree(out / "checkpoint-10", resumed / "checkpoint-10")
    argv = with_output_dir(readme_first_command(), resumed)
    argv = argv[argv.index("examples/finetune_qwen/finetune.py"):]  # the script and its arguments
    run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script), *argv[1:],
         "--resume_from_checkpoint", str(resumed / "checkpoint-10")])
    expected = [(s, loss) for s, loss in logged(out, "loss") if s > 10]
    got = logged(resumed, "loss")
    # the resumed state carries the log of steps 5 and 10 from the checkpoint; 15 and 20 are new
    assert got[:2] == [(s, x) for s, x in logged(out, "loss") if s <= 10]
    got = got[2:]
    assert [s for s, _ in got] == [s for s, _ in expected] == [15, 20], got
    torch.testing.assert_close([x for _, x in got], [x for _, x in expected], rtol=1e-4, atol=0)


# ------------------------------------------------------------------------- source 000: run.sh
@pytest.fixture(scope="module")
def run_sh(tmp_path_factory):
    out = tmp_path_factory.mktemp("run_sh") / "output"
    out.mkdir()
    (out / "stale.txt").write_text("from an earlier run")
    env = {**os.environ, "CPU_DEMO": "1", "OUTPUT_DIR": str(out), "MASTER_PORT": str(free_port()),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["bash", str(QWEN_DIR / "run.sh")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"run.sh exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return out, proc


def test_run_sh_cpu_demo_is_the_guides_command_under_hf_zero(run_sh):
    out, proc = run_sh
    log = (out / "train.log").read_text()
    assert not (out / "stale.txt").exists(), "run.sh empties the output folder as the guide does"
    assert "ZeRO stage 3, fp32, world size 2" in log, "the guide's ZeRO-3 config, no bf16 on a CPU"
    assert "ds_config_zero3.json" in log and "The fine-tuned model is in" in log
    losses = [loss for _, loss in logged(out, "loss")]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses
    # save_total_limit 1 (the guide's): only the last checkpoint is left
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-20"]


def test_run_sh_learning_rates_follow_warmup_ratio_and_cosine(run_sh):
    """--warmup_ratio 0.03 --lr_scheduler_type cosine over 20 steps, as transformers' own schedule
    gives them (the rate each update used is the one logged)."""
    from transformers import get_cosine_schedule_with_warmup

    out, _ = run_sh
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1e-3)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=math.ceil(0.03 * 20), num_training_steps=20)
    expected = []
    for _ in range(20):
        expected.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    got = [lr for _, lr in logged(out, "learning_rate")]
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-12)


# ---------------------------------------------------------------------- source 001: ChatGLM LoRA
def _chatglm(tmp_path_factory, name: str, launch: list[str], ds_config: str):
    out = tmp_path_factory.mktemp(name) / "output"
    proc = run([*hf_zero_bin(), "run", *launch, "examples/chatglm_lora/finetune_hf.py",
                "assets/data", "assets/tiny-glm4", "examples/chatglm_lora/configs/lora.yaml", ds_config,
                "--output_dir", str(out), "--max_steps", "8", "--save_steps", "4", "--logging_steps", "1",
                "--log_level", "warning"])
    return out, proc


@pytest.fixture(scope="module")
def chatglm_zero2(tmp_path_factory):
    # the tutorial's launch line with torchrun replaced by hf-zero run
    return _chatglm(tmp_path_factory, "glm_z2", ["--standalone", "--nnodes=1", "--nproc_per_node=2"],
                    "examples/chatglm_lora/configs/ds_zero_2.json")


@pytest.fixture(scope="module")
def chatglm_zero3(tmp_path_factory):
    return _chatglm(tmp_path_factory, "glm_z3", ["--nproc_per_node", "2"], "examples/chatglm_lora/configs/ds_zero_3.json")


@pytest.mark.parametrize("flow,stage", [("chatglm_zero2", 2), ("chatglm_zero3", 3)])
def test_chatglm_lora_trains_and_the_adapter_loads(request, flow, stage):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out, proc = request.getfixturevalue(flow)
    assert f"ZeRO stage {stage}" in proc.stdout + proc.stderr
    assert proc.stdout.count("The fine-tuned LoRA adapter is in") == 1, proc.stdout[-2000:]
    losses = [loss for _, loss in logged(out, "loss")]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.05, losses
    for folder in (out, out / "checkpoint-4", out / "checkpoint-8"):
        assert (folder / "adapter_model.safetensors").is_file() and not (folder / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(ASSETS / "tiny-glm4")
    assert type(base).__name__ == "Glm4ForCausalLM"
    base_sd = {k: v.clone() for k, v in base.state_dict().items()}
    model = PeftModel.from_pretrained(base, out)
    lora_b = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    # all-linear: every projection of both blocks, the fused gate_up_proj included; the head is not
    assert len(lora_b) == 2 * 6 and any("gate_up_proj" in n for n in lora_b), sorted(lora_b)
    assert all(torch.count_nonzero(p) > 0 for p in lora_b.values()), "an untrained lora_B"
    plain = model.get_base_model().state_dict()
    for key, value in base_sd.items():
        module, _, leaf = key.rpartition(".")
        torch.testing.assert_close(plain.get(key, plain.get(f"{module}.base_layer.{leaf}")), value, rtol=0, atol=0)


def test_chatglm_zero2_and_zero3_take_the_same_first_step(chatglm_zero2, chatglm_zero3):
    """Same seed, data and initial adapter (finetune_hf.py seeds before get_peft_model): the first
    gradient norm and the losses of the first two steps do not depend on the stage. Later steps may
    differ, as under DeepSpeed: ds_zero_2.json clips at --max_grad_norm through "gradient_clipping":
    "auto", ChatGLM3's ds_zero_3.json has no gradient_clipping; Adam's first update is the same
    either way (it is invariant to the gradient's scale)."""
    z2, z3 = chatglm_zero2[0], chatglm_zero3[0]
    assert [s for s, _ in logged(z2, "loss")[:2]] == [s for s, _ in logged(z3, "loss")[:2]] == [1, 2]
    torch.testing.assert_close([x for _, x in logged(z3, "loss")[:2]], [x for _, x in logged(z2, "loss")[:2]],
                               rtol=1e-5, atol=0)
    torch.testing.assert_close(logged(z3, "grad_norm")[0][1], logged(z2, "grad_norm")[0][1], rtol=1e-4, atol=0)


def peft_greedy_ids(adapter_dir: Path) -> list[int]:
    """The reference: base model + adapter loaded by peft itself, the prompt through the chat
    template as finetune_hf.py trained it, 8 greedy tokens."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tiny-glm4")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ASSETS / "tiny-glm4"), adapter_dir).eval()
    text = tokenizer.apply_chat_template([{"role": "user", "content": GLM_PROMPT}], add_generation_prompt=True,
                                         tokenize=False)
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("flow,folder", [("chatglm_zero2", "checkpoint-4"), ("chatglm_zero3", "")])
def test_inference_hf_generates_from_a_checkpoint_and_from_the_final_output(request, flow, folder):
    adapter_dir = request.getfixturevalue(flow)[0] / folder
    assert generate(adapter_dir, "--prompt", GLM_PROMPT) == peft_greedy_ids(adapter_dir)
