"""TRL's own shipped scripts (``trl/scripts/sft.py``, ``dpo.py``, ``grpo.py``, ``rloo.py``,
``kto.py``, ``reward.py``, ``distillation.py``), run by path as their users run them, under
``hf-zero run --deepspeed ds.json`` against plain ``torchrun`` DDP of the same command: SFT (full
and LoRA), DPO with a reference model and TR-DPO's ``sync_ref_model``, GRPO and RLOO with
``beta > 0`` (a reference model, generation), KTO (a reference model), the reward trainer (a
sequence-classification model), on-policy distillation (a teacher model), GRPO with a reward model;
in fp32, and in TRL's default bf16 (SFT, DPO). Losses and gradient norms to 2e-3, saved weights
equal (bf16: close, see :func:`_assert_bf16_run_matches_ddp`) and loadable; a frozen reference, teacher or
reward model is sharded at stages 2/3 (half the elements on each rank, from hf_zero's log).

CI time: each launch costs an interpreter start and the imports of torch, transformers and TRL on
2 ranks, more than a 3-step tiny run. So the runs go through ``scripts/run_several.py`` (each
script run as ``python SCRIPT ARGS`` would, one after the other in one process): every DDP
reference in one launch, and one ``hf-zero run`` launch per stage group. Runs of one launch share
a stage where it matters: ``hf-zero run`` decides low-memory loading (stage 3) from the launch;
stages 0-2 share one launch, stage 3 has its own.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from _run import REPO, hf_zero_run, logged_grad_norms, logged_losses, run, write_config, zero_config

trl = pytest.importorskip("trl", reason="TRL is a test dependency (pip install -e '.[test]')")
pytestmark = pytest.mark.slow

SCRIPTS = Path(trl.__file__).parent / "scripts"
RUN_SEVERAL = REPO / "integration_tests" / "scripts" / "run_several.py"
MODEL = REPO / "assets" / "tiny-qwen2"
STEPS = 3
WORDS = "the a cat dog sat ran on under mat tree blue red big small quickly slowly".split()


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl_data")
    g = torch.Generator().manual_seed(0)

    def phrase(n):
        return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g))

    return {
        "text": _jsonl(root / "text", [{"text": phrase(12)} for _ in range(32)]),
        "pref": _jsonl(root / "pref", [{"prompt": phrase(6), "chosen": phrase(5), "rejected": phrase(5)}
                                       for _ in range(32)]),
        "prompts": _jsonl(root / "prompts", [{"prompt": phrase(6)} for _ in range(32)]),
        "unpaired": _jsonl(root / "unpaired", [{"prompt": phrase(6), "completion": phrase(5), "label": i % 3 != 0}
                                               for i in range(32)]),
        "teacher": _teacher(root / "teacher", g),
        "reward_model": _reward_model(root / "reward_model"),
    }


def _reward_model(path: Path) -> Path:
    """The tiny model as a sequence classifier with one label, its new score head seeded: a reward
    model saved once, so that every run loads the same one."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(5)
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForSequenceClassification.from_pretrained(MODEL, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _teacher(path: Path, g: torch.Generator) -> Path:
    """The tiny model with perturbed weights: a teacher that differs from the student (the same
    weights give a zero distillation loss and gradient)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(MODEL)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(MODEL).save_pretrained(path)
    return path


COMMON = ["--model_name_or_path", str(MODEL), "--per_device_train_batch_size", "2", "--max_steps", str(STEPS),
          "--logging_steps", "1", "--report_to", "none", "--use_cpu", "--learning_rate", "1e-3", "--seed", "3",
          "--save_strategy", "steps", "--save_steps", str(STEPS),
          # TRL's configs default to bf16; fp32 here so that the weights compare to a few ulps.
          "--bf16", "False"]
REWARD_FUNC = ["--reward_funcs", "integration_tests.trl_rewards.distinct_words"]
FLOWS = {
    "sft": ("sft.py", "text", ["--max_length", "32"]),
    "sft_lora": ("sft.py", "text", ["--max_length", "32", "--use_peft", "--lora_r", "8", "--lora_alpha", "16",
                                     "--lora_target_modules", "q_proj", "v_proj"]),
    "dpo_sync": ("dpo.py", "pref", ["--sync_ref_model", "--ref_model_sync_steps", "2",
                                    "--ref_model_mixup_alpha", "0.5"]),
    "grpo": ("grpo.py", "prompts", [*REWARD_FUNC, "--beta", "0.1", "--num_generations", "2",
                                    "--max_completion_length", "8"]),
    # A reward model (a frozen sequence classifier) in place of a reward function; beta 0: no reference.
    "grpo_rm": ("grpo.py", "prompts", ["--reward_model_name_or_path", "@reward_model", "--num_generations", "2",
                                       "--max_completion_length", "8"]),
    # RLOO's beta defaults to 0.05: a reference model, as GRPO's with beta > 0.
    "rloo": ("rloo.py", "prompts", [*REWARD_FUNC, "--num_generations", "2", "--max_completion_length", "8"]),
    "kto": ("kto.py", "unpaired", ["--max_length", "32"]),
    "reward": ("reward.py", "pref", ["--max_length", "32"]),
    # On-policy distillation (completions generated by the student) from a frozen teacher model.
    "distill": ("distillation.py", "prompts", ["--teacher_model_name_or_path", "@teacher", "--max_completion_length", "8"]),
    # TRL's own default precision (its configs set bf16=True): DPO with its reference model, and SFT.
    "dpo_bf16": ("dpo.py", "pref", ["--bf16", "True"]),
    "sft_bf16": ("sft.py", "text", ["--max_length", "32", "--bf16", "True"]),
}
BF16 = {"dpo_bf16", "sft_bf16"}
# Flows whose trainer prepares a frozen second model (prepare_frozen_model): a reference model or
# teacher (the policy's size), or the reward model.
FROZEN = {"dpo_sync": "policy", "dpo_bf16": "policy", "grpo": "policy", "rloo": "policy", "kto": "policy", "distill": "policy",
          "grpo_rm": "reward_model"}
# One hf-zero launch per group. Passed once and not kept (CI time): SFT at stage 1; KTO, RLOO, the
# reward trainer, distillation, GRPO with a reward model and bf16 DPO at stage 1 (one more launch).
# Stages 0 and 1 share the stage-2 launch: below stage 3 a launch decides nothing by its stage (no
# low-memory loading), and each run's is_deepspeed_zero3_enabled() follows its own arguments.
LAUNCHES = {
    "s0_s1_s2": [("dpo_sync", 0), ("dpo_sync", 1), ("sft", 2), ("sft_lora", 2), ("dpo_sync", 2), ("grpo", 2),
                 ("sft_bf16", 2), ("kto", 2), ("rloo", 2), ("reward", 2), ("distill", 2), ("grpo_rm", 2)],
    "s3": [("sft", 3), ("sft_lora", 3), ("dpo_sync", 3), ("grpo", 3), ("rloo", 3), ("kto", 3), ("reward", 3),
           ("distill", 3), ("grpo_rm", 3), ("dpo_bf16", 3)],
}
CASES = [case for runs in LAUNCHES.values() for case in runs]


def _args(flow: str, data: dict, out: Path) -> list[str]:
    script, dataset, extra = FLOWS[flow]
    extra = [str(data[a[1:]]) if a.startswith("@") else a for a in extra]
    return [str(SCRIPTS / script), "--dataset_name", str(data[dataset]), "--output_dir", str(out), *COMMON, *extra]


def _several(runs: dict[str, list[str]]) -> list[str]:
    return [arg for name, args in runs.items() for arg in ("+++", name, *args)]


@pytest.fixture(scope="module")
def ddp(data, tmp_path_factory) -> Path:
    """Every flow once under plain torchrun DDP (2 CPU ranks), all in one launch: ``ddp/<flow>``."""
    root = tmp_path_factory.mktemp("ddp")
    runs = {flow: _args(flow, data, root / flow) for flow in FLOWS}
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(RUN_SEVERAL),
         str(root / "logs"), "--exit-now", *_several(runs)], timeout=500)
    return root


@pytest.fixture(scope="module")
def zero(data, tmp_path_factory):
    """The hf-zero launch holding a (flow, stage) run, made on first use: ``<launch>/<flow>-s<stage>``,
    its hf_zero log in ``<launch>/logs``."""
    done: dict[str, Path] = {}

    def get(flow: str, stage: int) -> Path:
        launch = next(name for name, runs in LAUNCHES.items() if (flow, stage) in runs)
        if launch not in done:
            root = tmp_path_factory.mktemp(launch)
            runs = {}
            for f, st in LAUNCHES[launch]:
                cfg = write_config(root / f"ds_zero{st}.json", zero_config(st))
                runs[f"{f}-s{st}"] = [*_args(f, data, root / f"{f}-s{st}"), "--deepspeed", str(cfg)]
            hf_zero_run(2, str(RUN_SEVERAL), str(root / "logs"), *_several(runs), timeout=500)
            done[launch] = root
        return done[launch]

    return get


def _weights(out: Path, lora: bool) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / ("adapter_model.safetensors" if lora else "model.safetensors"))


@pytest.mark.parametrize("flow,stage", CASES, ids=[f"{f}-s{s}" for f, s in CASES])
def test_trl_script_matches_ddp(flow, stage, data, ddp, zero):
    want_out, root = ddp / flow, zero(flow, stage)
    out = root / f"{flow}-s{stage}"
    got, want = logged_losses(out / f"checkpoint-{STEPS}"), logged_losses(want_out / f"checkpoint-{STEPS}")
    assert len(got) == len(want) == STEPS
    if flow in BF16:
        _assert_bf16_run_matches_ddp(flow, stage, out, want_out, got, want)
        return
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-3, atol=1e-6)
    # GRPO's and RLOO's first losses are ~0 (advantages centred): the gradient norms say more.
    got_norms, want_norms = (logged_grad_norms(o / f"checkpoint-{STEPS}") for o in (out, want_out))
    torch.testing.assert_close(torch.tensor(got_norms), torch.tensor(want_norms), rtol=2e-3, atol=1e-6)

    lora = flow == "sft_lora"
    got_w, want_w = _weights(out, lora), _weights(want_out, lora)
    assert got_w.keys() == want_w.keys()
    for name, value in want_w.items():
        assert got_w[name].dtype == value.dtype, name
        torch.testing.assert_close(got_w[name], value, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if lora:
        from peft import PeftModel

        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(MODEL), out)
    elif flow == "reward":
        AutoModelForSequenceClassification.from_pretrained(out)
    else:
        AutoModelForCausalLM.from_pretrained(out)

    if flow in FROZEN and stage >= 2:
        # The frozen model went through prepare_frozen_model: sharded (half each) at 2/3.
        frozen_model = want_out if FROZEN[flow] == "policy" else data[FROZEN[flow]]
        total = sum(t.numel() for t in _weights(frozen_model, False).values())
        log = (root / "logs" / f"{flow}-s{stage}.rank0.log").read_text()
        frozen = re.findall(r"frozen \w+ sharded over 2 ranks \(([\d,]+) parameter elements", log)
        assert frozen, "no frozen model was sharded"
        # Half each, as even as dim-0 shards allow: a one-row tensor (the reward model's 1 x 64 score
        # head) sits on rank 0 whole. A replicated model would show all its elements here.
        assert total // 2 <= int(frozen[0].replace(",", "")) < 0.51 * total



def _assert_bf16_run_matches_ddp(flow, stage, out, want_out, got, want):
    """TRL's default precision. DDP autocasts fp32 weights to bf16; hf_zero computes with bf16
    parameters and fp32 master weights, as DeepSpeed does, and saves the 16-bit weights, as
    DeepSpeed's 16-bit model save does (DDP saves fp32). Measured here: losses within 6e-4, gradient
    norms within 8e-4 (relative); the weights' distance to DDP's 0.5-0.7% of the distance training
    moved them (worst matrix 1.1%)."""
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-3, atol=1e-6)
    got_norms, want_norms = (logged_grad_norms(o / f"checkpoint-{STEPS}") for o in (out, want_out))
    torch.testing.assert_close(torch.tensor(got_norms), torch.tensor(want_norms), rtol=5e-3, atol=1e-6)
    got_w, want_w, init = _weights(out, False), _weights(want_out, False), _weights(MODEL, False)
    assert got_w.keys() == want_w.keys()
    # Adam turns bf16 noise in a near-zero gradient into a full-size update of either sign, so a few
    # elements differ by an update or two (0.3% of the embedding here). What must hold is that the
    # weights land where DDP's did, relative to how far training moved them at bf16 resolution: the
    # distance to DDP's weights (rounded to bf16) under 10% of the distance DDP's weights moved, per
    # matrix and over the model. Left out: the key biases, whose gradient is zero in exact arithmetic
    # (a key bias shifts all of a query's scores alike, which softmax cancels), so both runs step
    # them on rounding noise; and vectors (norms), whose 3 small updates mostly stay below bf16's
    # resolution at 1.0.
    far, distance, moved_total = {}, 0.0, 0.0
    for name, value in want_w.items():
        assert got_w[name].dtype == torch.bfloat16, name
        if name.endswith("k_proj.bias"):
            continue
        ref, start = value.to(torch.bfloat16).float(), init[name].to(torch.bfloat16).float()
        d, moved = float((got_w[name].float() - ref).abs().sum()), float((ref - start).abs().sum())
        distance, moved_total = distance + d, moved_total + moved
        if value.dim() >= 2 and d > 0.1 * moved:
            far[name] = round(d / max(moved, 1e-12), 3)
    assert not far, f"matrices away from DDP's (distance / distance moved): {far}"
    assert moved_total > 0 and distance < 0.1 * moved_total, (distance, moved_total)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)
