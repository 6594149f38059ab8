"""Parsing DeepSpeed-style configs: sources, seed configs, aliases, number forms, validation messages."""

from __future__ import annotations

import base64
import copy
import json
import subprocess
import sys
from pathlib import Path

import warnings

import pytest

from hf_zero.config import AUTO, ZeroConfigError, ZeroConfigWarning, describe_no_effect, load_config
from hf_zero.config.parse import NO_EFFECT_KEYS, UNSUPPORTED, merge_configs, parse_config

SEEDS = Path("/work/shared/seed_configs")
if not SEEDS.is_dir():  # pragma: no cover - the shared folder is part of the dev box
    SEEDS = Path(__file__).resolve().parents[2] / "shared" / "seed_configs"
FULL_CONFIGS = sorted(
    p for p in SEEDS.glob("*.json") if p.name not in ("openmind_optimizer.json", "openmind_scheduler.json")
)


def _error(source, **kwargs) -> str:
    with pytest.raises(ZeroConfigError) as info:
        parse_config(source, **kwargs)
    return str(info.value)


def _write(tmp_path: Path, name: str, content) -> Path:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


# ---------------------------------------------------------------------------------------------- seeds
@pytest.mark.parametrize("path", FULL_CONFIGS, ids=lambda p: p.name)
def test_every_seed_config_is_accepted(path: Path, tmp_path: Path) -> None:
    raw = json.loads(path.read_text())
    if "nvme" in path.name:
        # The seed names /nvme_data; point it at a folder that exists here.
        for section in ("offload_optimizer", "offload_param"):
            raw["zero_optimization"][section]["nvme_path"] = str(tmp_path)
        path = _write(tmp_path, path.name, raw)
    cfg = parse_config(path)
    assert cfg.source == str(path)
    assert cfg.stage == raw["zero_optimization"]["stage"]


def test_seed_fragments_merge_with_a_zero_section() -> None:
    cfg = parse_config([SEEDS / "openmind_zero2_basic.json", SEEDS / "openmind_optimizer.json",
                        SEEDS / "openmind_scheduler.json"])
    assert cfg.stage == 2
    assert cfg.optimizer.type == "adamw" and cfg.optimizer.lr == AUTO
    assert cfg.scheduler.type == "WarmupDecayLR"
    assert set(cfg.unresolved()) == {
        "optimizer.lr", "optimizer.betas", "optimizer.eps", "optimizer.weight_decay",
        "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr",
        "scheduler.params.warmup_num_steps", "scheduler.params.total_num_steps",
    }
    assert " + " in cfg.source and "openmind_optimizer.json" in cfg.source


def test_seed_values_land_in_the_schema(tmp_path: Path) -> None:
    cfg = parse_config(SEEDS / "openmind_zero3_full.json")
    z = cfg.zero_optimization
    assert z.sub_group_size == 1_000_000_000 and isinstance(z.sub_group_size, int)
    assert z.max_live_parameters == 1_000_000_000 and z.max_reuse_distance == 1_000_000_000
    assert z.prefetch_bucket_size == AUTO and z.param_persistence_threshold == AUTO
    assert z.gather_16bit_weights_on_model_save is True
    assert cfg.communication_data_type == "fp32"
    # bf16 loss-scale keys copied from an fp16 section are accepted and reported as no-ops.
    assert "bf16.loss_scale" in cfg.no_effect_keys

    glm = parse_config(SEEDS / "chatglm3_ds_zero_2.json")
    assert glm.zero_optimization.reduce_bucket_size == 500_000_000
    assert glm.fp16.enabled == AUTO and glm.fp16.min_loss_scale == 1.0
    assert glm.steps_per_print == 2000


def test_merge_later_wins_and_messages_name_the_fragment(tmp_path: Path) -> None:
    a = _write(tmp_path, "a.json", {"zero_optimization": {"stage": 2, "overlap_comm": True}})
    b = _write(tmp_path, "b.json", {"zero_optimization": {"stage": 3}})
    cfg = merge_configs(a, b)
    assert cfg.stage == 3 and cfg.zero_optimization.overlap_comm is True
    bad = _write(tmp_path, "bad.json", {"optimizer": {"type": "AdamW", "params": {"lr": "fast"}}})
    message = _error([a, bad])
    assert f"{bad}: optimizer.params.lr=\"fast\"" in message


