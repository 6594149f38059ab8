"""Resolving "auto" from TrainingArguments, the model config and the world size."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from hf_zero.config import AUTO, ZeroConfigError, load_config, parse_config, resolve_auto
from hf_zero.config.auto import hidden_size_of

SEEDS = Path("/work/shared/seed_configs")
if not SEEDS.is_dir():  # pragma: no cover
    SEEDS = Path(__file__).resolve().parents[2] / "shared" / "seed_configs"


@dataclasses.dataclass
class FakeArgs:
    """The TrainingArguments attributes resolve_auto reads (transformers' defaults)."""

    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    fp16: bool = False
    bf16: bool = False
    fp16_full_eval: bool = False
    bf16_full_eval: bool = False
    warmup_steps: float = 0
    world_size: int = 1
    save_on_each_node: bool = False
    auto_find_batch_size: bool = False

    def get_warmup_steps(self, num_training_steps: int) -> int:
        return int(self.warmup_steps) if self.warmup_steps >= 1 else math.ceil(num_training_steps * self.warmup_steps)


def _get(cfg, path: str):
    obj = cfg
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


ALL_AUTO = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
}


@pytest.mark.parametrize(
    "args, kwargs, path, expected",
    [
        (FakeArgs(per_device_train_batch_size=4), {}, "train_micro_batch_size_per_gpu", 4),
        (FakeArgs(gradient_accumulation_steps=3), {}, "gradient_accumulation_steps", 3),
        (FakeArgs(per_device_train_batch_size=4, gradient_accumulation_steps=3, world_size=2), {},
         "train_batch_size", 24),
        (FakeArgs(per_device_train_batch_size=4, gradient_accumulation_steps=3, world_size=2),
         {"world_size": 8}, "train_batch_size", 96),
        (FakeArgs(max_grad_norm=0.3), {}, "gradient_clipping", 0.3),
        (FakeArgs(fp16=True), {}, "fp16.enabled", True),
        (FakeArgs(fp16_full_eval=True), {}, "fp16.enabled", True),
        (FakeArgs(), {}, "fp16.enabled", False),
        (FakeArgs(bf16=True), {}, "bf16.enabled", True),
        (FakeArgs(learning_rate=3e-4), {}, "optimizer.lr", 3e-4),
        (FakeArgs(adam_beta1=0.8, adam_beta2=0.95), {}, "optimizer.betas", (0.8, 0.95)),
        (FakeArgs(adam_epsilon=1e-6), {}, "optimizer.eps", 1e-6),
        (FakeArgs(weight_decay=0.1), {}, "optimizer.weight_decay", 0.1),
        (FakeArgs(learning_rate=3e-4), {}, "scheduler.params.warmup_max_lr", 3e-4),
        (FakeArgs(), {}, "scheduler.params.warmup_min_lr", 0.0),
        (FakeArgs(), {"num_training_steps": 500}, "scheduler.params.total_num_steps", 500),
        (FakeArgs(warmup_steps=0.1), {"num_training_steps": 500}, "scheduler.params.warmup_num_steps", 50),
        (FakeArgs(warmup_steps=20), {"num_training_steps": 500}, "scheduler.params.warmup_num_steps", 20),
        # transformers keeps it positive: deepspeed>=0.19.6 rejects 0
        (FakeArgs(warmup_steps=0), {"num_training_steps": 500}, "scheduler.params.warmup_num_steps", 1),
        (None, {"model_config": SimpleNamespace(hidden_size=64)}, "zero_optimization.reduce_bucket_size", 4096),
        (None, {"model_config": SimpleNamespace(hidden_size=64)}, "zero_optimization.prefetch_bucket_size", 3686),
        (None, {"model_config": SimpleNamespace(hidden_size=64)},
         "zero_optimization.param_persistence_threshold", 640),
        (None, {"model_config": SimpleNamespace(hidden_sizes=[32, 96, 64])},
         "zero_optimization.reduce_bucket_size", 9216),
        (None, {"model_config": {"text_config": {"hidden_size": 10}}}, "zero_optimization.reduce_bucket_size", 100),
    ],
)
def test_auto_table(args, kwargs, path, expected) -> None:
    cfg = resolve_auto(parse_config(ALL_AUTO), training_args=args, **kwargs)
    assert _get(cfg, path) == expected
    assert type(_get(cfg, path)) is type(expected)


def test_everything_resolves_with_args_model_and_steps() -> None:
    cfg = resolve_auto(parse_config(ALL_AUTO), training_args=FakeArgs(), model_config=SimpleNamespace(hidden_size=8),
                       num_training_steps=10)
    assert cfg.unresolved() == []


