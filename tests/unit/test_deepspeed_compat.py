"""hf_zero's DeepSpeed API (hf_zero/deepspeed_api) in one process: the ``deepspeed`` namespace, its
errors, never shadowing a real DeepSpeed, ``is_deepspeed_zero3_enabled`` by caller,
``zero.GatheredParameters`` on FSDP2 shards, ``zero.Init``, ``deepspeed.comm`` and ``zero_to_fp32``.

The two-rank checks (modifier_rank reaching the other rank's shard, scripts saving through the
API) are in integration_tests/test_user_scripts.py.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import hf_zero
from hf_zero.deepspeed_api import disable_deepspeed_compat
from hf_zero.deepspeed_api.symbols import SYMBOLS, UNSUPPORTED

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "assets" / "tiny-qwen2"


@pytest.fixture
def api():
    """hf_zero's DeepSpeed API installed for one test, removed after it."""
    assert hf_zero.enable_deepspeed_compat() is True
    try:
        yield
    finally:
        disable_deepspeed_compat()


def _zero_args(tmp_path, stage: int):
    from hf_zero.integration.arguments import ZeroTrainingArguments

    return ZeroTrainingArguments(output_dir=str(tmp_path / f"s{stage}"), report_to="none",
                                 zero_config={"zero_optimization": {"stage": stage}})


# ------------------------------------------------------------------------------------- namespace
def test_every_symbol_of_the_table_imports_by_each_of_its_names(api):
    for symbol in SYMBOLS:
        impl_module, _, attr = symbol.target.partition(":")
        expected = getattr(importlib.import_module(impl_module), attr)
        for name in symbol.names:
            module_name, _, leaf = name.rpartition(".")
            assert getattr(importlib.import_module(module_name), leaf) is expected, name


def test_script_imports_resolve_to_hf_zero(api):
    import deepspeed
    from deepspeed import zero
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from hf_zero.deepspeed_api import zero as hf_zero_zero

    assert zero.GatheredParameters is hf_zero_zero.GatheredParameters
    assert ZeroParamStatus.NOT_AVAILABLE.value == 2 and ZeroParamStatus.AVAILABLE.value == 1  # DeepSpeed's values
    assert deepspeed.zero is zero and callable(get_fp32_state_dict_from_zero_checkpoint)
    assert "hf_zero" in repr(deepspeed)
    # transformers and accelerate still see no DeepSpeed installation (no package metadata).
    from accelerate.utils import is_deepspeed_available as accelerate_sees
    from transformers.integrations.deepspeed import is_deepspeed_available as transformers_sees

    assert not transformers_sees() and not accelerate_sees()


@pytest.mark.parametrize(
    "statement, names",
    [
        ("import deepspeed.ops.lamb", ["deepspeed.ops.lamb", "offload_optimizer"]),
        ("from deepspeed.ops.adam import FusedLamb", ["deepspeed.ops.adam.FusedLamb", "optimizer"]),
        ("from deepspeed.runtime.engine import DeepSpeedOptimizerCallable", ["DeepSpeedOptimizerCallable", "ZeroEngine"]),
        ("from deepspeed.accelerator import is_current_accelerator_supported",
         ["deepspeed.accelerator.is_current_accelerator_supported", "torch"]),
        ("from deepspeed.zero import TiledLinear", ["deepspeed.zero.TiledLinear", "docs/deepspeed_compat.md"]),
        ("import deepspeed.no_such_module", ["deepspeed.no_such_module", "deepspeed.zero"]),
    ],
)
def test_names_outside_the_api_fail_naming_the_name_and_the_alternative(api, statement, names):
    with pytest.raises(ImportError) as err:  # ImportError: `except ImportError` fallbacks keep working
        exec(statement, {})
    for name in names:
        assert name in str(err.value), (statement, str(err.value))