# ---------------------------------------------------------------------------------------- sources
def test_dict_json_string_and_base64_sources() -> None:
    raw = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    before = copy.deepcopy(raw)
    assert parse_config(raw).source == "<dict>"
    assert raw == before  # never mutated
    text = json.dumps(raw)
    assert parse_config(text).stage == 2 and parse_config(text).source == "<json string>"
    encoded = base64.urlsafe_b64encode(text.encode()).decode()
    cfg = parse_config(encoded)
    assert cfg.stage == 2 and cfg.compute_dtype_name == "bf16" and cfg.source == "<base64 json>"


def test_dict_with_legacy_alias_is_not_mutated() -> None:
    raw = {"bfloat16": {"enabled": True}, "zero_optimization": {"cpu_offload": True, "stage": 2}}
    before = copy.deepcopy(raw)
    cfg = parse_config(raw)
    assert cfg.bf16.enabled is True and cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert raw == before


def test_yaml_source(tmp_path: Path) -> None:
    path = _write(tmp_path, "ds.yaml", "zero_optimization:\n  stage: 3\n  stage3_prefetch_bucket_size: 2e8\n"
                  "bf16:\n  enabled: auto\n")
    cfg = parse_config(path)
    # YAML 1.1 reads 2e8 as a string; it is still a number here.
    assert cfg.zero_optimization.prefetch_bucket_size == 200_000_000
    assert cfg.bf16.enabled == AUTO and cfg.source == str(path)


def test_pathlike_and_str_paths(tmp_path: Path) -> None:
    path = _write(tmp_path, "ds.json", {"zero_optimization": {"stage": 1}})
    assert parse_config(path).stage == 1
    assert parse_config(str(path)).stage == 1


def test_malformed_json_names_file_line_and_column(tmp_path: Path) -> None:
    path = _write(tmp_path, "broken.json", '{\n  "zero_optimization": {\n    "stage": 2,\n  }\n}\n')
    message = _error(path)
    assert f"{path}:4:3" in message and "line 4, column 3" in message
    assert "trailing comma" in message


def test_json_comments_get_a_hint(tmp_path: Path) -> None:
    path = _write(tmp_path, "c.json", '{\n  // ZeRO-2\n  "zero_optimization": {"stage": 2}\n}')
    message = _error(path)
    assert f"{path}:2:3" in message and "comments" in message


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "broken.yml", "zero_optimization:\n  stage: [2\nbf16: {enabled: true}\n")
    message = _error(path)
    assert str(path) in message and "invalid YAML at line" in message


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "ds_config.json"
    message = _error(missing)
    assert str(missing) in message and "not found" in message
    assert str(missing) in _error(str(missing))


def test_config_that_is_not_an_object(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, "list.json", "[1, 2]"))
    assert "list.json" in message and "must be an object" in message
    assert "must be an object" in _error("[1, 2]")
    with pytest.raises(ZeroConfigError, match="a config must be a path"):
        parse_config(42)


def test_duplicate_keys_are_rejected(tmp_path: Path) -> None:
    path = _write(tmp_path, "dup.json", '{"zero_optimization": {"stage": 2, "stage": 3}}')
    message = _error(path)
    assert str(path) in message and '"stage" appears twice' in message


def test_garbage_string_is_rejected() -> None:
    message = _error("this is neither json nor a file nor base64!")
    assert "is not an existing file, a JSON object or base64" in message


# ---------------------------------------------------------------------------------------- aliases
@pytest.mark.parametrize(
    "key, field, value",
    [
        ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save", False),
        ("stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save", False),
        ("gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save", False),
        ("stage3_prefetch_bucket_size", "prefetch_bucket_size", 12345),
        ("prefetch_bucket_size", "prefetch_bucket_size", 12345),
        ("stage3_param_persistence_threshold", "param_persistence_threshold", 777),
        ("param_persistence_threshold", "param_persistence_threshold", 777),
        ("stage3_max_live_parameters", "max_live_parameters", 5),
        ("max_live_parameters", "max_live_parameters", 5),
        ("stage3_max_reuse_distance", "max_reuse_distance", 6),
        ("max_reuse_distance", "max_reuse_distance", 6),
    ],
)
def test_zero_aliases(key: str, field: str, value) -> None:
    cfg = parse_config({"zero_optimization": {"stage": 3, key: value}})
    assert getattr(cfg.zero_optimization, field) == value
    assert f"zero_optimization.{field}" in cfg.explicit_keys


