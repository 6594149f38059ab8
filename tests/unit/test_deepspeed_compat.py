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
        ("import deepspeed.ops.adam", ["deepspeed.ops.adam", "offload_optimizer"]),
        ("from deepspeed.ops.adam import FusedAdam", ["deepspeed.ops.adam", "optimizer"]),
        ("from deepspeed import initialize", ["deepspeed.initialize", "hf_zero.initialize"]),
        ("import deepspeed; deepspeed.DeepSpeedEngine", ["deepspeed.DeepSpeedEngine", "ZeroEngine"]),
        ("from deepspeed.accelerator import get_accelerator", ["deepspeed.accelerator", "torch"]),
        ("from deepspeed.zero import TiledLinear", ["deepspeed.zero.TiledLinear", "docs/deepspeed_compat.md"]),
        ("import deepspeed.no_such_module", ["deepspeed.no_such_module", "deepspeed.zero"]),
    ],
)
def test_names_outside_the_api_fail_naming_the_name_and_the_alternative(api, statement, names):
    with pytest.raises(ImportError) as err:  # ImportError: `except ImportError` fallbacks keep working
        exec(statement, {})
    for name in names:
        assert name in str(err.value), (statement, str(err.value))


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


@pytest.mark.parametrize("stage, sharded", [(1, False), (2, True), (3, True)])
def test_zero3_answer_by_caller(api, tmp_path, stage, sharded):
    args = _zero_args(tmp_path, stage)  # noqa: F841  (kept alive: the answer follows the latest arguments)
    assert _ask_as("__main__") is sharded
    assert _ask_as("my_project.train") is sharded
    assert _ask_as("transformers.generation.utils") is sharded  # generate(): synced_gpus
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
