"""The transformers-4 names the hf_zero classes accept (integration/versions.py), and what scripts
written for DeepSpeed read from the Trainer (integration/deepspeed_surface.py), in one process.

Each alias is checked against the field transformers 5 itself sets from the new name; plain
``transformers.TrainingArguments`` is the control that shows what the script would get without
hf_zero.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import HfArgumentParser

from hf_zero.integration.arguments import ZeroTrainingArguments
from hf_zero.integration.versions import REMOVED_NAMES, removed_from_installed

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "assets" / "tiny-qwen2"


def _parse(tmp_path, *flags: str, cls=ZeroTrainingArguments):
    (args,) = HfArgumentParser(cls).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--report_to", "none", *flags]
    )
    return args


def _plain(tmp_path, *flags: str):
    return _parse(tmp_path, *flags, cls=transformers.TrainingArguments)


_BY_NAME = {e.name: e for e in REMOVED_NAMES}
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5


def _needs_removed(name: str) -> None:
    """On a transformers older than the name's removal (4.x) the name is transformers' own and the
    new name may not exist yet: nothing of hf_zero's to check."""
    if not removed_from_installed(_BY_NAME[name]):
        pytest.skip(f"{name} is still transformers {transformers.__version__}'s own (removed in {_BY_NAME[name].removed_in})")


# Each alias: (old flags, new flags); both must give the same transformers 5 fields.
ALIASES = {
    "evaluation_strategy": (["--evaluation_strategy", "steps", "--eval_steps", "5"],
                            ["--eval_strategy", "steps", "--eval_steps", "5"], ["eval_strategy"]),
    "warmup_ratio": (["--warmup_ratio", "0.1"], ["--warmup_steps", "0.1"], ["warmup_steps"]),
    "group_by_length": (["--group_by_length"], ["--train_sampling_strategy", "group_by_length"],
                        ["train_sampling_strategy"]),
    "per_gpu_train_batch_size": (["--per_gpu_train_batch_size", "3"], ["--per_device_train_batch_size", "3"],
                                 ["per_device_train_batch_size", "train_batch_size"]),
    "per_gpu_eval_batch_size": (["--per_gpu_eval_batch_size", "5"], ["--per_device_eval_batch_size", "5"],
                                ["per_device_eval_batch_size", "eval_batch_size"]),
    "no_cuda": (["--no_cuda"], ["--use_cpu", "True"], ["use_cpu", "device"]),
    "adafactor": (["--adafactor"], ["--optim", "adafactor"], ["optim"]),
    "include_inputs_for_metrics": (["--include_inputs_for_metrics", "True"], ["--include_for_metrics", "inputs"],
                                   ["include_for_metrics"]),
    "include_tokens_per_second": (["--include_tokens_per_second", "True"], ["--include_num_input_tokens_seen", "True"],
                                  ["include_num_input_tokens_seen"]),
    "push_to_hub_model_id": (["--push_to_hub_model_id", "org/m"], ["--hub_model_id", "org/m"], ["hub_model_id"]),
    "push_to_hub_token": (["--push_to_hub_token", "tok"], ["--hub_token", "tok"], ["hub_token"]),
    "torchdynamo": (["--torchdynamo", "eager"], ["--torch_compile_backend", "eager"],
                    ["torch_compile_backend", "torch_compile"]),
}


@pytest.mark.parametrize("name", sorted(ALIASES))
def test_alias_gives_what_the_new_name_gives(tmp_path, name):
    _needs_removed(name)
    old, new, fields = ALIASES[name]
    got, want = _parse(tmp_path, *old), _plain(tmp_path, *new)
    default = _plain(tmp_path)
    for field_name in fields:
        assert getattr(got, field_name) == getattr(want, field_name), field_name
    assert any(getattr(want, f) != getattr(default, f) for f in fields), "the control must differ from the default"


@pytest.mark.parametrize("name, var", [("logging_dir", "TENSORBOARD_LOGGING_DIR"), ("ray_scope", "RAY_SCOPE")])
def test_environment_aliases(tmp_path, monkeypatch, name, var):
    _needs_removed(name)
    monkeypatch.delenv(var, raising=False)
    _parse(tmp_path, f"--{name}", "value1")
    import os

    assert os.environ[var] == "value1"
    with pytest.raises(ValueError, match=var):
        _parse(tmp_path, f"--{name}", "value2")


def test_plain_transformers_5_rejects_the_old_flags(tmp_path):
    """The control: without hf_zero these flags are errors (the table is about real removals)."""
    for entry in REMOVED_NAMES:
        if entry.kind == "argument" and removed_from_installed(entry):
            with pytest.raises(ValueError):
                _plain(tmp_path, f"--{entry.name}", "1")


@pytest.mark.parametrize("entry", [e for e in REMOVED_NAMES if e.handling == "error"], ids=lambda e: e.name)
def test_refused_arguments_name_the_release_and_the_replacement(tmp_path, entry):
    _needs_removed(entry.name)
    asking = {bool: "True", int: "7", str: "something"}[entry.type]
    if entry.type is bool and entry.default is True:
        asking = "False"
    with pytest.raises(ValueError) as err:
        _parse(tmp_path, f"--{entry.name}", asking)
    message = str(err.value)
    assert f"--{entry.name}" in message and entry.removed_in in message and entry.replacement in message
    for quiet in entry.no_effect:  # values that ask for nothing are accepted
        if quiet is not None:
            _parse(tmp_path, f"--{entry.name}", str(quiet))


def test_kept_argument_stays_readable(tmp_path):
    assert _parse(tmp_path, "--overwrite_output_dir").overwrite_output_dir is True
    assert _parse(tmp_path).overwrite_output_dir is False


