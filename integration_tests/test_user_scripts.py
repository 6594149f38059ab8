"""Scripts written for transformers 4 and DeepSpeed, unmodified, through ``hf-zero run`` on 2 ranks.

Three scripts in the shapes users bring (integration_tests/scripts/):

- ``qwen_style_lora.py``, following Qwen's ``finetune.py``: HfArgumentParser with transformers-4
  flags, ``local_rank == 0`` saves, ``from transformers import deepspeed``,
  ``is_deepspeed_zero3_enabled()`` deciding whether LoRA may run (not at ZeRO-3 on a base model)
  and the save path (``_zero3_consolidated_16bit_state_dict()`` at ZeRO-3, else
  ``get_peft_state_maybe_zero_3`` over ``ZeroParamStatus``/``ds_id`` and
  ``zero.GatheredParameters``), and one edit made on rank 0 inside
  ``zero.GatheredParameters(..., modifier_rank=0)`` that must reach rank 1's shard. Stage 2 runs it
  on a base model (Qwen's ZeRO-2 LoRA recipe), stage 3 on a "chat" model;
- ``fastchat_style_full.py``: ``Trainer(tokenizer=...)`` and the ``trainer.is_deepspeed_enabled``
  save branch (the other branch is FSDP1's, which raises on current torch);
- ``alpaca_style_full.py``: ``trainer.model.state_dict()`` on every rank, ``trainer._save`` on the
  saving rank; at stage 3 with ``offload_param`` cpu and nvme under strict collectives.

Each is compared with the same script run plainly (transformers 5, no hf_zero;
scripts/plain_transformers4.py gives it what transformers 4 with DeepSpeed installed gave such a
script), same seed and global batch: for the Qwen script the plain Trainer under torchrun (DDP,
2 x 2, both models in one launch), for the others one process (1 x 4); the losses of every step,
and the saved weights loaded back with ``PeftModel.from_pretrained`` / ``from_pretrained``.
Seven 2-rank launches and three references in all.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch
import transformers

from _run import REPO, hf_zero_run, logged_losses, python_script, run, write_config, zero_config

pytestmark = pytest.mark.slow

QWEN = "integration_tests/scripts/qwen_style_lora.py"
FASTCHAT = "integration_tests/scripts/fastchat_style_full.py"
ALPACA = "integration_tests/scripts/alpaca_style_full.py"
PLAIN = "integration_tests/scripts/plain_transformers4.py"
RUN_SEVERAL = "integration_tests/scripts/run_several.py"
TINY = REPO / "assets" / "tiny-qwen2"

COMMON = ["--max_steps", "3", "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no",
          "--seed", "7", "--lr_scheduler_type", "linear"]
# The same settings under their transformers 4 names (hf_zero run) and transformers 5 names (plain run).
V4_FLAGS = ["--evaluation_strategy", "no", "--warmup_ratio", "0.34"]
# The plain reference in the installed release's own names: transformers 5 takes the ratio as a
# fractional --warmup_steps and has no --warmup_ratio; 4.x (the version matrix) has only the ratio.
_HAS_RATIO = "warmup_ratio" in {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
V5_FLAGS = ["--eval_strategy", "no", *(["--warmup_ratio", "0.34"] if _HAS_RATIO else ["--warmup_steps", "0.34"])]
QWEN_ARGS = ["--learning_rate", "1e-2", "--post_train_scale_lora_b", "2.0"]
FASTCHAT_ARGS = ["--learning_rate", "1e-3"]


def _plain_run(tmp_path_factory, script: str, extra: list[str]):
    out = tmp_path_factory.mktemp("plain")
    proc = python_script(PLAIN, script, "--output_dir", str(out), "--per_device_train_batch_size", "4",
                         "--use_cpu", "True", *V5_FLAGS, *COMMON, *extra)
    return out, proc.stdout


def _hf_zero_run(tmp_path, stage: int, script: str, extra: list[str], config: dict | None = None):
    """``script`` through ``hf-zero run`` on 2 ranks; ``extra`` starts with the script's own path when
    ``script`` is a wrapper that runs it."""
    config = write_config(tmp_path / f"ds_config_zero{stage}.json", config or zero_config(stage))
    out = tmp_path / "out"
    prefix, extra = (extra[:1], extra[1:]) if script == STRICT else ([], extra)
    proc = hf_zero_run(2, script, *prefix, "--deepspeed", str(config), "--output_dir", str(out),
                       "--per_device_train_batch_size", "2", *V4_FLAGS, *COMMON, *extra)
    return out, proc.stdout


def _same_losses(out, reference):
    losses, expected = logged_losses(out), logged_losses(reference)
    assert len(losses) == 3 and losses[-1] != losses[0]
    torch.testing.assert_close(losses, expected, rtol=2e-3, atol=0)


@pytest.fixture(scope="module")
def qwen_references(tmp_path_factory):
    """DDP references (the plain Trainer under torchrun, 2 ranks x 2 sequences, transformers-4 surface
    from plain_transformers4.py) of the Qwen-style script on a base model and on a chat model, in one
    launch: {"base"|"chat": (output dir, the launch's stdout)}."""
    root = tmp_path_factory.mktemp("qwen_ddp")
    chat = root / "tiny-qwen2-chat"  # Qwen's is_chat_model: "chat" in the model path
    chat.symlink_to(TINY, target_is_directory=True)
    runs = []
    for name, model in (("base", TINY), ("chat", chat)):
        runs += ["+++", name, PLAIN, QWEN, "--model_name_or_path", str(model), "--output_dir", str(root / name),
                 "--per_device_train_batch_size", "2", "--use_cpu", "True", *V5_FLAGS, *COMMON, *QWEN_ARGS]
    proc = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                str(RUN_SEVERAL), str(root / "logs"), "--exit-now", *runs])
    return {"base": (root / "base", proc.stdout), "chat": (root / "chat", proc.stdout)}


