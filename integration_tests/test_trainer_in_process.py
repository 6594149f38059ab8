"""ZeroTrainer in the test's own process, as in a notebook cell: no launcher, no environment.

Also the bad-input paths of the Trainer integration: each ends with a clear message and leaves no
output that looks complete.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_zero import ZeroTrainer, ZeroTrainingArguments
from hf_zero.config import ZeroConfigError

from _run import REPO
from _tiny import TINY, token_dataset




def _args(tmp_path, zero_config, **kw):
    base = dict(output_dir=str(tmp_path / "out"), zero_config=zero_config, per_device_train_batch_size=4,
                max_steps=4, logging_steps=1, report_to="none", save_strategy="no", learning_rate=5e-3, seed=3)
    base.update(kw)
    return ZeroTrainingArguments(**base)


def test_notebook_style_run_trains_saves_and_reloads(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    cfg = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}}
    trainer = ZeroTrainer(model=AutoModelForCausalLM.from_pretrained(TINY), args=_args(tmp_path, cfg), train_dataset=token_dataset())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4 and losses[-1] < losses[0]
    trainer.save_model()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    from hf_zero.checkpoint.export16 import gather_full_state_dict

    engine_sd = gather_full_state_dict(trainer.model)
    for name, tensor in reloaded.state_dict().items():
        torch.testing.assert_close(tensor, engine_sd[name].to(tensor.dtype), rtol=0, atol=0, msg=name)


def test_missing_config_file_names_the_path(tmp_path):
    with pytest.raises((ZeroConfigError, FileNotFoundError), match="no_such_ds_config.json"):
        _args(tmp_path, str(tmp_path / "no_such_ds_config.json"))


def test_config_contradicting_arguments_fails_at_construction(tmp_path):
    cfg = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.5}
    with pytest.raises(ZeroConfigError) as err:
        ZeroTrainer(model=AutoModelForCausalLM.from_pretrained(TINY), args=_args(tmp_path, cfg, max_grad_norm=1.0), train_dataset=token_dataset())
    message = str(err.value)
    assert "train_micro_batch_size_per_gpu" in message and "per_device_train_batch_size" in message
    assert "gradient_clipping" in message and "max_grad_norm" in message  # every mismatch, at once
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_resume_from_missing_checkpoint(tmp_path):
    trainer = ZeroTrainer(model=AutoModelForCausalLM.from_pretrained(TINY), args=_args(tmp_path, {"zero_optimization": {"stage": 2}}), train_dataset=token_dataset())
    missing = tmp_path / "checkpoint-7"
    with pytest.raises(FileNotFoundError, match="checkpoint-7"):
        trainer.train(resume_from_checkpoint=str(missing))


def test_resume_from_incomplete_checkpoint_is_refused(tmp_path):
    trainer = ZeroTrainer(
        model=AutoModelForCausalLM.from_pretrained(TINY),
        args=_args(tmp_path, {"zero_optimization": {"stage": 2}}, save_strategy="steps", save_steps=2),
        train_dataset=token_dataset(),
    )
    trainer.train()
    ckpt = tmp_path / "out" / "checkpoint-2"
    marker = ckpt / "zero_state" / "hf_zero_checkpoint.json"
    assert marker.exists() and (ckpt / "trainer_state.json").exists()
    os.remove(marker)  # as if the save had been interrupted before its last file
    again = ZeroTrainer(model=AutoModelForCausalLM.from_pretrained(TINY), args=_args(tmp_path, {"zero_optimization": {"stage": 2}}), train_dataset=token_dataset())
    with pytest.raises(Exception, match="hf_zero_checkpoint.json"):
        again.train(resume_from_checkpoint=str(ckpt))


def test_interrupted_checkpoint_never_looks_complete(tmp_path, monkeypatch):
    import hf_zero.checkpoint.sharded as sharded

    trainer = ZeroTrainer(
        model=AutoModelForCausalLM.from_pretrained(TINY),
        args=_args(tmp_path, {"zero_optimization": {"stage": 3}}, save_strategy="steps", save_steps=2),
        train_dataset=token_dataset(),
    )

    def broken_save(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sharded, "save_checkpoint", broken_save)
    with pytest.raises(OSError, match="No space left"):
        trainer.train()
    out = tmp_path / "out"
    assert not (out / "checkpoint-2").exists()
    from transformers.trainer_utils import get_last_checkpoint

    assert get_last_checkpoint(str(out)) is None  # the partial folder is not a checkpoint


def test_stage3_save_without_gather_points_to_consolidate(tmp_path, caplog):
    import logging

    cfg = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}}
    trainer = ZeroTrainer(model=AutoModelForCausalLM.from_pretrained(TINY), args=_args(tmp_path, cfg), train_dataset=token_dataset())
    trainer.train()
    out = tmp_path / "final"
    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        trainer.save_model(str(out))
    assert not (out / "model.safetensors").exists()  # no 16-bit gather
    assert (out / "zero_state" / "hf_zero_checkpoint.json").exists()
    assert any("hf-zero consolidate" in r.getMessage() for r in caplog.records)
    from hf_zero.checkpoint.consolidate import consolidate_checkpoint
    from hf_zero.checkpoint.export16 import gather_full_state_dict

    consolidate_checkpoint(out, tmp_path / "consolidated", progress=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "consolidated")
    engine_sd = gather_full_state_dict(trainer.model)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, engine_sd[name], rtol=0, atol=0, msg=name)


def test_source_000_launch_flags_parse(tmp_path):
    """The Qwen command of source 000 (transformers 4.x flags) parses into the transformers 5 fields."""
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(ZeroTrainingArguments).parse_args_into_dataclasses([
        "--output_dir", str(tmp_path), "--deepspeed", str(REPO / "examples/finetune_qwen/ds_zero3.json"),
        "--evaluation_strategy", "no", "--warmup_ratio", "0.03", "--lr_scheduler_type", "cosine",
        "--max_steps", "2000", "--learning_rate", "1e-6",
    ])
    assert args.eval_strategy == "no"
    # transformers 5 takes the ratio as a fractional warmup_steps; 4.x still has warmup_ratio itself
    assert args.warmup_steps == 0.03 or getattr(args, "warmup_ratio", None) == 0.03
    assert args.get_warmup_steps(2000) == 60
    assert args.parsed_zero_config.stage == 3 and args.deepspeed is None


@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("schedule", ["trainer", "config"])
def test_logged_learning_rate_is_the_one_each_update_used(tmp_path, stage, schedule):
    """The plain Trainer logs the rate an update used (read before lr_scheduler.step()); so must
    hf_zero, whose engine steps the scheduler inside the update. The rate used is read from the
    optimizer just before each update; with the Trainer's own schedule the log is also compared
    per step with a plain Trainer's."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class RecordUsed(TrainerCallback):
        def __init__(self):
            self.used = []

        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            self.used.append(optimizer.param_groups[0]["lr"])

    kw = dict(per_device_train_batch_size=4, max_steps=5, logging_steps=1, report_to="none", save_strategy="no",
              learning_rate=1e-3, warmup_steps=2, lr_scheduler_type="linear", seed=3)
    cfg = {"zero_optimization": {"stage": stage}}
    if schedule == "config":  # DeepSpeed's WarmupDecayLR, lengths from "auto"
        cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto",
                            "warmup_num_steps": "auto", "total_num_steps": "auto", "warmup_type": "linear"}}
    record = RecordUsed()
    zero = ZeroTrainer(model=AutoModelForCausalLM.from_pretrained(TINY), train_dataset=token_dataset(), callbacks=[record],
                       args=ZeroTrainingArguments(output_dir=str(tmp_path / "zero"), zero_config=cfg, **kw))
    zero.train()
    got = [h["learning_rate"] for h in zero.state.log_history if "loss" in h]
    assert len(record.used) == 5 and len(set(record.used)) > 2  # the schedule moved: the control
    assert got == pytest.approx(record.used, rel=1e-9, abs=1e-12)
    if schedule == "trainer":
        plain = Trainer(model=AutoModelForCausalLM.from_pretrained(TINY), train_dataset=token_dataset(),
                        args=TrainingArguments(output_dir=str(tmp_path / "plain"), **kw))
        plain.train()
        expected = [h["learning_rate"] for h in plain.state.log_history if "loss" in h]
        assert got == pytest.approx(expected, rel=1e-9, abs=1e-12)