# Import lines as scripts and test suites written for DeepSpeed have them at module level (the
# survey of docs/deepspeed_compat.md), each with where it was read.
SURVEYED_IMPORT_LINES = {
    "transformers tests/deepspeed/test_deepspeed.py": "from deepspeed.utils import logger as deepspeed_logger",
    "transformers tests/deepspeed (zero_to_fp32)": "from deepspeed.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint",
    "Qwen finetune.py, FastChat train_lora.py, LLaVA": "from deepspeed import zero",
    "Qwen finetune.py (ZeroParamStatus)": "from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus",
    "DeepSpeed-Chat main.py (optimizers)": "from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam",
    "DeepSpeed-Chat main.py (accelerator)": "from deepspeed import get_accelerator",
    "DeepSpeed-Chat utils.py, DeepSpeed unit tests": "from deepspeed.accelerator import get_accelerator",
    "oobleck, DeepSpeed-based trainers": "from deepspeed import comm as dist",
    "DeepSpeed-based data pipelines": "import deepspeed.comm as dist",
    "DeepSpeed runtime-style modules": "from deepspeed.utils import logger, log_dist",
    "Seq2Seq fine-tuning scripts": "from deepspeed.runtime.utils import see_memory_usage",
    "accelerate tests/deepspeed/test_deepspeed.py": "from deepspeed.runtime.engine import DeepSpeedEngine",
    "Lightning DeepSpeed precision plugin": "from deepspeed import DeepSpeedEngine",
    "memory-estimate scripts (transformers docs)":
        "from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live",
    "memory-estimate scripts (ZeRO-2)":
        "from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_live",
    "activation-probe scripts": "from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad",
    "arctic-training sequence parallelism": "from deepspeed.utils import groups",
    "LLaMA-Factory model_utils/moe.py": "from deepspeed.utils import set_z3_leaf_modules",
    "LLaMA-Factory forks (torch.load safe globals)": (
        "from deepspeed.runtime.zero.config import ZeroStageEnum\n"
        "from deepspeed.runtime.fp16.loss_scaler import LossScaler\n"
        "from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer\n"
        "from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3"),
    "GPT-2 pipeline examples": "from deepspeed.pipe import PipelineModule, TiedLayerSpec",
    "argparse-based DeepSpeed scripts": "import deepspeed\nparser = deepspeed.add_config_arguments(__import__('argparse').ArgumentParser())",
}


@pytest.mark.parametrize("where", sorted(SURVEYED_IMPORT_LINES))
def test_module_level_import_lines_of_deepspeed_scripts_import(api, where):
    """``from deepspeed.utils import logger`` raised ImportError: a script (or a test suite) that
    imports a name at module level must start, even where hf_zero has nothing behind the name."""
    exec(SURVEYED_IMPORT_LINES[where], {"__name__": "surveyed_script"})


def _capture(logger_):
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger_.addHandler(handler)
    return records, handler


def test_deepspeed_logger_and_log_dist_behave_as_deepspeeds(api, one_rank_mesh):
    import logging

    from deepspeed.utils import log_dist, logger

    assert isinstance(logger, logging.Logger) and logger.name == "DeepSpeed" and not logger.propagate
    assert logger.getEffectiveLevel() == logging.INFO
    records, handler = _capture(logger)
    try:
        log_dist("to rank 0", ranks=[0])
        log_dist("to rank 1 only", ranks=[1])
        log_dist("to all", ranks=[-1])
        log_dist("no ranks given")  # DeepSpeed: after the group exists, nothing without ranks
        log_dist("warned", ranks=[0], level=logging.WARNING)
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["[Rank 0] to rank 0", "[Rank 0] to all", "[Rank 0] warned"]
    assert records[-1].levelno == logging.WARNING


def test_see_memory_usage_logs_only_when_forced(api):
    from deepspeed.runtime.utils import see_memory_usage
    from deepspeed.utils import logger

    records, handler = _capture(logger)
    try:
        see_memory_usage("quiet")
        see_memory_usage("after step", force=True)
    finally:
        logger.removeHandler(handler)
    messages = [r.getMessage() for r in records]
    assert "quiet" not in messages and messages[0] == "after step"