def test_without_arguments_auto_stays() -> None:
    cfg = resolve_auto(parse_config(ALL_AUTO))
    assert "optimizer.lr" in cfg.unresolved() and "train_batch_size" in cfg.unresolved()
    # warmup_min_lr is not a Trainer argument: 0 always
    assert cfg.scheduler.params.warmup_min_lr == 0.0


def test_resolve_is_pure() -> None:
    parsed = parse_config(ALL_AUTO)
    resolved = resolve_auto(parsed, training_args=FakeArgs())
    assert parsed.optimizer.lr == AUTO and resolved.optimizer.lr == 5e-5
    assert resolved is not parsed and resolved.source == parsed.source


def test_mismatches_are_collected_and_name_both_sides(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}')
    with pytest.raises(ZeroConfigError) as info:
        load_config(path, FakeArgs(per_device_train_batch_size=2, learning_rate=2e-5))
    problems = info.value.problems
    assert len(problems) == 2
    assert problems[0] == (f'{path}: train_micro_batch_size_per_gpu=4 but --per_device_train_batch_size=2; '
                           'set it to "auto" or make them equal')
    assert f"{path}: optimizer.params.lr=0.001 but --learning_rate=2e-05" in problems[1]
    assert str(info.value).startswith("2 problems")


def test_train_batch_size_mismatch_names_the_product() -> None:
    with pytest.raises(ZeroConfigError) as info:
        load_config({"train_batch_size": 64, "train_micro_batch_size_per_gpu": "auto"},
                    FakeArgs(per_device_train_batch_size=4, gradient_accumulation_steps=2), world_size=2)
    assert ("train_batch_size=64 but world_size x --per_device_train_batch_size x "
            "--gradient_accumulation_steps = 2 x 4 x 2 = 16") in str(info.value)


def test_numbers_compare_as_numbers() -> None:
    cfg = load_config({"train_micro_batch_size_per_gpu": "8", "gradient_clipping": "1",
                       "optimizer": {"type": "Adam", "params": {"betas": ["0.9", 0.999], "lr": "5e-5"}}},
                      FakeArgs(per_device_train_batch_size=8))
    assert cfg.train_micro_batch_size_per_gpu == 8 and cfg.optimizer.lr == 5e-5


def test_absent_keys_follow_transformers() -> None:
    # Optimizer and clipping keys absent from the file keep DeepSpeed's defaults and are not compared...
    cfg = load_config({"optimizer": {"type": "AdamW"}}, FakeArgs(learning_rate=3e-4, max_grad_norm=1.0))
    assert cfg.optimizer.lr == 1e-3 and cfg.gradient_clipping == 0.0
    # ...batch sizes and precision take the Trainer's values (accelerate adds missing precision sections).
    cfg = load_config({}, FakeArgs(per_device_train_batch_size=4, gradient_accumulation_steps=2, bf16=True,
                                   world_size=3))
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps, cfg.train_batch_size) == (4, 2, 24)
    assert cfg.compute_dtype_name == "bf16"


def test_explicit_precision_mismatch() -> None:
    with pytest.raises(ZeroConfigError, match=r"fp16.enabled=false but --fp16=true"):
        load_config({"fp16": {"enabled": False}}, FakeArgs(fp16=True))


def test_fp16_and_bf16_both_on_after_resolving() -> None:
    with pytest.raises(ZeroConfigError, match="both true after resolving"):
        load_config({"fp16": {"enabled": True}, "bf16": {"enabled": "auto"}}, FakeArgs(bf16=True))


def test_auto_find_batch_size_does_not_insist_on_the_micro_batch() -> None:
    cfg = load_config({"train_micro_batch_size_per_gpu": 16}, FakeArgs(per_device_train_batch_size=8,
                                                                        auto_find_batch_size=True))
    assert cfg.train_micro_batch_size_per_gpu == 16


def test_save_on_each_node_uses_node_local_storage() -> None:
    assert load_config({}, FakeArgs(save_on_each_node=True)).checkpoint.use_node_local_storage is True


def test_explicit_warmup_is_compared() -> None:
    with pytest.raises(ZeroConfigError, match=r"scheduler.params.warmup_num_steps=100 but --warmup_steps"):
        load_config({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}}},
                    FakeArgs(warmup_steps=10), num_training_steps=1000)


def test_hidden_size_missing_is_an_error_naming_the_keys() -> None:
    with pytest.raises(ZeroConfigError) as info:
        load_config(SEEDS / "openmind_zero3_basic.json", model=SimpleNamespace(config=SimpleNamespace(vocab_size=3)))
    message = str(info.value)
    assert "zero_optimization.stage3_prefetch_bucket_size" in message and "neither hidden_size" in message


