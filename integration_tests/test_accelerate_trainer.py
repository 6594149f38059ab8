"""A Trainer script launched with an accelerate config file: ``hf-zero run --config_file acc.yaml
finetune.py ...`` (no ``--zero_config``) trains with the config the file describes and logs the
losses of the plain Trainer on one process (same seed, same global batch: 1 x 4 vs 2 x 2, fp32).

Two accelerate files, as TRL/axolotl and PEFT's FSDP guide write them: DEEPSPEED with a
``deepspeed_config_file`` full of "auto" (examples/finetune_qwen/ds_zero3.json), and FSDP with CPU
offload, TRANSFORMER_BASED_WRAP and activation checkpointing.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from _run import FINETUNE, REPO, logged_losses, python_script, run

pytestmark = pytest.mark.slow

COMMON = [
    "--max_steps", "4", "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no",
    "--learning_rate", "2e-3", "--seed", "7", "--warmup_steps", "1", "--lr_scheduler_type", "linear",
    "--max_grad_norm", "1.0", "--weight_decay", "0.0",
]
YAMLS = {
    "deepspeed_file": f"""\
        compute_environment: LOCAL_MACHINE
        deepspeed_config:
          deepspeed_config_file: {REPO / "examples" / "finetune_qwen" / "ds_zero3.json"}
          zero3_init_flag: true
        distributed_type: DEEPSPEED
        num_machines: 1
        num_processes: 2
        """,
    "fsdp_offload": """\
        compute_environment: LOCAL_MACHINE
        distributed_type: FSDP
        fsdp_config:
          fsdp_version: 2
          fsdp_offload_params: true
          fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
          fsdp_transformer_layer_cls_to_wrap: Qwen2DecoderLayer
          fsdp_state_dict_type: FULL_STATE_DICT
          fsdp_activation_checkpointing: true
        mixed_precision: 'no'
        num_machines: 1
        num_processes: 2
        """,
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("plain")
    python_script(FINETUNE, "--output_dir", str(out), "--per_device_train_batch_size", "4", "--use_cpu", "True", *COMMON)
    return out


@pytest.mark.parametrize("name", sorted(YAMLS))
def test_trainer_script_with_accelerate_config(name, reference, tmp_path):
    import sys

    config = tmp_path / f"{name}.yaml"
    config.write_text(textwrap.dedent(YAMLS[name]))
    out = tmp_path / "out"
    proc = run([sys.executable, "-m", "hf_zero.cli.main", "run", "--config_file", str(config), FINETUNE,
                "--output_dir", str(out), "--per_device_train_batch_size", "2", *COMMON])
    log = proc.stdout + proc.stderr
    assert "ZeRO stage 3" in log and "world size 2" in log
    if name == "fsdp_offload":
        assert "offload optimizer=cpu params=cpu" in log
    losses = logged_losses(out)
    assert len(losses) == 4 and losses[-1] != losses[0]
    torch.testing.assert_close(losses, logged_losses(reference), rtol=2e-3, atol=0)
