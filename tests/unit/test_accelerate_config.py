"""accelerate launch options and config files under ``hf-zero run``, against accelerate itself.

The reference for every case is what accelerate makes of the same line: its launch parser, its
``_validate_launch_command`` (config file merged with the line), the environment its launcher
gives the ranks (``prepare_deepspeed_cmd_env`` / ``prepare_multi_gpu_env``), and the
``DeepSpeedPlugin`` / ``FullyShardedDataParallelPlugin`` a rank builds from that environment.
hf_zero's side is the settings ``hf-zero run`` plans for its ranks (the same line, parsed by
hf_zero.cli.launch).
"""

from __future__ import annotations

import json
import os
import shlex
import textwrap
from pathlib import Path

import pytest

from hf_zero.cli.launch import LaunchLineError, plan_launch_line
from hf_zero.config.sources.accelerate_yaml import SETTINGS_ENV, AccelerateSettings, settings_from_accelerate_file

SOURCE_003_YAML = """\
command_file: null
commands: null
compute_environment: LOCAL_MACHINE
deepspeed_config: {}
distributed_type: FSDP
downcast_bf16: 'no'
dynamo_backend: 'NO'
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch_policy: BACKWARD_PRE
  fsdp_offload_params: true
  fsdp_sharding_strategy: 1
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: T5Block
gpu_ids: null
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
megatron_lm_config: {}
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_name: null
tpu_zone: null
use_cpu: false
"""

DS_INLINE_YAML = """\
compute_environment: LOCAL_MACHINE
deepspeed_config:
  gradient_accumulation_steps: 4
  gradient_clipping: 1.0
  offload_optimizer_device: cpu
  offload_param_device: cpu
  zero3_init_flag: true
  zero3_save_16bit_model: true
  zero_stage: 3
distributed_type: DEEPSPEED
mixed_precision: bf16
num_machines: 1
num_processes: 2
"""

DS_FILE_YAML = """\
compute_environment: LOCAL_MACHINE
deepspeed_config:
  deepspeed_config_file: {ds}
  zero3_init_flag: false
distributed_type: DEEPSPEED
num_machines: 1
num_processes: 2
"""

# A TRL/axolotl-style zero3 file full of "auto" (the values accelerate's plugin fills).
DS_AUTO_JSON = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": "auto",
        "offload_optimizer": {"device": "auto"},
        "offload_param": {"device": "none"},
        "overlap_comm": True,
        "stage3_gather_16bit_weights_on_model_save": "auto",
    },
}