def test_model_with_config_attribute_or_config_object() -> None:
    module_like = SimpleNamespace(config=SimpleNamespace(hidden_size=16))
    assert load_config(SEEDS / "openmind_zero3_basic.json", model=module_like).zero_optimization \
        .reduce_bucket_size == 256
    assert load_config(SEEDS / "openmind_zero3_basic.json", model=SimpleNamespace(hidden_size=16)) \
        .zero_optimization.param_persistence_threshold == 160
    assert hidden_size_of(None) is None


def test_load_config_accepts_a_parsed_config() -> None:
    parsed = parse_config(ALL_AUTO)
    assert load_config(parsed, FakeArgs(learning_rate=1e-4)).optimizer.lr == 1e-4


# ---------------------------------------------------------------------- batch arithmetic (DeepSpeed)
def test_train_batch_size_arithmetic_error_without_args() -> None:
    with pytest.raises(ZeroConfigError) as info:
        load_config({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
                    world_size=2)
    assert ("train_batch_size=30 but train_micro_batch_size_per_gpu x gradient_accumulation_steps x "
            "world_size = 4 x 2 x 2 = 16") in str(info.value)


@pytest.mark.parametrize(
    "raw, world_size, expected",
    [
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"}, 2,
         (32, 4, 4)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
        ({"train_batch_size": 32}, 4, (32, 8, 1)),
        ({"train_micro_batch_size_per_gpu": 4}, 4, (16, 4, 1)),
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, None, (32, 4, AUTO)),
        ({"train_micro_batch_size_per_gpu": "auto"}, 2, (None, AUTO, 1)),
    ],
)
def test_batch_sizes_derived_like_deepspeed(raw, world_size, expected) -> None:
    cfg = load_config(raw, world_size=world_size)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expected


def test_indivisible_train_batch_size_is_an_error() -> None:
    with pytest.raises(ZeroConfigError, match="train_batch_size=30 but"):
        load_config({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, world_size=2)


# ---------------------------------------------------------------------- real TrainingArguments
def test_real_training_arguments(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=3,
        learning_rate=2e-5, weight_decay=0.01, adam_beta2=0.98, adam_epsilon=1e-7, max_grad_norm=0.5,
        report_to="none",
        # a warmup ratio: transformers 5 reads warmup_steps < 1 as one, 4.x has warmup_ratio for it
        **({"warmup_steps": 0.1} if int(transformers.__version__.split(".")[0]) >= 5 else {"warmup_ratio": 0.1}),
    )
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=32))
    cfg = load_config([SEEDS / "openmind_zero3_full.json", SEEDS / "openmind_scheduler.json"], args, model,
                      num_training_steps=50)
    assert cfg.unresolved() == []
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (2, 3)
    assert cfg.train_batch_size == args.world_size * 2 * 3
    assert cfg.gradient_clipping == 0.5
    assert cfg.bf16.enabled is False
    opt = cfg.optimizer
    assert (opt.lr, opt.betas, opt.eps, opt.weight_decay) == (2e-5, (0.9, 0.98), 1e-7, 0.01)
    p = cfg.scheduler.params
    assert (p.warmup_min_lr, p.warmup_max_lr, p.total_num_steps) == (0.0, 2e-5, 50)
    assert p.warmup_num_steps == args.get_warmup_steps(50) == 5
    z = cfg.zero_optimization
    assert (z.reduce_bucket_size, z.prefetch_bucket_size, z.param_persistence_threshold) == (1024, 921, 320)

    with pytest.raises(ZeroConfigError, match=r"train_micro_batch_size_per_gpu=4 but --per_device_train_batch_size=2"):
        load_config({"train_micro_batch_size_per_gpu": 4}, args)


def test_unrelated_mismatch_does_not_hide_the_batch_arithmetic() -> None:
    with pytest.raises(ZeroConfigError) as info:
        load_config({"train_batch_size": 100, "gradient_clipping": 2.0},
                    FakeArgs(per_device_train_batch_size=4, world_size=2, max_grad_norm=1.0))
    problems = info.value.problems
    assert len(problems) == 2
    assert "gradient_clipping=2.0 but --max_grad_norm=1.0" in problems[1]
    assert "train_batch_size=100 but world_size x --per_device_train_batch_size x" in problems[0]


def test_batch_mismatch_is_reported_once() -> None:
    with pytest.raises(ZeroConfigError) as info:
        load_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
                    FakeArgs(per_device_train_batch_size=2, gradient_accumulation_steps=2, world_size=2))
    problems = info.value.problems
    # the micro batch contradicts the Trainer; the total (2 x 2 x 2 = 8) contradicts 16 as well
    assert len(problems) == 2
    assert "train_micro_batch_size_per_gpu=4 but --per_device_train_batch_size=2" in problems[0]
    assert "= 2 x 2 x 2 = 8" in problems[1]