def test_conflicting_aliases_are_an_error() -> None:
    message = _error({"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
                                            "stage3_gather_fp16_weights_on_model_save": False}})
    assert "stage3_gather_fp16_weights_on_model_save=false conflicts with" in message
    assert "keep only one" in message


def test_gather_16bit_default_is_true_in_hf_zero() -> None:
    assert parse_config({"zero_optimization": {"stage": 3}}).zero_optimization.gather_16bit_weights_on_model_save


def test_legacy_cpu_offload_switches() -> None:
    cfg = parse_config({"zero_optimization": {"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": True}})
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert cfg.zero_optimization.offload_optimizer.pin_memory is True
    for key in ("cpu_offload_param", "cpu_offload_params"):
        cfg = parse_config({"zero_optimization": {"stage": 3, key: True}})
        assert cfg.zero_optimization.offload_param.device == "cpu"
    assert parse_config({"zero_optimization": {"stage": 2, "cpu_offload": False}}).zero_optimization \
        .offload_optimizer.device == "none"


def test_legacy_switch_contradicting_new_section() -> None:
    message = _error({"zero_optimization": {"stage": 3, "cpu_offload": True,
                                            "offload_optimizer": {"device": "nvme", "nvme_path": "/x"}}})
    assert "zero_optimization.cpu_offload=true contradicts" in message and "remove cpu_offload" in message


def test_legacy_boolean_zero_section_and_bfloat16_name() -> None:
    assert parse_config({"zero_optimization": True}).stage == 1
    assert parse_config({"bfloat16": {"enabled": True}}).compute_dtype_name == "bf16"


# -------------------------------------------------------------------------------- numbers and bools
@pytest.mark.parametrize("value", [2e8, "2e8", 200000000, "200000000", 2.0e8])
def test_int_fields_take_any_number_form(value) -> None:
    cfg = parse_config({"zero_optimization": {"stage": 2, "reduce_bucket_size": value}})
    assert cfg.zero_optimization.reduce_bucket_size == 200_000_000
    assert type(cfg.zero_optimization.reduce_bucket_size) is int


def test_numbers_compare_as_numbers() -> None:
    cfg = parse_config({"train_micro_batch_size_per_gpu": "8", "gradient_accumulation_steps": 2.0,
                        "gradient_clipping": "1", "optimizer": {"type": "AdamW", "params": {"lr": "1e-5"}}})
    assert cfg.train_micro_batch_size_per_gpu == 8 and type(cfg.train_micro_batch_size_per_gpu) is int
    assert cfg.gradient_accumulation_steps == 2 and cfg.gradient_clipping == 1.0
    assert cfg.optimizer.lr == 1e-5


def test_fractional_value_for_int_field_is_an_error() -> None:
    message = _error({"zero_optimization": {"stage": 2, "reduce_bucket_size": 2.5}})
    assert "<dict>: zero_optimization.reduce_bucket_size=2.5 is not a whole number" in message


def test_betas_list_becomes_tuple() -> None:
    cfg = parse_config({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 0.95]}}})
    assert cfg.optimizer.betas == (0.9, 0.95) and isinstance(cfg.optimizer.betas, tuple)


@pytest.mark.parametrize("value", ["yes", "true", 1, None.__class__.__name__])
def test_bool_fields_take_json_booleans_only(value) -> None:
    message = _error({"zero_optimization": {"stage": 2, "overlap_comm": value}})
    assert f"zero_optimization.overlap_comm={json.dumps(value)} is not a boolean" in message
    assert "write true or false" in message