# ------------------------------------------------------------------------------------- references
def _accelerate(argv: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """The plugin accelerate's launcher + a rank would build for ``accelerate launch ARGV train.py``
    (plugin, the ranks' ACCELERATE_MIXED_PRECISION)."""
    import accelerate.commands.launch as launch
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    monkeypatch.setattr(launch, "default_config_file", str(tmp_path / "no_default.yaml"))
    args = launch.launch_command_parser().parse_args([*argv, "train.py"])
    args, defaults, mp_from_config = launch._validate_launch_command(args)
    if args.use_deepspeed:
        fields = list(defaults.deepspeed_config.keys()) if defaults else []
        if mp_from_config:
            fields.append("mixed_precision")
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        env = prepare_multi_gpu_env(args)
    for key in list(os.environ):
        if key.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.delenv(key)
    for key, value in env.items():
        if key.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.setenv(key, value)
    if args.use_deepspeed:
        plugin = DeepSpeedPlugin()
        plugin.set_mixed_precision(env["ACCELERATE_MIXED_PRECISION"])
    else:
        # sync_module_states makes the plugin ask for the current GPU (its param_init_fn, unused
        # here); on this CPU machine it gets device 0 so the rest of the plugin is built as on a GPU.
        import accelerate.utils.dataclasses as plugin_module
        import torch

        monkeypatch.setattr(plugin_module, "is_cuda_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        plugin = FullyShardedDataParallelPlugin()
    return plugin, env["ACCELERATE_MIXED_PRECISION"]


def _hf_zero(argv: list[str]) -> AccelerateSettings:
    plan = plan_launch_line([*argv, "train.py"], env={})
    return AccelerateSettings.from_json(json.loads(plan.env[SETTINGS_ENV]))


def _without_none(tree):
    if isinstance(tree, dict):
        return {k: _without_none(v) for k, v in tree.items() if v is not None}
    return tree


def _expected_deepspeed(plugin) -> dict:
    config = json.loads(json.dumps(plugin.deepspeed_config, default=str))
    config.pop("steps_per_print")  # accelerate's own `inf` to silence DeepSpeed's logger
    return _without_none(config)


def _fsdp_view(plugin, mixed: str) -> dict:
    """What accelerate's FSDP plugin asks for, in hf_zero's terms (the mapping under test)."""
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    if plugin.fsdp_version == 1:
        strategy = (plugin.sharding_strategy or plugin.reshard_after_forward).name
    else:
        strategy = "FULL_SHARD" if plugin.reshard_after_forward else "SHARD_GRAD_OP"
    stage = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2, "NO_SHARD": 0}[strategy]
    offload = getattr(plugin.cpu_offload, "offload_params", None)
    if offload is None:  # FSDP2: a CPUOffloadPolicy, or an OffloadPolicy that keeps everything on device
        offload = type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy"
    if plugin.auto_wrap_policy is transformer_auto_wrap_policy:
        wrap = ("TRANSFORMER_BASED_WRAP", tuple(plugin.transformer_cls_names_to_wrap or ()), None)
    elif plugin.auto_wrap_policy is size_based_auto_wrap_policy:
        wrap = ("SIZE_BASED_WRAP", (), plugin.min_num_params)
    else:
        wrap = ("NO_WRAP", (), None)
    return {"stage": stage, "offload": bool(offload), "wrap": wrap, "state_dict_type": plugin.state_dict_type.name,
            "activation_checkpointing": plugin.activation_checkpointing, "mixed_precision": mixed,
            "low_memory_loading": bool(plugin.cpu_ram_efficient_loading) and stage == 3}


def _fsdp_settings_view(s: AccelerateSettings) -> dict:
    zero = s.zero_config["zero_optimization"]
    offload = zero.get("offload_optimizer", {}).get("device") == "cpu"
    if zero["stage"] == 3:
        assert zero.get("offload_param", {}).get("device", "none") == ("cpu" if offload else "none")
    assert zero["stage3_gather_16bit_weights_on_model_save"] == (s.state_dict_type == "FULL_STATE_DICT")
    if s.mixed_precision != "no":
        assert s.zero_config[s.mixed_precision] == {"enabled": True}
    return {"stage": zero["stage"], "offload": offload,
            "wrap": (s.wrap.policy, s.wrap.transformer_classes, s.wrap.min_num_params),
            "state_dict_type": s.state_dict_type, "activation_checkpointing": s.activation_checkpointing,
            "mixed_precision": s.mixed_precision, "low_memory_loading": bool(s.low_memory_loading)}


def _parses(settings: AccelerateSettings) -> None:
    """The converted config is one hf_zero reads (keys, types), "auto" values and all."""
    from hf_zero.config import parse_config

    parse_config(settings.zero_config)


@pytest.fixture
def files(tmp_path: Path):
    def write(name: str, text: str) -> str:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return str(path)

    return write


# ------------------------------------------------------------------------------------- DEEPSPEED
DEEPSPEED_LINES = [
    "--use_deepspeed",
    "--use_deepspeed --zero_stage 3 --offload_param_device cpu --offload_optimizer_device cpu --mixed_precision bf16",
    "--use-deepspeed --zero-stage=1 --gradient-accumulation-steps=4 --gradient_clipping 0.5 --mixed_precision fp16",
    "--use_deepspeed --zero_stage 3 --zero3_init_flag false --zero3_save_16bit_model true --num_processes 2",
    "--use_deepspeed --zero_stage 0 --gradient_clipping 0",
]


@pytest.mark.parametrize("line", DEEPSPEED_LINES)
def test_deepspeed_options_give_the_plugin_config(line, monkeypatch, tmp_path):
    argv = shlex.split(line)
    plugin, _ = _accelerate(argv, monkeypatch, tmp_path)
    settings = _hf_zero(argv)
    assert settings.distributed_type == "DEEPSPEED"
    assert settings.zero_config == _expected_deepspeed(plugin)
    assert settings.low_memory_loading == plugin.zero3_init_flag
    _parses(settings)


def test_nvme_path_from_the_line_is_kept(monkeypatch, tmp_path):
    """accelerate 1.15's launcher never exports --offload_*_nvme_path (prepare_deepspeed_cmd_env), so
    its plugin writes the path "none"; hf_zero keeps the path the user typed (docs/accelerate.md)."""
    argv = shlex.split("--use_deepspeed --zero_stage 3 --offload_optimizer_device nvme --offload_param_device nvme "
                       "--offload_optimizer_nvme_path /local_nvme --offload_param_nvme_path /nvme2")
    plugin, _ = _accelerate(argv, monkeypatch, tmp_path)
    expected = _expected_deepspeed(plugin)
    assert expected["zero_optimization"]["offload_optimizer"]["nvme_path"] == "none"  # accelerate's loss
    expected["zero_optimization"]["offload_optimizer"]["nvme_path"] = "/local_nvme"
    expected["zero_optimization"]["offload_param"]["nvme_path"] = "/nvme2"
    assert _hf_zero(argv).zero_config == expected


def test_deepspeed_inline_yaml(files, monkeypatch, tmp_path):
    argv = ["--config_file", files("ds.yaml", DS_INLINE_YAML)]
    plugin, _ = _accelerate(argv, monkeypatch, tmp_path)
    settings = _hf_zero(argv)
    assert settings.zero_config == _expected_deepspeed(plugin)
    assert settings.zero_config["zero_optimization"]["stage"] == 3  # a real check that the file was read
    assert settings.zero_config["bf16"] == {"enabled": True}
    assert settings.low_memory_loading is True and settings.gradient_accumulation_steps == 4
    assert settings_from_accelerate_file(argv[1]).zero_config == settings.zero_config
    _parses(settings)


@pytest.mark.parametrize("extra", [[], ["--zero_stage", "3", "--mixed_precision", "bf16"],
                                   ["--offload_optimizer_device", "cpu", "--gradient_clipping", "0.3"]])
def test_deepspeed_config_file_with_auto(extra, files, monkeypatch, tmp_path):
    ds = files("zero3.json", json.dumps(DS_AUTO_JSON))
    argv = ["--config_file", files("acc.yaml", DS_FILE_YAML.format(ds=ds)), *extra]
    plugin, _ = _accelerate(argv, monkeypatch, tmp_path)
    settings = _hf_zero(argv)
    assert settings.zero_config == _expected_deepspeed(plugin)
    assert settings.low_memory_loading == plugin.zero3_init_flag
    _parses(settings)


def test_deepspeed_config_file_on_the_line(files, monkeypatch, tmp_path):
    ds = files("zero2.json", json.dumps({**DS_AUTO_JSON, "zero_optimization": {"stage": 2}}))
    argv = ["--use_deepspeed", "--deepspeed_config_file", ds, "--mixed_precision", "fp16"]
    plugin, _ = _accelerate(argv, monkeypatch, tmp_path)
    settings = _hf_zero(argv)
    assert settings.zero_config == _expected_deepspeed(plugin)
    assert settings.zero_config["fp16"]["enabled"] is True


def test_deepspeed_file_beside_ignored_yaml_keys_is_refused_like_accelerate(files, monkeypatch, tmp_path):
    ds = files("zero3.json", json.dumps(DS_AUTO_JSON))
    yaml_text = DS_FILE_YAML.format(ds=ds).replace("  zero3_init_flag: false\n", "  zero_stage: 3\n")
    argv = ["--config_file", files("acc.yaml", yaml_text)]
    with pytest.raises(ValueError, match="ignored"):
        _accelerate(argv, monkeypatch, tmp_path)
    with pytest.raises(LaunchLineError, match="zero_stage beside deepspeed_config_file"):
        _hf_zero(argv)


# ------------------------------------------------------------------------------------- FSDP
FSDP_YAMLS = {
    "source_003": SOURCE_003_YAML,
    "v1_shard_grad_op_size": SOURCE_003_YAML.replace("fsdp_sharding_strategy: 1", "fsdp_sharding_strategy: SHARD_GRAD_OP")
    .replace("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP").replace("  fsdp_transformer_layer_cls_to_wrap: T5Block\n",
                                                                    "  fsdp_min_num_params: 2000\n"),
    "v1_no_shard_bf16": SOURCE_003_YAML.replace("fsdp_sharding_strategy: 1", "fsdp_sharding_strategy: NO_SHARD")
    .replace("fsdp_offload_params: true", "fsdp_offload_params: false").replace("mixed_precision: 'no'",
                                                                                "mixed_precision: bf16"),
    "v2_reshard_false_ckpt": textwrap.dedent("""\
        compute_environment: LOCAL_MACHINE
        distributed_type: FSDP
        fsdp_config:
          fsdp_version: 2
          fsdp_reshard_after_forward: false
          fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
          fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer,LlamaRMSNorm
          fsdp_state_dict_type: SHARDED_STATE_DICT
          fsdp_activation_checkpointing: true
          fsdp_cpu_ram_efficient_loading: false
          fsdp_sync_module_states: false
        mixed_precision: bf16
        num_machines: 1
        num_processes: 2
        """),
    "v2_full_offload_no_names": textwrap.dedent("""\
        compute_environment: LOCAL_MACHINE
        distributed_type: FSDP
        fsdp_config:
          fsdp_version: 2
          fsdp_offload_params: true
          fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
        mixed_precision: fp16
        num_processes: 2
        """),
}


@pytest.mark.parametrize("name", sorted(FSDP_YAMLS))
def test_fsdp_yaml_gives_what_the_plugin_asks_for(name, files, monkeypatch, tmp_path):
    argv = ["--config_file", files(f"{name}.yaml", FSDP_YAMLS[name])]
    plugin, mixed = _accelerate(argv, monkeypatch, tmp_path)
    settings = _hf_zero(argv)
    assert settings.distributed_type == "FSDP"
    assert _fsdp_settings_view(settings) == _fsdp_view(plugin, mixed)
    _parses(settings)


def test_source_003_yaml_in_hf_zero_terms(files):
    settings = settings_from_accelerate_file(files("fsdp_config.yaml", SOURCE_003_YAML))
    assert settings.zero_config["zero_optimization"]["stage"] == 3
    assert settings.zero_config["zero_optimization"]["offload_param"] == {"device": "cpu"}
    assert settings.wrap.transformer_classes == ("T5Block",)
    assert settings.num_processes == 2
    # The old key accelerate no longer reads is reported once, the boilerplate keys are not.
    assert [line.split(":")[0] for line in settings.no_effect] == ["fsdp_backward_prefetch_policy"]


FSDP_LINES = [
    "--use_fsdp",
    "--use_fsdp --fsdp_sharding_strategy SHARD_GRAD_OP --fsdp_offload_params true --mixed_precision bf16",
    "--use-fsdp --fsdp-sharding-strategy=3 --fsdp-auto-wrap-policy=SIZE_BASED_WRAP --fsdp-min-num-params=100",
    "--use_fsdp --fsdp_version 2 --fsdp_reshard_after_forward true --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP "
    "--fsdp_transformer_layer_cls_to_wrap T5Block --fsdp_activation_checkpointing true --fsdp_state_dict_type FULL_STATE_DICT",
]


@pytest.mark.parametrize("line", FSDP_LINES)
def test_fsdp_options_give_what_the_plugin_asks_for(line, monkeypatch, tmp_path):
    argv = shlex.split(line)
    plugin, mixed = _accelerate(argv, monkeypatch, tmp_path)
    assert _fsdp_settings_view(_hf_zero(argv)) == _fsdp_view(plugin, mixed)


def test_line_overrides_the_file(files, monkeypatch, tmp_path):
    argv = ["--config_file", files("fsdp.yaml", SOURCE_003_YAML), "--fsdp_offload_params", "false",
            "--fsdp_sharding_strategy", "SHARD_GRAD_OP", "--mixed_precision", "bf16"]
    plugin, mixed = _accelerate(argv, monkeypatch, tmp_path)
    view = _fsdp_settings_view(_hf_zero(argv))
    assert view == _fsdp_view(plugin, mixed)
    assert (view["stage"], view["offload"], view["mixed_precision"]) == (2, False, "bf16")


# ------------------------------------------------------------------------------------- refused / layout
@pytest.mark.parametrize("line, message", [
    ("--use_fsdp --fsdp_sharding_strategy HYBRID_SHARD", "FULL_SHARD \\(ZeRO stage 3\\) or SHARD_GRAD_OP"),
    ("--use_fsdp --fsdp_sharding_strategy 5", "ZeRO-2 flavour"),
    ("--use_deepspeed --mixed_precision fp8", "fp8 is not supported"),
    ("--tpu", "TPUs"),
    ("--use_megatron_lm", "Megatron-LM"),
    ("--use_fsdp --fsdp_activation_checkpointing true --fsdp_activation_checkpointing_offload true", "activations"),
    ("--mixed_precision fp32", "invalid choice"),  # accelerate's parser checks the choices
    ("--num_processes 2 --nproc_per_node 2", "use one launcher's options"),
    ("--num_processes 3 --num_machines 2 --main_process_ip 10.0.0.1", "multiple of the machine count"),
])
def test_refused_with_what_to_do(line, message):
    from accelerate.commands.launch import launch_command_parser

    known = {spelling for action in launch_command_parser()._actions for spelling in action.option_strings}
    newer = [a for a in shlex.split(line) if a.startswith("--fsdp_") and a not in known]
    if newer:  # e.g. --fsdp_activation_checkpointing_offload is newer than accelerate 1.10 (the matrix floor)
        pytest.skip(f"this accelerate has no {newer}")
    with pytest.raises(LaunchLineError, match=message):
        plan_launch_line([*shlex.split(line), "train.py"], env={})


def test_process_layout_as_accelerate_launch():
    one = plan_launch_line(shlex.split("--num_processes 2 --main_process_port 29511 --gpu_ids 0,1 --use_fsdp t.py"),
                           gpu_names=["A100"] * 4, env={})
    assert one.torchrun_args[:2] == ["--nproc_per_node=2", "--master_port=29511"]
    assert one.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert one.torchrun_args[-3:] == ["-m", "hf_zero.accelerate_support.bootstrap", "t.py"]
    two = plan_launch_line(shlex.split("--num_processes 8 --num_machines 2 --machine_rank 1 --main_process_ip 10.0.0.1 "
                                       "--same_network --use_deepspeed --num_cpu_threads_per_process 3 -m pkg.train"),
                           env={})
    assert two.torchrun_args[:5] == ["--nproc_per_node=4", "--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.1",
                                     "--master_port=29500"]
    assert two.torchrun_args[-4:] == ["-m", "hf_zero.accelerate_support.bootstrap", "-m", "pkg.train"]
    assert two.env["OMP_NUM_THREADS"] == "3"


def test_every_accelerate_option_is_known_to_hf_zero_run():
    """Each option string of accelerate's launch parser parses in hf-zero run (none re-declared)."""
    from accelerate.commands.launch import launch_command_parser

    from hf_zero.cli.launch import build_launch_parser

    parser, _ = build_launch_parser()
    known = parser._option_string_actions
    missing = [s for a in launch_command_parser()._actions for s in a.option_strings if s not in known]
    assert missing == []


def test_config_from_accelerate_prints_the_config(files, capsys):
    from hf_zero.cli.main import main

    path = files("fsdp_config.yaml", SOURCE_003_YAML)
    assert main(["config", "--from-accelerate", path]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["zero_config"]["zero_optimization"]["stage"] == 3
    assert report["wrap"]["transformer_classes"] == ["T5Block"]
    assert main(["config", "--from-accelerate", path, "--zero_config_only"]) == 0
    only = json.loads(capsys.readouterr().out)
    assert only == report["zero_config"]
    hybrid = files("hybrid.yaml", SOURCE_003_YAML.replace("fsdp_sharding_strategy: 1", "fsdp_sharding_strategy: 4"))
    assert main(["config", "--from-accelerate", hybrid]) == 2
    assert "HYBRID_SHARD" in capsys.readouterr().err


def test_docs_list_every_no_effect_setting():
    from hf_zero.config.sources.accelerate_plugins import NO_EFFECT

    text = (Path(__file__).resolve().parents[2] / "docs" / "accelerate.md").read_text()
    assert [k for k in NO_EFFECT if f"`{k}`" not in text] == []
