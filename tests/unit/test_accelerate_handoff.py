"""The pieces of the Accelerator hand-off that run in one process: what ``use_hf_zero_accelerator``
reads from ``accelerate launch``'s environment (against the settings ``hf-zero run`` plans for the
same line), the FSDP wrap policies (against torch's own auto-wrap walk), and Trainer scripts under
an accelerate-form launch (their arguments get the launch's config).
"""

from __future__ import annotations

import functools
import json
import shlex

import pytest
from torch import nn

from hf_zero.config.sources.accelerate_yaml import SETTINGS_ENV, WrapSpec
from test_accelerate_config import SOURCE_003_YAML, _hf_zero


def _accelerate_env(argv, monkeypatch, tmp_path) -> dict[str, str]:
    """The variables accelerate's launcher exports to its ranks for ``accelerate launch ARGV``."""
    import accelerate.commands.launch as launch
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    monkeypatch.setattr(launch, "default_config_file", str(tmp_path / "none.yaml"))
    args, defaults, mp_from_config = launch._validate_launch_command(
        launch.launch_command_parser().parse_args([*argv, "train.py"]))
    if args.use_deepspeed:
        fields = list(defaults.deepspeed_config) if defaults else []
        args.deepspeed_fields_from_accelerate_config = ",".join(fields + (["mixed_precision"] if mp_from_config else []))
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_", "FSDP_"))}


@pytest.mark.parametrize("line", [
    "--use_deepspeed --zero_stage 3 --offload_param_device cpu --offload_optimizer_device cpu --mixed_precision bf16",
    "--use_deepspeed --zero_stage 1 --gradient_accumulation_steps 4 --gradient_clipping 0.5",
    "--use_fsdp --fsdp_sharding_strategy SHARD_GRAD_OP --fsdp_offload_params true --fsdp_auto_wrap_policy "
    "TRANSFORMER_BASED_WRAP --fsdp_transformer_layer_cls_to_wrap T5Block",
    "--use_fsdp --fsdp_version 2 --fsdp_reshard_after_forward false --fsdp_activation_checkpointing true "
    "--fsdp_auto_wrap_policy SIZE_BASED_WRAP --fsdp_min_num_params 500",
])
def test_accelerate_launch_environment_reads_as_hf_zero_run(line, monkeypatch, tmp_path):
    from hf_zero.accelerate_support.launch_env import settings_for

    argv = shlex.split(line)
    env = _accelerate_env(argv, monkeypatch, tmp_path)
    got = settings_for(None, env)
    want = _hf_zero(argv)
    for field in ("distributed_type", "zero_config", "mixed_precision", "wrap", "state_dict_type",
                  "activation_checkpointing", "low_memory_loading"):
        assert getattr(got, field) == getattr(want, field), field


def test_use_hf_zero_accelerator_takes_accelerate_switches_out(monkeypatch):
    from hf_zero.accelerate_support.launch_env import settings_for

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.delenv(SETTINGS_ENV, raising=False)
    settings = settings_for(None)
    assert settings.zero_config["zero_optimization"]["stage"] == 3
    import os

    assert "ACCELERATE_USE_DEEPSPEED" not in os.environ  # the Accelerator then needs no DeepSpeed


def test_deepspeed_dict_keeps_precision_for_the_accelerator(monkeypatch):
    from hf_zero.accelerate_support.launch_env import settings_for

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    settings = settings_for({"zero_optimization": {"stage": 2}})
    assert settings.zero_config["bf16"] == {"enabled": "auto"} and settings.zero_config["fp16"] == {"enabled": "auto"}
    assert settings.zero_config["gradient_accumulation_steps"] == 1  # accelerate's default for a config file


# ------------------------------------------------------------------------------------------- wrapping
class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)) for _ in range(3))
        self.head = nn.Linear(16, 50)


def _torch_size_units(model: nn.Module, min_num_params: int) -> list[nn.Module]:
    """The modules torch's FSDP auto-wrap walk wraps with ``size_based_auto_wrap_policy`` (root excluded)."""
    from torch.distributed.fsdp.wrap import _recursive_wrap, size_based_auto_wrap_policy

    wrapped: list[nn.Module] = []

    def record(module, **kwargs):
        wrapped.append(module)
        return module

    _recursive_wrap(model, functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params), record,
                    ignored_modules=set(), ignored_params=set(), only_wrap_children=True)
    return wrapped


@pytest.mark.parametrize("min_num_params", [100, 600, 1100, 2000, 10_000])
def test_size_based_wrap_is_torchs(min_num_params):
    from hf_zero.engine.wrap_policy import find_wrap_units, use_wrap_policy

    model = _Net()
    try:
        use_wrap_policy(WrapSpec("SIZE_BASED_WRAP", min_num_params=min_num_params))
        mine = find_wrap_units(model)
    finally:
        use_wrap_policy(None)
    assert [id(m) for m in mine] == [id(m) for m in _torch_size_units(model, min_num_params)]


def test_transformer_classes_and_no_wrap():
    from hf_zero.engine.wrap_policy import find_wrap_units, use_wrap_policy

    model = _Net()
    try:
        use_wrap_policy(WrapSpec("TRANSFORMER_BASED_WRAP", transformer_classes=("Sequential", "Embedding")))
        assert {type(m).__name__ for m in find_wrap_units(model)} == {"Sequential", "Embedding"}
        use_wrap_policy(WrapSpec("TRANSFORMER_BASED_WRAP", transformer_classes=("T5Block",)))
        with pytest.raises(ValueError, match="T5Block"):
            find_wrap_units(model)
        use_wrap_policy(WrapSpec("NO_WRAP"))
        assert find_wrap_units(model) == []
    finally:
        use_wrap_policy(None)
    assert len(find_wrap_units(model)) == 3  # the default again: the ModuleList's children


# ------------------------------------------------------------------------------------------- Trainer
def test_trainer_arguments_get_the_launch_config(files, monkeypatch, tmp_path):
    from hf_zero.integration.arguments import ZeroTrainingArguments

    yaml_text = SOURCE_003_YAML.replace("  fsdp_transformer_layer_cls_to_wrap: T5Block\n",
                                        "  fsdp_transformer_layer_cls_to_wrap: T5Block\n  fsdp_activation_checkpointing: true\n")
    plan_env = _plan_env(["--config_file", files("fsdp.yaml", yaml_text)])
    monkeypatch.setenv(SETTINGS_ENV, plan_env[SETTINGS_ENV])
    args = ZeroTrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[])
    cfg = args.parsed_zero_config
    assert cfg.stage == 3 and cfg.zero_optimization.offload_param.device == "cpu"
    assert args.gradient_checkpointing is True
    assert cfg.bf16.enabled == "auto"  # mixed_precision 'no' in the file: the script's --bf16 decides
    explicit = ZeroTrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[],
                                     zero_config={"zero_optimization": {"stage": 1}})
    assert explicit.parsed_zero_config.stage == 1  # the script's own config wins


def _plan_env(argv):
    from hf_zero.cli.launch import plan_launch_line

    return plan_launch_line([*argv, "train.py"], env={}).env


@pytest.fixture
def files(tmp_path):
    def write(name: str, text: str) -> str:
        path = tmp_path / name
        path.write_text(text)
        return str(path)

    return write


def test_settings_round_trip_through_the_environment():
    settings = _hf_zero(["--use_fsdp", "--fsdp_auto_wrap_policy", "SIZE_BASED_WRAP", "--fsdp_min_num_params", "7"])
    from hf_zero.config.sources.accelerate_yaml import AccelerateSettings

    assert AccelerateSettings.from_json(json.loads(json.dumps(settings.to_json()))) == settings