def test_auto_is_refused_where_hf_does_not_fill_it() -> None:
    message = _error({"zero_optimization": {"stage": 2, "allgather_bucket_size": "auto"}})
    assert 'zero_optimization.allgather_bucket_size="auto" is not allowed here' in message


def test_null_means_default() -> None:
    cfg = parse_config({"train_batch_size": None, "zero_optimization": {"stage": 3, "overlap_comm": None}})
    assert cfg.train_batch_size is None and cfg.zero_optimization.overlap_comm is True


# --------------------------------------------------------------------------- defaults (DeepSpeed code)
def test_overlap_comm_default_depends_on_stage() -> None:
    assert parse_config({"zero_optimization": {"stage": 3}}).zero_optimization.overlap_comm is True
    for stage in (0, 1, 2):
        assert parse_config({"zero_optimization": {"stage": stage}}).zero_optimization.overlap_comm is False
    assert parse_config({"zero_optimization": {"stage": 3, "overlap_comm": False}}).zero_optimization \
        .overlap_comm is False


def test_code_defaults() -> None:
    cfg = parse_config({})
    assert cfg.zero_optimization.prefetch_bucket_size == 50_000_000
    assert cfg.gradient_clipping == 0.0
    assert cfg.fp16.initial_scale_power == 16 and cfg.fp16.hysteresis == 2
    assert cfg.communication_data_type is None
    assert cfg.stage == 0 and cfg.optimizer is None and cfg.scheduler is None


# -------------------------------------------------------------------------------------- optimizer
@pytest.mark.parametrize("name, canonical", [("Adam", "adam"), ("adam", "adam"), ("AdamW", "adamw"),
                                             ("adamw", "adamw"), ("SGD", "sgd"), ("Lion", "lion"),
                                             ("Lamb", "lamb"), ("LAMB", "lamb")])
def test_optimizer_types_are_canonical_lower_case(name: str, canonical: str) -> None:
    assert parse_config({"optimizer": {"type": name}}).optimizer.type == canonical


def test_adam_means_adamw_by_default() -> None:
    assert parse_config({"optimizer": {"type": "Adam"}}).optimizer.adam_w_mode is True
    assert parse_config({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}).optimizer \
        .adam_w_mode is False
    with pytest.warns(ZeroConfigWarning, match="adam_w_mode=false has no effect"):
        cfg = parse_config({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}})
    assert cfg.optimizer.adam_w_mode is True


@pytest.mark.parametrize("name", ["OneBitAdam", "OneBitLamb", "ZeroOneAdam", "Adagrad", "MuAdam"])
def test_unsupported_optimizers_point_to_supported_ones(name: str) -> None:
    message = _error({"optimizer": {"type": name, "params": {"lr": 1e-3}}})
    assert f'optimizer.type="{name}" is not supported' in message
    assert "use Adam, AdamW, SGD, Lion, Lamb or Muon" in message


def test_unknown_optimizer_suggests_a_close_name() -> None:
    message = _error({"optimizer": {"type": "AdamX"}})
    assert 'did you mean "adam' in message


def test_optimizer_param_of_another_type() -> None:
    message = _error({"optimizer": {"type": "AdamW", "params": {"momentum": 0.9}}})
    assert "optimizer.params.momentum=0.9 is not a parameter of AdamW" in message


def test_max_grad_norm_in_optimizer_params_points_to_gradient_clipping() -> None:
    message = _error({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}})
    assert "optimizer.params.max_grad_norm=1.0" in message and 'use "gradient_clipping"' in message


def test_bad_betas() -> None:
    message = _error({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.99, 0.999]}}})
    assert "optimizer.params.betas=[0.9, 0.99, 0.999] is not a pair of numbers" in message


# -------------------------------------------------------------------------------------- scheduler
def test_scheduler_params_go_to_the_matching_dataclass() -> None:
    cfg = parse_config({"scheduler": {"type": "WarmupCosineLR",
                                      "params": {"total_num_steps": 1000, "warmup_num_steps": "1e2",
                                                 "cos_min_ratio": 0.1}}})
    p = cfg.scheduler.params
    assert type(p).__name__ == "WarmupCosineLRParams"
    assert (p.total_num_steps, p.warmup_num_steps, p.cos_min_ratio, p.warmup_min_ratio) == (1000, 100, 0.1, 0.0)


