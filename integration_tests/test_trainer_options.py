"""Trainer options under ``ZeroTrainer`` against the plain ``Trainer`` with the same options, in one
process: each run below is made twice, once by transformers alone (the reference) and once under a
zero config, same seed, data and arguments; losses, learning rates, metrics, predictions, files and
callback events must agree. Options hf_zero cannot honour are refused with a message, tested too.

Multi-rank behaviour of the same code paths is covered by the 2-rank parity and resume tests; here
the point is the Trainer's option surface (docs/trainer_features.md lists each row and its test).
"""

from __future__ import annotations

import importlib.util
import json
import logging

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    EarlyStoppingCallback,
    TrainerCallback,
)

import hf_zero
from hf_zero import ZeroTrainer
from hf_zero.engine.sharded_optimizer import ShardedOptimizerError

from _tiny import TINY, make_trainer, token_dataset

# In one process, but about 80 Trainer runs (~1.5 min): outside the quick subset.
pytestmark = pytest.mark.slow
STAGES = [0, 1, 2, 3]


def history(trainer, key="loss"):
    return [h[key] for h in trainer.state.log_history if key in h]


def weights(trainer):
    with hf_zero.gathered_parameters(trainer.model) as module:
        return {n: p.detach().clone().float() for n, p in module.named_parameters()}


def assert_same_training(got, expected, rtol=2e-5):
    """Same number of logged steps, losses and learning rates equal to ``rtol``."""
    assert len(history(got)) == len(history(expected)) > 0
    torch.testing.assert_close(history(got), history(expected), rtol=rtol, atol=0)
    torch.testing.assert_close(history(got, "learning_rate"), history(expected, "learning_rate"), rtol=1e-6, atol=1e-12)


def _reference_and(tmp_path, stage, **kwargs):
    reference = make_trainer(tmp_path, None, **kwargs)
    reference.train()
    zero = make_trainer(tmp_path, stage, **kwargs)
    zero.train()
    return reference, zero


def assert_stages_train_like_the_plain_trainer(tmp_path, stages, **kwargs):
    """One plain run, then one run per stage, each compared with it (the reference is made once)."""
    reference = make_trainer(tmp_path, None, **kwargs)
    reference.train()
    for stage in stages:
        zero = make_trainer(tmp_path, stage, **kwargs)
        zero.train()
        assert_same_training(zero, reference)
    return reference