def test_get_accelerator_answers_for_the_device_torch_sees(api):
    from deepspeed import get_accelerator as top_level
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    assert top_level() is acc
    cuda = torch.cuda.is_available()
    assert acc.device_name() == ("cuda" if cuda else "cpu") and acc.device_name(0) == acc.device_name() + ":0"
    assert acc.communication_backend_name() == ("nccl" if cuda else "gloo")
    assert acc.device_count() == (torch.cuda.device_count() if cuda else 1)
    assert acc.is_available() is cuda and acc.on_accelerator(torch.zeros(1)) is (not cuda)
    assert torch.bfloat16 in acc.supported_dtypes() and acc.is_bf16_supported()
    acc.manual_seed_all(11)
    drawn = torch.rand(3, device=acc.device_name())
    torch.manual_seed(11)
    if cuda:
        torch.cuda.manual_seed_all(11)
    assert torch.equal(drawn, torch.rand(3, device=acc.device_name()))
    acc.synchronize()
    acc.empty_cache()
    if not cuda:  # the memory is the host's: DeepSpeed's accelerator figures are the device's
        assert acc.memory_allocated() == acc.max_memory_reserved() == 0
    with pytest.raises(AttributeError, match=r"get_accelerator\(\)\.create_graph.*torch"):
        acc.create_graph()