@pytest.fixture(scope="module")
def fastchat_reference(tmp_path_factory):
    return _plain_run(tmp_path_factory, FASTCHAT, FASTCHAT_ARGS)


@pytest.mark.parametrize("stage", [2, 3])
def test_qwen_style_lora_script(stage, qwen_references, tmp_path):
    """Qwen's LoRA recipe at ZeRO-2 (finetune_lora_ds.sh, base model) and at ZeRO-3 (a chat model,
    which Qwen's check lets through): the script gets DeepSpeed's is_deepspeed_zero3_enabled()
    (false at stage 2: it refused to start with "ZeRO3 is incompatible with LoRA" when hf_zero
    answered true), trains as DDP does, and saves whole tensors on either branch."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    kind = "base" if stage == 2 else "chat"
    reference, reference_log = qwen_references[kind]
    model = TINY if kind == "base" else reference.parent / "tiny-qwen2-chat"
    out, log = _hf_zero_run(tmp_path, stage, QWEN, [*QWEN_ARGS, "--model_name_or_path", str(model)])
    # DeepSpeed's answer for the stage asked for; the DDP reference gets false.
    assert f"zero3: {stage == 3}" in log and "zero3: False" in reference_log and "zero3: True" not in reference_log
    _same_losses(out, reference)

    # 1. The adapter the script saved with trainer._save(dir, state_dict) on local_rank 0: at stage 2
    # the LoRA state read parameter by parameter (maybe_zero_3), at stage 3 the consolidated state.
    def adapter(path):
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(TINY), path)
        return {k: v.detach() for k, v in model.named_parameters() if "lora_" in k}

    got, expected = adapter(out), adapter(reference)
    assert got.keys() == expected.keys() and len(got) == 8
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-6, msg=key)
    # 2. The LoRA weights it collected through get_peft_state_maybe_zero_3.
    collected = torch.load(out / "lora_weights.bin", weights_only=True)
    expected_collected = torch.load(reference / "lora_weights.bin", weights_only=True)
    assert collected.keys() == expected_collected.keys()
    for key in expected_collected:
        assert collected[key].shape == expected_collected[key].shape, key  # whole tensors, not shards
        torch.testing.assert_close(collected[key], expected_collected[key], rtol=1e-4, atol=1e-6, msg=key)
    # 3. The edit rank 0 made under GatheredParameters(modifier_rank=0) reached both ranks' shards:
    # both halves of the scaled LoRA B (rank 0's rows and rank 1's) equal the reference's.
    scaled = next(k for k in collected if "lora_B" in k)
    assert f"scaled {scaled} by 2.0" in log and f"scaled {scaled} by 2.0" in reference_log
    half = collected[scaled].shape[0] // 2
    for rows in (slice(0, half), slice(half, None)):
        torch.testing.assert_close(collected[scaled][rows], expected_collected[scaled][rows], rtol=1e-4, atol=1e-6)
    assert expected_collected[scaled].abs().sum() > 0


@pytest.mark.parametrize("stage", [2, 3])
def test_fastchat_style_full_finetune_script(stage, fastchat_reference, tmp_path):
    from transformers import AutoModelForCausalLM

    reference, reference_log = fastchat_reference
    out, log = _hf_zero_run(tmp_path, stage, FASTCHAT, FASTCHAT_ARGS)
    assert "saved by save_model" in log  # trainer.is_deepspeed_enabled led the script to save_model()
    assert "saved by the FSDP branch" in reference_log
    _same_losses(out, reference)
    model = AutoModelForCausalLM.from_pretrained(out)
    expected = AutoModelForCausalLM.from_pretrained(reference)
    got_sd, expected_sd = model.state_dict(), expected.state_dict()
    assert got_sd.keys() == expected_sd.keys()
    for key in expected_sd:
        torch.testing.assert_close(got_sd[key], expected_sd[key], rtol=1e-4, atol=2e-5, msg=key)
    assert (out / "tokenizer_config.json").exists()  # Trainer(tokenizer=...) became processing_class


@pytest.fixture(scope="module")
def alpaca_reference(tmp_path_factory):
    return _plain_run(tmp_path_factory, ALPACA, FASTCHAT_ARGS)


STRICT = "integration_tests/scripts/strict_collectives_run.py"


@pytest.mark.parametrize("stage, offload_param", [(2, None), (3, "cpu"), (3, "nvme")])
def test_alpaca_style_state_dict_save(stage, offload_param, alpaca_reference, tmp_path):
    """``trainer.model.state_dict()`` on every rank + ``trainer._save(dir, state_dict=...)`` on the
    saving rank writes the whole model, as the Trainer's FSDP full state dict did.

    With ``offload_param`` (review N1) the gathers take host shards: on a GPU NCCL refused them
    ("No backend type associated with device type cpu"), and NVMe-swapped shards, empty while
    swapped out, crashed every rank (SIGSEGV, on CPU too). These runs go through strict collectives
    (tests/strict_collectives.py), which fail on CPU where NCCL would on a GPU."""
    from transformers import AutoModelForCausalLM

    reference, _ = alpaca_reference
    if offload_param is None:
        out, _ = _hf_zero_run(tmp_path, stage, ALPACA, FASTCHAT_ARGS)
    else:
        section = {"device": offload_param, "pin_memory": False}
        if offload_param == "nvme":
            # A small max_in_cpu: shards are swapped out between uses, as when state_dict() is called.
            (tmp_path / "nvme").mkdir()
            section.update(nvme_path=str(tmp_path / "nvme"), max_in_cpu=1000)
        config = zero_config(stage)
        config["zero_optimization"]["offload_param"] = section
        if offload_param == "nvme":  # hf_zero keeps the fp32 masters off swapped parameters
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        out, log = _hf_zero_run(tmp_path, stage, STRICT, [ALPACA, *FASTCHAT_ARGS], config=config)
        counters = [json.loads(line.split("strict stats ", 1)[1]) for line in log.splitlines() if "strict stats " in line]
        assert counters and all(c["tagged"] > 0 and c["moved"] > 0 for c in counters), counters  # not vacuous
    _same_losses(out, reference)
    got_sd = AutoModelForCausalLM.from_pretrained(out).state_dict()
    expected_sd = AutoModelForCausalLM.from_pretrained(reference).state_dict()
    assert got_sd.keys() == expected_sd.keys()
    for key in expected_sd:
        assert got_sd[key].shape == expected_sd[key].shape, key  # whole tensors, not one rank's slice
        torch.testing.assert_close(got_sd[key], expected_sd[key], rtol=1e-4, atol=2e-5, msg=key)