# ----------------------------------------------------------------------------------- schedulers
SCHEDULERS = {
    "cosine": {},
    "cosine_with_restarts": {"lr_scheduler_kwargs": {"num_cycles": 2}},
    "polynomial": {"lr_scheduler_kwargs": {"power": 2.0, "lr_end": 1e-5}},
    "constant": {},
    "constant_with_warmup": {},
    "inverse_sqrt": {},
    "cosine_with_min_lr": {"lr_scheduler_kwargs": {"min_lr_rate": 0.1}},
    "cosine_warmup_with_min_lr": {"lr_scheduler_kwargs": {"min_lr_rate": 0.1}},
    "warmup_stable_decay": {"lr_scheduler_kwargs": {"num_decay_steps": 2, "min_lr_ratio": 0.1}},
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_scheduler_types(tmp_path, name):
    # Each type is transformers' own scheduler (a LambdaLR), built on the engine's optimizer by
    # Trainer.create_scheduler and stepped by the engine the same way whatever its type. What differs
    # by stage is how the rate reaches the optimizer: stage 0 steps whole parameters, stage 1 copies
    # it into its partitioned optimizer's groups, stage 3 steps DTensor shards. So every type runs at
    # stage 3 (the layout furthest from the plain Trainer's) and the three paths run once, with cosine
    # (20 runs instead of 36; the metric-driven schedulers have their own tests below).
    stages = [0, 1, 3] if name == "cosine" else [3]
    reference = assert_stages_train_like_the_plain_trainer(tmp_path, stages, lr_scheduler_type=name, warmup_steps=1,
                                                           max_steps=5, **SCHEDULERS[name])
    assert len(set(history(reference, "learning_rate"))) > 1 or name == "constant"


def test_greedy_scheduler_steps_on_the_eval_metric(tmp_path):
    """``greedy`` (transformers' GreedyLR) takes the eval loss, like plateau: the loop steps it."""
    reference = assert_stages_train_like_the_plain_trainer(
        tmp_path, [0, 1, 3], lr_scheduler_type="greedy", max_steps=5, eval_strategy="steps", eval_steps=1,
        lr_scheduler_kwargs={"patience": 0, "factor": 0.5, "min_lr": 1e-5, "max_lr": 1e-2, "threshold": 1e-4},
        trainer_kwargs={"eval_dataset": token_dataset(n=4, seed=2)})
    assert len(set(history(reference, "learning_rate"))) > 1


# ----------------------------------------------------------------------------------- optimizers
# --optim values that run here with what the test environment installs; each must give the plain
# Trainer's losses at every stage where it can run. The extras are skipped where not installed.
OPTIMS = {
    "adamw_torch": None, "adamw_torch_fused": None, "sgd": None, "adagrad": None, "rmsprop": None,
    "schedule_free_adamw": "schedulefree", "schedule_free_radam": "schedulefree", "schedule_free_sgd": "schedulefree",
    "stable_adamw": "optimi",
}
# Optimizers that step whole parameters only (factored statistics, custom kernels): stages 0/1.
WHOLE_PARAMETER_OPTIMS = {"adafactor": None, "adamw_torch_4bit": "torchao", "adamw_8bit": "bitsandbytes",
                          "lion_32bit": "bitsandbytes"}


def _needs(module):
    if module is not None and importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")


@pytest.mark.parametrize("optim", sorted(OPTIMS))
def test_optim_choices(tmp_path, optim):
    _needs(OPTIMS[optim])
    assert_stages_train_like_the_plain_trainer(tmp_path, STAGES, optim=optim)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("optim", sorted(WHOLE_PARAMETER_OPTIMS))
def test_whole_parameter_optimizers_at_stages_0_1_and_a_clear_error_at_2_3(tmp_path, optim, stage):
    _needs(WHOLE_PARAMETER_OPTIMS[optim])
    if stage >= 2:
        with pytest.raises(ShardedOptimizerError, match=f"stage {stage}.*stage 1"):
            make_trainer(tmp_path, stage, optim=optim).train()
        return
    reference, zero = _reference_and(tmp_path, stage, optim=optim)
    assert_same_training(zero, reference)


@pytest.mark.parametrize("stage", STAGES)
def test_grokadamw_and_its_refusal_where_each_rank_steps_a_reordered_subset(tmp_path, stage):
    _needs("grokadamw")
    if stage == 1:
        with pytest.raises(ValueError, match="grokadamw at ZeRO stage 1.*position in the group"):
            make_trainer(tmp_path, stage, optim="grokadamw")
        return
    reference, zero = _reference_and(tmp_path, stage, optim="grokadamw")
    assert_same_training(zero, reference)
    if stage == 0:
        return  # no optimizer offload at stage 0
    with pytest.raises(ValueError, match="with offload_optimizer"):
        make_trainer(tmp_path, stage, optim="grokadamw", zero={"zero_optimization": {
            "stage": stage, "offload_optimizer": {"device": "cpu"}}})


def test_galore_with_target_modules(tmp_path):
    _needs("galore_torch")
    assert_stages_train_like_the_plain_trainer(tmp_path, STAGES, optim="galore_adamw", optim_target_modules=["q_proj", "v_proj"],
                                               optim_args="rank=4, update_proj_gap=2, scale=0.25")


@pytest.mark.parametrize("stage", STAGES)
def test_apollo_at_stage_0_and_its_refusal_elsewhere(tmp_path, stage):
    """APOLLO seeds each parameter's projection with its position in the group (state filled at
    construction, which hf_zero once took for a stepped optimizer): the plain Trainer's training at
    stage 0, a refusal naming stage 0 at the stages where ranks step reordered subsets (1) or
    DTensor shards (2/3; its step fails there: aten.mm got mixed torch.Tensor and DTensor)."""
    _needs("apollo_torch")
    kwargs = dict(optim="apollo_adamw", optim_target_modules=["q_proj", "v_proj"], optim_args="rank=4, update_proj_gap=2")
    if stage >= 1:
        with pytest.raises(ValueError, match=f"apollo_adamw at ZeRO stage {stage}: .*Use stage 0"):
            make_trainer(tmp_path, stage, **kwargs)
        return
    reference, zero = _reference_and(tmp_path, stage, **kwargs)
    assert_same_training(zero, reference)


@pytest.mark.parametrize("optim", ["lomo", "adalomo", "galore_adamw_layerwise"])
def test_in_backward_optimizers_are_refused(tmp_path, optim):
    with pytest.raises(ValueError, match=f"--optim {optim} updates each weight inside the backward pass"):
        make_trainer(tmp_path, 0, optim=optim, optim_target_modules=["q_proj"])


def test_optimizer_cls_and_kwargs(tmp_path):
    chosen = (torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9, "nesterov": True})
    assert_stages_train_like_the_plain_trainer(tmp_path, STAGES, trainer_kwargs={"optimizer_cls_and_kwargs": chosen})