def test_alias_and_its_replacement_disagreeing_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="evaluation_strategy"):
        _parse(tmp_path, "--evaluation_strategy", "steps", "--eval_strategy", "epoch")
    if removed_from_installed(_BY_NAME["warmup_ratio"]):
        with pytest.raises(ValueError, match="warmup"):
            _parse(tmp_path, "--warmup_ratio", "0.1", "--warmup_steps", "5")


def test_local_rank_is_set_as_transformers_4_did(tmp_path):
    if TRANSFORMERS_5:
        assert _plain(tmp_path).local_rank == -1  # transformers 5 leaves it: `if local_rank == 0` saves nothing
    args = _parse(tmp_path)
    assert args.local_rank == args.local_process_index == 0


def test_every_table_row_is_documented_with_its_release():
    from hf_zero.integration.versions import render_table

    table = render_table()
    for entry in REMOVED_NAMES:
        assert entry.name in table and entry.removed_in in table
        assert entry.handling in ("alias", "kept", "error")
        if entry.kind == "argument":
            assert entry.handling != "alias" or entry.apply is not None


# ------------------------------------------------------------------------------------- Trainer side
def _trainer(tmp_path, zero_stage: int | None = 3, **kwargs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_zero.integration.trainer import ZeroTrainer

    sys.path.insert(0, str(REPO / "integration_tests"))
    try:
        from _tiny import token_dataset
    finally:
        sys.path.remove(str(REPO / "integration_tests"))
    cfg = None if zero_stage is None else {"zero_optimization": {"stage": zero_stage}}
    args = ZeroTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2,
                                 report_to="none", save_strategy="no", learning_rate=1e-2, zero_config=cfg)
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    trainer = ZeroTrainer(model=AutoModelForCausalLM.from_pretrained(TINY), args=args,
                          train_dataset=token_dataset(), tokenizer=tokenizer, **kwargs)
    return trainer, tokenizer


def _read_as(module_name: str, trainer) -> bool:
    scope = {"__name__": module_name, "trainer": trainer}
    exec(compile("result = trainer.is_deepspeed_enabled", f"<{module_name}>", "exec"), scope)
    return scope["result"]


def test_trainer_tokenizer_keyword_and_attribute(tmp_path):
    trainer, tokenizer = _trainer(tmp_path, zero_stage=None)
    assert trainer.processing_class is tokenizer and trainer.tokenizer is tokenizer
    real_trainer = next(c for c in type(trainer).__mro__ if c.__module__ == "transformers.trainer")
    if TRANSFORMERS_5:
        with pytest.raises(TypeError, match="tokenizer"):  # the control: transformers 5's Trainer refuses it
            real_trainer(model=trainer.model, args=trainer.args, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="processing_class"):
        _trainer(tmp_path, zero_stage=None, processing_class=tokenizer)


def test_is_deepspeed_enabled_answers_scripts_not_libraries(tmp_path):
    trainer, _ = _trainer(tmp_path, zero_stage=1)
    assert _read_as("__main__", trainer) is True  # FastChat's save branch: trainer.save_model()
    assert _read_as("transformers.trainer", trainer) is False  # the Trainer's DeepSpeed branches stay off
    assert _read_as("trl.trainer.grpo_trainer", trainer) is False
    plain, _ = _trainer(tmp_path / "plain", zero_stage=None)
    assert _read_as("__main__", plain) is False


def test_consolidated_16bit_state_dict_on_the_wrapped_model(tmp_path):
    trainer, _ = _trainer(tmp_path, zero_stage=3)
    trainer.train()
    assert trainer.deepspeed is trainer.model_wrapped
    state = trainer.model_wrapped._zero3_consolidated_16bit_state_dict()
    # The reference: the shards as torch's own state-dict API returns them, gathered by torch.
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    shards = get_model_state_dict(trainer.model)
    assert any(isinstance(v, DTensor) for v in shards.values())  # a library caller still gets shards
    expected = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in shards.items()}
    assert list(state) == list(expected)
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    trainable = trainer.model_wrapped._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    assert set(trainable) == set(expected)  # nothing is frozen in a full fine-tune
    # A script's own model.state_dict() (Alpaca's save) gets whole tensors, as FSDP's full state dict.
    scripts_view = trainer.model.state_dict()
    assert not any(isinstance(v, DTensor) for v in scripts_view.values())
    for key, value in expected.items():
        torch.testing.assert_close(scripts_view[key], value, rtol=0, atol=0, msg=key)
    with pytest.raises(ValueError, match="_zero3_consolidated_16bit_state_dict"):
        trainer._save(str(tmp_path / "bad"), state_dict=shards)


def test_aliases_still_apply_when_transformers_names_hf_zeros_class(tmp_path, monkeypatch):
    """Under ``hf-zero run`` ``transformers.TrainingArguments`` *is* hf_zero's class, whose fields
    include the old names it adds back; those must not count as the installed release's own (that
    dropped ``--warmup_ratio`` silently: the script trained without warmup)."""
    _needs_removed("warmup_ratio")
    import transformers.training_args

    # As integration/patch.py swaps it (transformers 5 resolves the top-level name from the module).
    monkeypatch.setattr(transformers, "TrainingArguments", ZeroTrainingArguments)
    monkeypatch.setattr(transformers.training_args, "TrainingArguments", ZeroTrainingArguments)
    got = _parse(tmp_path, "--warmup_ratio", "0.34", "--evaluation_strategy", "steps", "--eval_steps", "5")
    assert got.warmup_steps == 0.34
    assert got.eval_strategy == "steps"