def test_scheduler_defaults_follow_lr_schedules_py() -> None:
    p = parse_config({"scheduler": {"type": "WarmupLR"}}).scheduler.params
    assert (p.warmup_min_lr, p.warmup_max_lr, p.warmup_num_steps, p.warmup_type) == (0.0, 0.001, 1000, "log")
    p = parse_config({"scheduler": {"type": "LRRangeTest"}}).scheduler.params
    assert (p.lr_range_test_min_lr, p.lr_range_test_step_size, p.lr_range_test_step_rate) == (0.001, 2000, 1.0)


def test_scheduler_type_is_case_sensitive_with_a_suggestion() -> None:
    message = _error({"scheduler": {"type": "warmuplr"}})
    assert 'scheduler.type="warmuplr" is not a scheduler' in message and 'did you mean "WarmupLR"' in message


def test_scheduler_unknown_param_suggests_closest() -> None:
    message = _error({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 10}}})
    assert 'unknown key "scheduler.params.warmup_num_step"' in message
    assert 'did you mean "scheduler.params.warmup_num_steps"' in message


def test_scheduler_param_of_another_type() -> None:
    message = _error({"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_max_lr": 1e-4}}})
    assert "scheduler.params.warmup_max_lr=0.0001 is not a parameter of WarmupCosineLR" in message