def _optimizer_and_scheduler(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.5)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


@pytest.mark.parametrize("stage", STAGES)
def test_optimizer_and_scheduler_passed_in(tmp_path, stage):
    runs = []
    for s in (None, stage):
        model = AutoModelForCausalLM.from_pretrained(TINY)
        trainer = make_trainer(tmp_path, s, model=model, trainer_kwargs={"optimizers": _optimizer_and_scheduler(model)})
        trainer.train()
        runs.append(trainer)
    assert history(runs[0], "learning_rate") == [5e-2, 2.5e-2, 1.25e-2]
    assert_same_training(runs[1], runs[0])


def test_passed_optimizer_beside_a_config_optimizer_section_is_refused(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(TINY)
    section = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(ValueError, match=r"optimizers=\.\.\.\) was given an optimizer \(SGD\).*\"optimizer\" section"):
        make_trainer(tmp_path, 2, model=model, zero=section,
                     trainer_kwargs={"optimizers": (torch.optim.SGD(model.parameters(), lr=0.1), None)})
    with pytest.raises(ValueError, match="optimizer_cls_and_kwargs"):
        make_trainer(tmp_path, 2, zero=section, trainer_kwargs={"optimizer_cls_and_kwargs": (torch.optim.SGD, {"lr": 0.1})})
    with pytest.raises(ValueError, match=r"\"scheduler\" section"):
        make_trainer(tmp_path, 2, model=model, zero={"scheduler": {"type": "WarmupLR", "params": {}}},
                     trainer_kwargs={"optimizers": _optimizer_and_scheduler(model)})


def test_optim_beside_a_config_optimizer_section_is_logged(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_zero"):
        make_trainer(tmp_path, 0, optim="sgd", zero={"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    assert any("--optim sgd is not used" in r.getMessage() for r in caplog.records)


def test_fsdp_flag_is_refused_at_every_stage(tmp_path):
    from transformers.trainer_utils import FSDPOption

    for stage in (0, 3):
        trainer_args = make_trainer(tmp_path, stage).args
        # transformers refuses --fsdp itself in one process; a launched run gets past that check.
        trainer_args.fsdp, trainer_args.fsdp_config = [FSDPOption.FULL_SHARD], {}
        with pytest.raises(ValueError, match="--fsdp and --zero_config"):
            ZeroTrainer(model=AutoModelForCausalLM.from_pretrained(TINY), args=trainer_args, train_dataset=token_dataset())


# ----------------------------------------------------------------------------------- training options
def test_gradient_accumulation(tmp_path):
    assert_stages_train_like_the_plain_trainer(tmp_path, STAGES, per_device_train_batch_size=2, gradient_accumulation_steps=2)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_label_smoothing_and_tokens_seen(tmp_path, stage):
    reference, zero = _reference_and(tmp_path, stage, label_smoothing_factor=0.1, include_num_input_tokens_seen=True)
    plain = make_trainer(tmp_path, None)
    plain.train()
    assert abs(history(reference)[0] - history(plain)[0]) > 1e-4  # the smoothing changes the loss
    assert_same_training(zero, reference)
    assert zero.state.num_input_tokens_seen == reference.state.num_input_tokens_seen == 3 * 4 * 16


def _varying_lengths():
    from datasets import Dataset

    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(3, 500, (int(n),), generator=g).tolist() for n in torch.randint(4, 24, (16,), generator=g)]
    return Dataset.from_dict({"input_ids": rows, "labels": rows})


@pytest.mark.parametrize("stage", [0, 3])
def test_group_by_length_with_padding(tmp_path, stage):
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    kwargs = dict(train_sampling_strategy="group_by_length",
                  trainer_kwargs={"train_dataset": _varying_lengths(),
                                  "data_collator": DataCollatorForSeq2Seq(tokenizer, padding=True)})
    reference, zero = _reference_and(tmp_path, stage, **kwargs)
    assert_same_training(zero, reference)


@pytest.mark.parametrize("stage", [0, 3])
def test_bf16(tmp_path, stage):
    reference, zero = _reference_and(tmp_path, stage, bf16=True)
    # Mixed precision: the plain Trainer autocasts fp32 weights; hf_zero computes in bf16 with fp32
    # masters (as DeepSpeed); the same run to bf16 accuracy.
    assert_same_training(zero, reference, rtol=1e-2)


@pytest.mark.parametrize("stage", [0, 3])
def test_fp16(tmp_path, stage):
    reference, zero = _reference_and(tmp_path, stage, fp16=True)
    # the plain Trainer autocasts to fp16 with a grad scaler; hf_zero computes in fp16 with fp32
    # masters and its dynamic loss scale (DeepSpeed's fp16 section defaults)
    assert_same_training(zero, reference, rtol=1e-3)


@pytest.mark.parametrize("stage", [0, 3])
def test_torch_compile(tmp_path, stage):
    reference, zero = _reference_and(tmp_path, stage, torch_compile=True, torch_compile_backend="aot_eager")
    module = zero.model
    assert getattr(module, "_compiled_call_impl", None) is not None or any(
        getattr(m, "_compiled_call_impl", None) is not None for m in module.modules())
    assert_same_training(zero, reference, rtol=1e-4)


# ----------------------------------------------------------------------------------- evaluation
def _accuracy(prediction):
    logits, labels = prediction.predictions, prediction.label_ids
    predicted = logits.argmax(-1)[:, :-1]
    return {"accuracy": float((predicted == labels[:, 1:]).mean())}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_evaluate_before_training_metrics_and_predict(tmp_path, stage):
    runs = []
    for s in (None, stage):
        trainer = make_trainer(tmp_path, s, eval_strategy="steps", eval_steps=1, eval_accumulation_steps=1,
                               per_device_eval_batch_size=3,
                               trainer_kwargs={"eval_dataset": token_dataset(n=7, seed=2), "compute_metrics": _accuracy})
        before = trainer.evaluate()
        trainer.train()
        runs.append((trainer, before, trainer.predict(token_dataset(n=5, seed=4))))
    (reference, ref_before, ref_pred), (zero, before, pred) = runs
    torch.testing.assert_close(before["eval_loss"], ref_before["eval_loss"], rtol=1e-5, atol=0)
    assert before["eval_accuracy"] == ref_before["eval_accuracy"]
    assert_same_training(zero, reference)
    torch.testing.assert_close(history(zero, "eval_loss"), history(reference, "eval_loss"), rtol=2e-5, atol=0)
    assert history(zero, "eval_accuracy") == history(reference, "eval_accuracy")
    torch.testing.assert_close(torch.as_tensor(pred.predictions), torch.as_tensor(ref_pred.predictions), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pred.metrics["test_loss"], ref_pred.metrics["test_loss"], rtol=2e-5, atol=0)
    # the same metric names (an extra one changes transformers' default hyperparameter-search objective)
    assert set(zero.evaluate()) == set(reference.evaluate())
    assert set(pred.metrics) == set(ref_pred.metrics)


def _tiny_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=96, d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16,
                                               decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


def _pairs(n, seed):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    src = torch.randint(2, 96, (n, 8), generator=g)
    return Dataset.from_dict({"input_ids": src.tolist(), "labels": src.flip(1)[:, :6].tolist()})


@pytest.mark.parametrize("stage", [0, 3])
def test_predict_with_generate(tmp_path, stage):
    runs = []
    for s in (None, stage):
        trainer = make_trainer(tmp_path, s, model=_tiny_t5(), seq2seq=True, predict_with_generate=True,
                               generation_max_length=6, learning_rate=1e-2,
                               trainer_kwargs={"train_dataset": _pairs(16, 1)})
        trainer.train()
        runs.append((trainer, trainer.predict(_pairs(4, 9))))
    (reference, ref_pred), (zero, pred) = runs
    assert_same_training(zero, reference)
    assert pred.predictions.shape == ref_pred.predictions.shape
    assert (pred.predictions == ref_pred.predictions).all()


# ----------------------------------------------------------------------------------- checkpoints
def _checkpoints(path):
    return sorted(p.name for p in path.iterdir() if p.name.startswith("checkpoint-"))


@pytest.mark.parametrize("stage", [0, 3])
def test_resume_from_checkpoint_true_and_save_total_limit(tmp_path, stage):
    uninterrupted = make_trainer(tmp_path / "a", stage, max_steps=4)
    uninterrupted.train()
    first = make_trainer(tmp_path / "b", stage, max_steps=4, save_strategy="steps", save_steps=1, save_total_limit=2)
    first.train()
    out = tmp_path / "b" / f"out-{stage}"
    assert _checkpoints(out) == ["checkpoint-3", "checkpoint-4"]  # as the plain Trainer rotates
    (out / "checkpoint-4").rename(tmp_path / "moved")  # resume=True must find the newest left: 3
    resumed = make_trainer(tmp_path / "b", stage, max_steps=4, save_strategy="no")
    resumed.train(resume_from_checkpoint=True)
    assert history(resumed)[-1] == pytest.approx(history(uninterrupted)[-1], rel=1e-5)
    for name, value in weights(uninterrupted).items():
        torch.testing.assert_close(weights(resumed)[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [0, 3])
def test_save_only_model(tmp_path, stage):
    trainer = make_trainer(tmp_path, stage, save_strategy="steps", save_steps=3, save_only_model=True)
    trainer.train()
    checkpoint = tmp_path / f"out-{stage}" / "checkpoint-3"
    files = {p.name for p in checkpoint.iterdir()}
    assert "model.safetensors" in files and "trainer_state.json" in files
    assert not {"optimizer.pt", "scheduler.pt", "rng_state.pth"} & files
    zero_state = checkpoint / "zero_state"
    if zero_state.exists():  # stage 3 without a 16-bit gather keeps its weights there, model only
        marker = json.loads(next(zero_state.glob("*.json")).read_text())
        assert marker.get("model_only") is True
    reloaded = AutoModelForCausalLM.from_pretrained(checkpoint)
    for name, value in weights(trainer).items():
        torch.testing.assert_close(dict(reloaded.named_parameters())[name].float(), value, rtol=0, atol=0)
    again = make_trainer(tmp_path, stage, max_steps=4)
    with pytest.raises(ValueError, match="save_only_model"):
        again.train(resume_from_checkpoint=str(checkpoint))


def test_save_only_model_with_load_best_model_at_end_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--save_only_model with --load_best_model_at_end"):
        make_trainer(tmp_path, 2, save_only_model=True, load_best_model_at_end=True, eval_strategy="steps",
                     save_strategy="steps", trainer_kwargs={"eval_dataset": token_dataset(n=4, seed=2)})


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_load_best_model_at_end(tmp_path, stage):
    """``greater_is_better`` on eval_loss makes the *worst* step the best one, so the model loaded at
    the end is an earlier checkpoint's, not the last state."""
    runs = []
    for s in (None, stage):
        trainer = make_trainer(tmp_path, s, max_steps=4, eval_strategy="steps", eval_steps=1, save_strategy="steps",
                               save_steps=1, load_best_model_at_end=True, metric_for_best_model="eval_loss",
                               greater_is_better=True, learning_rate=5e-3,
                               trainer_kwargs={"eval_dataset": token_dataset(n=4, seed=2)})
        trainer.train()
        runs.append(trainer)
    reference, zero = runs
    assert zero.state.best_model_checkpoint.endswith(reference.state.best_model_checkpoint.split("/")[-1])
    assert not reference.state.best_model_checkpoint.endswith("checkpoint-4")
    expected = weights(reference)
    for name, value in weights(zero).items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)
    # and it is really the best checkpoint's, not the trained-on state
    after = zero.evaluate()["eval_loss"]
    assert after == pytest.approx(max(history(zero, "eval_loss")[:-1]), rel=1e-5)


@pytest.mark.parametrize("stage", [0, 3])
def test_early_stopping(tmp_path, stage):
    runs = []
    for s in (None, stage):
        trainer = make_trainer(tmp_path, s, max_steps=10, eval_strategy="steps", eval_steps=1, save_strategy="steps",
                               save_steps=1, load_best_model_at_end=True, metric_for_best_model="eval_loss",
                               greater_is_better=True, save_total_limit=1,
                               trainer_kwargs={"eval_dataset": token_dataset(n=4, seed=2),
                                               "callbacks": [EarlyStoppingCallback(early_stopping_patience=2)]})
        trainer.train()
        runs.append(trainer)
    reference, zero = runs
    assert reference.state.global_step < 10  # it stopped early
    assert zero.state.global_step == reference.state.global_step
    assert_same_training(zero, reference)


# ----------------------------------------------------------------------------------- callbacks
class Recorder(TrainerCallback):
    def __init__(self):
        self.events = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            events = object.__getattribute__(self, "events")

            def record(args, state, control, **kwargs):
                events.append((name, state.global_step))

            return record
        return object.__getattribute__(self, name)


@pytest.mark.parametrize("stage", [0, 3])
def test_callback_events_in_the_plain_trainers_order(tmp_path, stage):
    recorders = []
    for s in (None, stage):
        recorder = Recorder()
        trainer = make_trainer(tmp_path, s, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                               eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                               trainer_kwargs={"eval_dataset": token_dataset(n=4, seed=2), "callbacks": [recorder]})
        trainer.train()
        recorders.append(recorder.events)
    assert ("on_optimizer_step", 1) in recorders[0] and ("on_save", 2) in recorders[0]
    assert recorders[1] == recorders[0]


# ----------------------------------------------------------------------------------- hyperparameter search
@pytest.mark.parametrize("stage", [0, 3])
def test_hyperparameter_search_with_optuna(tmp_path, stage):
    optuna = pytest.importorskip("optuna")
    results = []
    for s in (None, stage):
        trainer = make_trainer(tmp_path, s, model=None, eval_strategy="no",
                               trainer_kwargs={"eval_dataset": token_dataset(n=4, seed=2),
                                               "model_init": lambda trial=None: AutoModelForCausalLM.from_pretrained(TINY)})
        best = trainer.hyperparameter_search(
            direction="minimize", backend="optuna", n_trials=3,
            hp_space=lambda trial: {"learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-2, log=True)},
            sampler=optuna.samplers.RandomSampler(seed=0),
        )
        results.append(best)
    reference, zero = results
    assert zero.hyperparameters == reference.hyperparameters
    assert zero.objective == pytest.approx(reference.objective, rel=2e-5)
