"""An unmodified Trainer script through ``hf-zero run`` on 2 ranks == plain Trainer on 1 process.

The script (examples/finetune_qwen/finetune.py) imports only transformers; ``hf-zero run`` swaps in
ZeroTrainer/ZeroTrainingArguments. Same seed, same global batch (1 x 4 vs 2 x 2), fp32: the logged
loss of every step and the saved weights (through ``from_pretrained``) must agree.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from _run import FINETUNE, hf_zero_run, logged_grad_norms, logged_losses, python_script, write_config, zero_config

pytestmark = pytest.mark.slow

COMMON = [
    "--max_steps", "4", "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no",
    "--learning_rate", "2e-3", "--seed", "7", "--warmup_steps", "1", "--lr_scheduler_type", "linear",
    "--max_grad_norm", "1.0", "--weight_decay", "0.01",
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("plain")
    python_script(FINETUNE, "--output_dir", str(out), "--per_device_train_batch_size", "4", "--use_cpu", "True", *COMMON)
    return out


# Stage 2 is launched with --deepspeed, the alias scripts written for DeepSpeed pass (the same run
# under --zero_config would add a launch and nothing else: the flag only names the config file).
@pytest.mark.parametrize("stage, flag", [(1, "--zero_config"), (2, "--deepspeed"), (3, "--zero_config")])
def test_hf_zero_run_matches_plain_trainer(stage, flag, reference, tmp_path):
    cfg = write_config(tmp_path / f"ds_zero{stage}.json", zero_config(stage))
    out = tmp_path / "out"
    hf_zero_run(2, FINETUNE, flag, str(cfg), "--output_dir", str(out), "--per_device_train_batch_size", "2", *COMMON)

    ref_losses, losses = logged_losses(reference), logged_losses(out)
    assert len(losses) == 4
    torch.testing.assert_close(losses, ref_losses, rtol=2e-4, atol=0)
    assert losses[-1] != losses[0]  # it trained
    # The logged grad_norm is the true global norm over all ranks' shards (a per-rank norm or a
    # sum instead of a mean over ranks would differ).
    torch.testing.assert_close(logged_grad_norms(out), logged_grad_norms(reference), rtol=2e-3, atol=0)

    ref_model = AutoModelForCausalLM.from_pretrained(reference)
    model = AutoModelForCausalLM.from_pretrained(out)
    ref_sd, sd = ref_model.state_dict(), model.state_dict()
    assert set(sd) == set(ref_sd)
    for name in ref_sd:
        torch.testing.assert_close(sd[name], ref_sd[name], rtol=1e-4, atol=2e-5, msg=name)
    assert (out / "tokenizer_config.json").exists()


def test_schedule_free_at_stage_1_switches_every_ranks_weights(tmp_path):
    """Schedule-free optimizers swap the weights between their two sequences in ``train()`` /
    ``eval()`` (at every evaluation here); at stage 1 each rank swaps only the parameters it owns,
    so hf_zero broadcasts them, as after a step. Without that, evaluation and the next steps would
    run on a mix of switched and unswitched weights."""
    pytest.importorskip("schedulefree")
    script = "integration_tests/scripts/schedule_free_eval.py"
    plain, out = tmp_path / "plain", tmp_path / "out"
    python_script(script, str(plain), "4")
    cfg = write_config(tmp_path / "ds_zero1.json", zero_config(1))
    hf_zero_run(2, script, str(out), "2", "--zero_config", str(cfg))
    torch.testing.assert_close(logged_losses(out), logged_losses(plain), rtol=2e-4, atol=0)
    eval_losses = [json.loads((d / "trainer_state.json").read_text())["log_history"] for d in (out, plain)]
    got, want = ([h["eval_loss"] for h in log if "eval_loss" in h] for log in eval_losses)
    assert len(got) == 3
    torch.testing.assert_close(got, want, rtol=2e-5, atol=0)  # unsynced weights: ~2e-4 off