def test_one_cycle_requires_its_bounds() -> None:
    message = _error({"scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 0.1}}})
    assert "scheduler.params.cycle_min_lr is missing but required by OneCycle" in message


# ------------------------------------------------------------------------------------- validation
def test_unknown_key_names_key_file_and_closest(tmp_path: Path) -> None:
    path = _write(tmp_path, "ds.json", {"zero_optimization": {"stage": 2, "overlap_com": True}})
    message = _error(path)
    assert f'{path}: unknown key "zero_optimization.overlap_com"' in message
    assert 'did you mean "zero_optimization.overlap_comm"' in message


def test_unknown_top_level_keys_warn_once_as_deepspeed_ignores_them() -> None:
    raw = {"gradient_clip": 1.0, "_comment": "from a public repo", "log": {"level": "info"},
           "comms_config": {}, "monitor_config": {}, "cuda_visible_devices": "0,1",
           "zero_optimization": {"stage": 2}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = parse_config(raw)
    mine = [w for w in caught if issubclass(w.category, ZeroConfigWarning)]
    assert len(mine) == 1  # one warning naming them all
    message = str(mine[0].message)
    for key in ("gradient_clip", "_comment", "log", "comms_config", "monitor_config", "cuda_visible_devices"):
        assert f'"{key}"' in message, key
    assert '"gradient_clip" (did you mean "gradient_clipping"?)' in message
    assert '"_comment" (did you mean' not in message  # a comment is not a typo
    assert cfg.stage == 2 and cfg.gradient_clipping == 0.0


def test_unknown_key_inside_a_section_stays_an_error() -> None:
    message = _error({"zero_optimization": {"stage": 2, "overlap_com": True}})
    assert 'unknown key "zero_optimization.overlap_com"' in message and 'did you mean "zero_optimization.overlap_comm"' in message


def test_non_strict_turns_unknown_keys_into_warnings() -> None:
    with pytest.warns(ZeroConfigWarning, match='unknown key "zero_optimization.overlap_com"'):
        cfg = parse_config({"zero_optimization": {"stage": 2, "overlap_com": True}}, strict=False)
    assert cfg.stage == 2


@pytest.mark.parametrize("stage", [4, -1, "two", 2.5])
def test_stage_out_of_range_or_wrong_type(stage) -> None:
    message = _error({"zero_optimization": {"stage": stage}})
    assert f"<dict>: zero_optimization.stage={json.dumps(stage)}" in message
    assert "write 0, 1, 2 or 3" in message


def test_offload_param_below_stage_3() -> None:
    message = _error({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert 'zero_optimization.offload_param.device="cpu" needs ZeRO stage 3' in message
    assert "set zero_optimization.stage to 3" in message


def test_offload_optimizer_at_stage_0() -> None:
    message = _error({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})
    assert "needs ZeRO stage 1, 2 or 3" in message


@pytest.mark.parametrize("section, stage", [("offload_optimizer", 2), ("offload_param", 3)])
def test_nvme_without_path(section: str, stage: int) -> None:
    message = _error({"zero_optimization": {"stage": stage, section: {"device": "nvme"}}})
    assert f'zero_optimization.{section}.device="nvme" needs a folder' in message
    assert '"nvme_path"' in message


def test_bad_offload_device_suggests() -> None:
    message = _error({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpuu"}}})
    assert 'offload_optimizer.device="cpuu" is not one of' in message and 'did you mean "cpu"' in message


def test_fp16_and_bf16_both_enabled() -> None:
    message = _error({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert "bf16.enabled=true conflicts with fp16.enabled=true" in message
    assert "enable only one" in message
    # both "auto" is fine until resolved
    assert parse_config({"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}).fp16.enabled == AUTO


def test_negative_bucket_size() -> None:
    message = _error({"zero_optimization": {"stage": 2, "reduce_bucket_size": -5}})
    assert "zero_optimization.reduce_bucket_size=-5 is below the minimum 0" in message


@pytest.mark.parametrize("ratio", [0, 0.0, 1.5, -0.1])
def test_offload_ratio_outside_range(ratio) -> None:
    message = _error({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": ratio}}})
    assert f"zero_optimization.offload_optimizer.ratio={json.dumps(ratio)}" in message


def test_partial_offload_needs_stage_3() -> None:
    message = _error({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}})
    assert "partial offload needs ZeRO stage 3" in message
    cfg = parse_config({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}})
    assert cfg.zero_optimization.offload_optimizer.ratio == 0.5


def test_section_that_is_not_an_object() -> None:
    message = _error({"fp16": True})
    assert "<dict>: fp16=true is not an object" in message


def test_all_problems_are_collected_in_one_error() -> None:
    with pytest.raises(ZeroConfigError) as info:
        parse_config({"zero_optimization": {"stage": "two", "overlap_comm": "yes"}, "fp16": {"enabled": "on"}})
    assert len(info.value.problems) == 3
    assert str(info.value).startswith("3 problems")


# -------------------------------------------------------------------------- no effect / unsupported
NO_EFFECT_SAMPLE = {
    "zero_allow_untested_optimizer": True,
    "zero_force_ds_cpu_optimizer": False,
    "memory_breakdown": False,
    "dump_state": False,
    "flops_profiler": {"enabled": False, "profile_step": 1},
    "comms_logger": {"enabled": True, "verbose": False},
    "amp": {"enabled": False, "opt_level": "O1"},
    "elasticity": {"enabled": False},
    "data_types": {"grad_accum_dtype": "fp32"},
    "bf16": {"enabled": True, "immediate_grad_update": True},
    "zero_optimization": {
        "stage": 3, "ignore_unused_parameters": True, "load_from_fp32_weights": True,
        "elastic_checkpoint": False, "legacy_stage1": False, "zero_hpz_partition_size": 1,
        "zero_quantized_weights": False, "zero_quantized_gradients": False, "mics_shard_size": -1,
        "memory_efficient_linear": True, "pipeline_loading_checkpoint": False, "override_module_apply": True,
        "use_multi_rank_bucket_allreduce": True, "stage3_module_granularity_threshold": 0,
        "log_trace_cache_warnings": False,
        "offload_optimizer": {"device": "cpu", "pipeline_read": False, "pipeline_write": False,
                              "pipeline": False, "fast_init": False},
    },
}


def test_no_effect_keys_are_accepted_and_reported() -> None:
    cfg = parse_config(NO_EFFECT_SAMPLE)
    expected = {
        "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "memory_breakdown", "dump_state",
        "flops_profiler", "comms_logger", "amp", "elasticity", "data_types", "bf16.immediate_grad_update",
        "zero_optimization.ignore_unused_parameters", "zero_optimization.load_from_fp32_weights",
        "zero_optimization.elastic_checkpoint", "zero_optimization.legacy_stage1",
        "zero_optimization.zero_quantized_weights", "zero_optimization.zero_quantized_gradients",
        "zero_optimization.memory_efficient_linear", "zero_optimization.pipeline_loading_checkpoint",
        "zero_optimization.override_module_apply", "zero_optimization.use_multi_rank_bucket_allreduce",
        "zero_optimization.stage3_module_granularity_threshold", "zero_optimization.log_trace_cache_warnings",
        "zero_optimization.offload_optimizer.pipeline_read", "zero_optimization.offload_optimizer.pipeline_write",
        "zero_optimization.offload_optimizer.pipeline", "zero_optimization.offload_optimizer.fast_init",
    }
    assert set(cfg.no_effect_keys) == expected
    lines = describe_no_effect(cfg)
    assert len(lines) == len(expected)
    assert all(": no effect in hf_zero (" in line for line in lines)
    assert any(line.startswith("flops_profiler: no effect in hf_zero (") and "torch.profiler" in line
               for line in lines)


def test_no_effect_reported_once_in_key_order() -> None:
    cfg = parse_config({"dump_state": False, "memory_breakdown": True})
    assert cfg.no_effect_keys == ("dump_state", "memory_breakdown")
    assert parse_config({}).no_effect_keys == ()


@pytest.mark.parametrize(
    "raw, key, fix",
    [
        ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}},
         "zero_optimization.zero_quantized_weights=true", "set it to false"),
        ({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}},
         "zero_optimization.zero_quantized_gradients=true", "set it to false"),
        ({"fp16": {"enabled": True}, "amp": {"enabled": True, "opt_level": "O2"}},
         "amp=", 'use "bf16": {"enabled": true}'),
        ({"elasticity": {"enabled": True, "max_train_batch_size": 64}}, "elasticity=", "set train_micro_batch"),
        ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
         "fp16.fp16_master_weights_and_grads=true", "fp32 master weights"),
        ({"compression_training": {"weight_quantization": {}}}, "compression_training=", "remove"),
    ],
)
def test_numerics_changing_settings_are_errors(raw, key, fix) -> None:
    message = _error(raw)
    assert f"<dict>: {key}" in message and "is not supported by hf_zero" in message and fix in message


def test_every_conditionally_unsupported_key_is_in_the_no_effect_table() -> None:
    from hf_zero.config.parse import _always

    for key, (predicate, _) in UNSUPPORTED.items():
        assert predicate is _always or key in NO_EFFECT_KEYS, key


def test_config_package_imports_neither_torch_nor_transformers() -> None:
    code = ("import sys, hf_zero.config, hf_zero.cli.main; "
            "print(any(m in sys.modules for m in ('torch', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_load_config_resolves_nothing_without_arguments() -> None:
    cfg = load_config(SEEDS / "openmind_zero3_basic.json")
    assert set(cfg.unresolved()) == {"zero_optimization.reduce_bucket_size",
                                     "zero_optimization.prefetch_bucket_size",
                                     "zero_optimization.param_persistence_threshold"}


def test_every_accepted_key_is_documented() -> None:
    from hf_zero.config import parse as P

    doc = (Path(__file__).resolve().parents[2] / "docs" / "config_reference.md").read_text()
    for key in [*NO_EFFECT_KEYS, *UNSUPPORTED]:
        assert f"`{key}`" in doc, key
    tables = [P._TOP, P._FP16, P._BF16, P._OFFLOAD_OPTIMIZER, P._OFFLOAD_PARAM, P._ZERO, P._AIO, P._ACT_CKPT,
              P._CHECKPOINT, *P._MONITORS.values(), *P._OPTIMIZER_PARAMS.values(), *P._SCHEDULER_PARAMS.values()]
    aliases = [P._ZERO_ALIASES, P._AIO_ALIASES, P._TOP_ALIASES, dict.fromkeys(P._ZERO_LEGACY_OFFLOAD)]
    for key in [k for t in tables for k in t] + [k for a in aliases for k in a]:
        assert f"{key}`" in doc, key
    for name in [*P.SCHEDULER_TYPES, "AdamW", "SGD", "Lion", "Lamb"]:
        assert f"`{name}`" in doc, name


def test_every_design_key_in_one_config(tmp_path: Path) -> None:
    """Every key of DESIGN.md's "Config compatibility" list, in one file."""
    raw = {
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
        "gradient_clipping": 1.0, "steps_per_print": 100, "wall_clock_breakdown": False,
        "communication_data_type": "bfp16", "prescale_gradients": True, "gradient_predivide_factor": 2.0,
        "fp16": {"enabled": False, "loss_scale": 0, "loss_scale_window": 500, "initial_scale_power": 12,
                 "hysteresis": 3, "consecutive_hysteresis": True, "min_loss_scale": 0.5, "auto_cast": False},
        "bf16": {"enabled": True},
        "optimizer": {"type": "Lamb", "params": {"lr": 1e-3, "max_coeff": 5.0, "min_coeff": 0.1}},
        "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-5, "cycle_max_lr": 1e-3}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True,
                                  "buffer_count": 6, "fast_init": False, "ratio": 0.5},
            "offload_param": {"device": "cpu", "pin_memory": True, "buffer_count": 4, "buffer_size": 1e7,
                              "max_in_cpu": 1e8},
            "overlap_comm": False, "contiguous_gradients": True, "reduce_scatter": True,
            "reduce_bucket_size": 1e7, "allgather_partitions": True, "allgather_bucket_size": 2e7,
            "round_robin_gradients": False, "sub_group_size": 1e8, "stage3_prefetch_bucket_size": 3e6,
            "stage3_param_persistence_threshold": 1e4, "stage3_max_live_parameters": 2e8,
            "stage3_max_reuse_distance": 3e8, "stage3_gather_16bit_weights_on_model_save": False,
        },
        "aio": {"block_size": 262144, "queue_depth": 16, "intra_op_parallelism": 4, "single_submit": False,
                "overlap_events": True, "use_gds": False},
        "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": False,
                                     "contiguous_memory_optimization": False, "number_checkpoints": 4,
                                     "synchronize_checkpoint_boundary": False, "profile": False},
        "checkpoint": {"tag_validation": "fail", "load_universal": False, "use_node_local_storage": True,
                       "parallel_write": {"pipeline_stage": False}},
        "tensorboard": {"enabled": True, "output_path": "runs/", "job_name": "j"},
        "wandb": {"enabled": False, "team": "t", "group": "g", "project": "p"},
        "csv_monitor": {"enabled": False, "output_path": "csv/", "job_name": "j"},
    }
    cfg = parse_config(_write(tmp_path, "all.json", raw))
    z = cfg.zero_optimization
    assert cfg.communication_data_type == "bf16" and cfg.compute_dtype_name == "bf16"
    assert (cfg.fp16.initial_scale_power, cfg.fp16.hysteresis, cfg.fp16.min_loss_scale) == (12, 3, 0.5)
    assert cfg.optimizer.type == "lamb" and cfg.optimizer.max_coeff == 5.0
    assert cfg.scheduler.params.cycle_max_lr == 1e-3
    assert z.offload_optimizer.ratio == 0.5 and z.offload_optimizer.buffer_count == 6
    assert z.offload_param.buffer_size == 10_000_000 and z.offload_param.max_in_cpu == 100_000_000
    assert (z.prefetch_bucket_size, z.param_persistence_threshold) == (3_000_000, 10_000)
    assert (z.max_live_parameters, z.max_reuse_distance) == (200_000_000, 300_000_000)
    assert z.gather_16bit_weights_on_model_save is False and z.overlap_comm is False
    assert cfg.aio.thread_count == 4 and cfg.checkpoint.tag_validation == "Fail"
    assert cfg.checkpoint.use_node_local_storage is True and cfg.tensorboard.output_path == "runs/"
    assert cfg.activation_checkpointing.number_checkpoints == 4
    assert {"tensorboard", "activation_checkpointing", "zero_optimization.offload_param.buffer_size"} <= set(cfg.no_effect_keys)
    assert "aio.queue_depth" not in cfg.no_effect_keys  # honoured by the NVMe swapper
    assert cfg.unresolved() == []
    assert load_config(cfg, world_size=2).train_batch_size == 16