def _train(optimizer_factory, steps: int = 3):
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    optimizer = optimizer_factory(model.parameters())
    for step in range(steps):
        torch.manual_seed(100 + step)
        loss = model(torch.randn(4, 5)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("decoupled", [True, False])
def test_fused_adam_and_cpu_adam_step_as_torch_adam(api, decoupled):
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    kw = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    reference_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    reference = _train(lambda p: reference_cls(p, **kw))
    fused = _train(lambda p: FusedAdam(p, adam_w_mode=decoupled, **kw))
    cpu = _train(lambda p: DeepSpeedCPUAdam(p, adamw_mode=decoupled, **kw))
    # Same formula in fp32; torch's fused and foreach kernels may round one op differently
    # (1 ulp, 1.2e-7 relative), and 3 steps of lr 1e-2 keep that at a few ulps of the weights.
    for got in (fused, cpu):
        for a, b in zip(got, reference):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # The control: the other weight-decay mode moves the weights differently.
    other = _train(lambda p: FusedAdam(p, adam_w_mode=not decoupled, **kw))
    assert not torch.allclose(other[0], reference[0], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="bias_correction"):
        FusedAdam(nn.Linear(2, 2).parameters(), bias_correction=False)


def test_add_config_arguments_and_zero_stage_enum(api):
    import argparse

    import deepspeed
    from deepspeed.runtime.zero.config import ZeroStageEnum

    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed is True and args.deepspeed_config == "ds.json" and args.deepscale is False
    assert [(s.name, int(s)) for s in ZeroStageEnum][:4] == [
        ("disabled", 0), ("optimizer_states", 1), ("gradients", 2), ("weights", 3)]


@pytest.mark.parametrize("symbol", [s for s in SYMBOLS if s.stand_in], ids=lambda s: s.names[0])
def test_stand_ins_import_and_fail_naming_themselves_when_used(api, symbol):
    from hf_zero.deepspeed_api.stand_ins import DeepSpeedApiUnavailableError

    for name in symbol.names:
        module_name, _, leaf = name.rpartition(".")
        obj = getattr(importlib.import_module(module_name), leaf)
        assert not isinstance(object(), obj)  # isinstance checks simply say no
        with pytest.raises(DeepSpeedApiUnavailableError) as err:
            obj(nn.Linear(2, 2))
        assert symbol.names[0] in str(err.value) and symbol.maps_to in str(err.value)
        with pytest.raises(AttributeError, match=symbol.names[0].replace(".", r"\.")):
            obj.some_function  # noqa: B018  (a module-like name, deepspeed.utils.groups)

        class Subclass(obj):  # a script's subclass can be defined; building it fails the same way
            pass

        with pytest.raises(DeepSpeedApiUnavailableError):
            Subclass()


def test_stand_in_classes_serve_as_torch_load_safe_globals(api):
    """What LLaMA-Factory forks do with DeepSpeed's classes at import time."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    with torch.serialization.safe_globals([ZeroStageEnum, LossScaler]):
        names = {f"{c.__module__}.{c.__qualname__}" for c in torch.serialization.get_safe_globals()}
    assert "deepspeed.runtime.fp16.loss_scaler.LossScaler" in names


def test_private_probes_are_plain_attribute_errors(api):
    import deepspeed

    assert not hasattr(deepspeed, "__wrapped__")
    assert getattr(deepspeed.zero, "_no_such", None) is None


def test_unsupported_table_entries_are_not_provided(api):
    """The refusal table must not name something the namespace provides (the docs would contradict)."""
    provided = {name for symbol in SYMBOLS for name in symbol.names}
    assert not set(UNSUPPORTED) & provided


def test_transformers_deepspeed_module_alias(api):
    from transformers.deepspeed import is_deepspeed_zero3_enabled

    from hf_zero.deepspeed_api.zero3_answer import is_deepspeed_zero3_enabled as ours

    assert is_deepspeed_zero3_enabled is ours
    import transformers.integrations as integrations

    assert integrations.is_deepspeed_zero3_enabled is ours


def test_disable_removes_everything(api):
    import transformers.integrations.deepspeed as hf_deepspeed

    import deepspeed  # noqa: F401

    disable_deepspeed_compat()
    assert "deepspeed" not in sys.modules
    with pytest.raises(ModuleNotFoundError, match="No module named 'deepspeed'"):
        import deepspeed  # noqa: F401,F811
    assert hf_deepspeed.is_deepspeed_zero3_enabled.__module__ == "transformers.integrations.deepspeed"
    assert hf_zero.enable_deepspeed_compat() is True  # the fixture's teardown disables it again


# ------------------------------------------------------------------------------------- real DeepSpeed
_FAKE = textwrap.dedent(
    """
    import logging, sys
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    import hf_zero
    {before}
    installed = hf_zero.enable_deepspeed_compat()
    {after}
    import deepspeed
    import transformers.integrations.deepspeed as hf_deepspeed
    print("installed", installed, "fake", getattr(deepspeed, "I_AM_THE_REAL_ONE", False),
          "patched", hf_deepspeed.is_deepspeed_zero3_enabled.__module__.startswith("hf_zero"))
    """
)


def _run_with_fake_deepspeed(tmp_path: Path, before: str = "", after: str = "", on_path: bool = True):
    package = tmp_path / "site" / "deepspeed"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("I_AM_THE_REAL_ONE = True\n")
    script = tmp_path / "probe.py"
    script.write_text(_FAKE.format(before=before, after=after.replace("SITE", str(tmp_path / "site"))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO)] + ([str(tmp_path / "site")] if on_path else []))}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_a_real_deepspeed_is_never_shadowed(tmp_path):
    proc = _run_with_fake_deepspeed(tmp_path)
    assert "installed False fake True patched False" in proc.stdout
    log = proc.stderr
    assert "DeepSpeed is installed" in log and str(tmp_path / "site" / "deepspeed") in log


def test_a_deepspeed_that_appears_after_installing_still_wins(tmp_path):
    """The finder is the last on sys.meta_path: a real package found later is imported, not ours."""
    proc = _run_with_fake_deepspeed(tmp_path, after="sys.path.insert(0, 'SITE')", on_path=False)
    assert "installed True fake True" in proc.stdout


# ------------------------------------------------------------------------------------- is_deepspeed_zero3_enabled
def _ask_as(module_name: str) -> bool:
    """Call transformers' is_deepspeed_zero3_enabled from code whose module is ``module_name``."""
    code = "import transformers.integrations.deepspeed as d\nresult = d.is_deepspeed_zero3_enabled()\n"
    scope = {"__name__": module_name}
    exec(compile(code, f"<{module_name}>", "exec"), scope)
    return scope["result"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero3_answer_by_caller(api, tmp_path, stage):
    args = _zero_args(tmp_path, stage)  # noqa: F841  (kept alive: the answer follows the latest arguments)
    # A script gets DeepSpeed's answer for the stage it asked for: true at stage 3 only (at stage 2
    # Qwen's LoRA recipe refused to start: "ZeRO3 is incompatible with LoRA").
    assert _ask_as("__main__") is (stage == 3)
    assert _ask_as("my_project.train") is (stage == 3)
    # generate() keeps every rank stepping whenever hf_zero shards the parameters (stages 2 and 3).
    assert _ask_as("transformers.generation.utils") is (stage >= 2)
    assert _ask_as("transformers.modeling_utils") is False  # from_pretrained's zero.Init path stays off
    assert _ask_as("accelerate.accelerator") is False
    from peft.utils.integrations import check_deepspeed_zero3_enabled

    assert check_deepspeed_zero3_enabled() is False  # peft's adapters are made before sharding


def test_zero3_answer_without_any_zero_config_is_false(api, monkeypatch):
    import hf_zero.integration.arguments as arguments

    monkeypatch.setattr(arguments, "_LATEST_CONFIG", None)
    monkeypatch.setattr(sys, "argv", ["train.py", "--output_dir", "x"])
    assert _ask_as("__main__") is False


# ------------------------------------------------------------------------------------- GatheredParameters
def _sharded_linear(mesh, trainer_like: bool = True):
    from torch.distributed.fsdp import fully_shard

    from hf_zero.deepspeed_api.zero import tag_zero_params

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    reference = [p.detach().clone() for p in model.parameters()]
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)

    class _Engine:  # what tag_zero_params reads from a trainer
        module = model
        offload = None

        def params_resident(self, write_back=False):
            import contextlib

            return contextlib.nullcontext()

    class _Trainer:
        zero_engine = _Engine()

    tag_zero_params(_Trainer())
    return model, reference


def test_gathered_parameters_shows_whole_tensors_and_restores_the_shards(api, one_rank_mesh):
    from torch.distributed.tensor import DTensor

    from deepspeed import zero
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    model, reference = _sharded_linear(one_rank_mesh)
    weight = model[0].weight
    assert isinstance(weight, DTensor) and weight.ds_status == ZeroParamStatus.NOT_AVAILABLE
    assert weight.ds_shape == (6, 4) and weight.ds_numel == 24
    with zero.GatheredParameters([weight, model[0].bias, None]):
        assert not isinstance(weight, DTensor) and isinstance(weight, nn.Parameter)
        assert weight.ds_status == ZeroParamStatus.AVAILABLE
        copy = weight.data.detach().cpu().clone()
        assert type(copy) is torch.Tensor  # what Qwen/LLaVA-style scripts save
        weight.data.mul_(0)  # no modifier_rank: dropped on exit
    torch.testing.assert_close(copy, reference[0], rtol=0, atol=0)
    assert isinstance(weight, DTensor) and weight is model[0].weight
    assert weight.ds_status == ZeroParamStatus.NOT_AVAILABLE
    torch.testing.assert_close(weight.full_tensor(), reference[0], rtol=0, atol=0)


def test_gathered_parameters_modifier_rank_edits_reach_the_shard_and_training_goes_on(api, one_rank_mesh):
    from deepspeed import zero

    model, reference = _sharded_linear(one_rank_mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    weight = model[1].weight
    with zero.GatheredParameters(weight, modifier_rank=0):
        weight.data[0] = 5.0
    expected = reference[2].clone()
    expected[0] = 5.0
    torch.testing.assert_close(weight.full_tensor(), expected, rtol=0, atol=0)
    # The parameter object the optimizer holds is the one that was edited: a step moves it from there.
    x = torch.randn(2, 4)
    model(x).sum().backward()
    grad = weight.grad.full_tensor().clone()
    optimizer.step()
    torch.testing.assert_close(weight.full_tensor(), expected - 0.1 * grad, rtol=1e-6, atol=1e-6)


def test_gathered_parameters_leaves_unsharded_parameters_alone(api):
    from deepspeed import zero

    layer = nn.Linear(3, 3)
    weight = layer.weight
    with zero.GatheredParameters(layer.parameters(), modifier_rank=0):
        assert layer.weight is weight and type(weight) is nn.Parameter
        weight.data.fill_(1.0)  # a whole tensor is simply edited, as without DeepSpeed
    assert torch.equal(layer.weight, torch.ones(3, 3))


# ------------------------------------------------------------------------------------- Init, comm
def test_zero_init_builds_on_meta_on_non_zero_local_ranks_at_stage_3(api, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    import deepspeed
    from hf_zero.engine.materialize import has_meta_params

    args3 = _zero_args(tmp_path, 3)  # noqa: F841  (before the environment says 2 ranks: no group here)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with deepspeed.zero.Init():
        meta = AutoModelForCausalLM.from_pretrained(TINY)
    assert has_meta_params(meta)
    with deepspeed.zero.Init(config_dict_or_path={"zero_optimization": {"stage": 1}}):
        whole = AutoModelForCausalLM.from_pretrained(TINY)
    assert not has_meta_params(whole)
    with deepspeed.zero.Init(enabled=False):
        assert not has_meta_params(AutoModelForCausalLM.from_pretrained(TINY))


def test_comm_before_a_process_group(api, monkeypatch):
    import deepspeed.comm as dist

    if dist.is_initialized():
        pytest.skip("a process group exists in this test process")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert (dist.get_rank(), dist.get_world_size(), dist.get_local_rank()) == (0, 1, 3)
    assert dist.barrier() is None
    assert dist.ReduceOp.SUM == torch.distributed.ReduceOp.SUM


# ------------------------------------------------------------------------------------- zero_to_fp32
def test_zero_to_fp32_reads_an_hf_zero_trainer_checkpoint(api, tmp_path):
    from transformers import AutoModelForCausalLM

    from deepspeed.utils.zero_to_fp32 import (
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )
    from hf_zero.integration.arguments import ZeroTrainingArguments
    from hf_zero.integration.trainer import ZeroTrainer

    sys.path.insert(0, str(REPO / "integration_tests"))
    try:
        from _tiny import token_dataset
    finally:
        sys.path.remove(str(REPO / "integration_tests"))
    out = tmp_path / "run"
    args = ZeroTrainingArguments(output_dir=str(out), per_device_train_batch_size=4, max_steps=2, save_steps=2,
                                 save_strategy="steps", report_to="none", learning_rate=1e-2,
                                 zero_config={"zero_optimization": {"stage": 3}})
    trainer = ZeroTrainer(model=AutoModelForCausalLM.from_pretrained(TINY), args=args, train_dataset=token_dataset())
    trainer.train()
    # The reference: the trained weights read straight from the DTensor shards (torch's own gather).
    expected = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float()
                for k, v in trainer.model.state_dict().items()}
    state = get_fp32_state_dict_from_zero_checkpoint(out / "checkpoint-2")
    assert list(state) == list(expected)
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
    tied = [k for k in state if k.endswith("lm_head.weight")]
    assert tied and state[tied[0]] is state["model.embed_tokens.weight"]  # tied weights share one tensor
    assert get_fp32_state_dict_from_zero_checkpoint(out, tag="checkpoint-2").keys() == state.keys()
    fresh = load_state_dict_from_zero_checkpoint(AutoModelForCausalLM.from_pretrained(TINY), out / "checkpoint-2")
    torch.testing.assert_close(fresh.model.norm.weight, expected["model.norm.weight"], rtol=0, atol=0)
    with pytest.raises(ValueError, match="lazy_mode"):
        get_fp32_state_dict_from_zero_checkpoint(out / "checkpoint-2", lazy_mode=True)
    with pytest.raises(ValueError, match="frozen"):
        get_fp32_state_dict_from_zero_checkpoint(out / "checkpoint-2", exclude_frozen_parameters=True)


# ------------------------------------------------------------------------------------- docs
def test_docs_page_holds_the_generated_tables():
    from hf_zero.deepspeed_api.docs import DOCS_PAGE, update_page

    text = DOCS_PAGE.read_text(encoding="utf-8")
    assert update_page(text) == text, "run: python -m hf_zero.deepspeed_api.docs"
