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


# ------------------------------------------------------------------------------ positional arguments
def _transformers_own(cls: type) -> type:
    """The first class transformers itself defined in ``cls``'s MRO (under ``hf-zero run``
    ``transformers.TrainingArguments`` is hf_zero's subclass)."""
    return next(c for c in cls.__mro__ if c.__module__.startswith("transformers."))


def _positional_values(plain: type, tmp_path) -> list:
    """One value for every ``__init__`` field of ``plain``, in its order: its default, except a few
    fields spread over the list that get values of their own, so that an argument bound one place
    off shows up as a wrong value (or a validation error) on one side only."""
    import dataclasses

    own = {
        "output_dir": str(tmp_path / "out"),  # the course's TrainingArguments("out")
        "per_device_train_batch_size": 3,
        "num_train_epochs": 2.0,
        "max_steps": 11,
        "learning_rate": 3e-4,
        "logging_steps": 7,
        "logging_dir": str(tmp_path / "logs"),  # 4.x derives the default from the clock
        "seed": 123,
        "report_to": "none",
        "save_strategy": "no",
        "remove_unused_columns": False,
    }
    values = []
    for f in dataclasses.fields(plain):
        if not f.init:
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        values.append(own.get(f.name, default))
    assert sum(1 for f in dataclasses.fields(plain) if f.init and f.name in own) >= 8, "spread values missing"
    return values


def _assert_binds_like(cls: type, plain: type, tmp_path) -> None:
    import dataclasses
    import inspect

    plain_fields = [f.name for f in dataclasses.fields(plain)]
    ours = dataclasses.fields(cls)
    # transformers' fields first, in its order; whatever hf_zero adds after them and keyword-only.
    assert [f.name for f in ours[: len(plain_fields)]] == plain_fields
    assert all(f.kw_only for f in ours[len(plain_fields):]), [f.name for f in ours[len(plain_fields):]]

    def positional(c):
        return [p.name for p in inspect.signature(c.__init__).parameters.values()
                if p.kind is p.POSITIONAL_OR_KEYWORD][1:]

    assert positional(cls) == positional(plain)
    values = _positional_values(plain, tmp_path)
    got, want = cls(*values), plain(*values)
    for name in plain_fields:
        if name == "local_rank":
            continue  # hf_zero sets it as transformers 4 did (test_local_rank_is_set_as_transformers_4_did)
        assert getattr(got, name) == getattr(want, name), name
    assert got.output_dir == str(tmp_path / "out") and got.seed == 123
    # One argument too many is refused by both, not bound to an hf_zero field.
    for c in (cls, plain):
        with pytest.raises(TypeError):
            c(*values, "one too many")


@pytest.mark.parametrize("name", ["ZeroTrainingArguments", "ZeroSeq2SeqTrainingArguments"])
def test_positional_arguments_bind_as_in_transformers(tmp_path, name):
    """``ZeroTrainingArguments("out")`` bound "out" to the transformers-4 ``evaluation_strategy``
    field ("out is not a valid IntervalStrategy"): every positional argument must land where the
    installed transformers puts it."""
    import hf_zero.integration.arguments as arguments

    cls = getattr(arguments, name)
    _assert_binds_like(cls, _transformers_own(cls), tmp_path)
    assert cls(str(tmp_path / "o")).output_dir == str(tmp_path / "o")


def test_positional_arguments_of_the_swapped_classes_and_script_subclasses(tmp_path, monkeypatch):
    """Under ``hf-zero run``: the course's ``TrainingArguments("out", ...)`` and a Qwen/Alpaca-style
    ``@dataclass class TrainingArguments(transformers.TrainingArguments)`` with fields of its own
    bind as with plain transformers."""
    import dataclasses
    from typing import Optional

    import transformers.training_args
    import transformers.training_args_seq2seq

    import hf_zero.integration.arguments as arguments

    real = {"TrainingArguments": transformers.TrainingArguments,
            "Seq2SeqTrainingArguments": transformers.Seq2SeqTrainingArguments}
    # As integration/patch.py swaps them (transformers 5 resolves top-level names from the modules).
    for name, module in (("TrainingArguments", transformers.training_args),
                         ("Seq2SeqTrainingArguments", transformers.training_args_seq2seq)):
        ours = getattr(arguments, "Zero" + name)
        monkeypatch.setattr(transformers, name, ours)
        monkeypatch.setattr(module, name, ours)
        swapped = getattr(transformers, name)
        assert swapped is ours
        _assert_binds_like(swapped, real[name], tmp_path / name)

    def script_class(base):
        @dataclasses.dataclass
        class TrainingArguments(base):  # Qwen's finetune.py
            cache_dir: Optional[str] = dataclasses.field(default=None)
            optim: str = dataclasses.field(default="adamw_torch")
            model_max_length: int = dataclasses.field(default=512)
        return TrainingArguments

    swapped_sub, plain_sub = script_class(transformers.TrainingArguments), script_class(real["TrainingArguments"])
    values = _positional_values(plain_sub, tmp_path)
    values[-1] = 64  # the script's own model_max_length, last in both
    got, want = swapped_sub(*values), plain_sub(*values)
    assert isinstance(got, arguments.ZeroTrainingArguments)
    assert got.model_max_length == want.model_max_length == 64
    assert (got.output_dir, got.seed, got.cache_dir) == (want.output_dir, want.seed, want.cache_dir)
