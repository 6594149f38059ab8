"""The engine in one process (no launcher): start-up report and the DeepSpeed-style loop."""

from __future__ import annotations

import logging

import pytest
import torch

import hf_zero


def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))


def test_no_effect_keys_reported_once_at_start_up(monkeypatch):
    records = []

    class Catch(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Catch()
    logger = logging.getLogger("hf_zero")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)  # setLevel, not the attribute: it clears logging's level cache
    try:
        cfg = {"zero_optimization": {"stage": 2, "round_robin_gradients": True}, "wall_clock_breakdown": True,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "train_micro_batch_size_per_gpu": 2}
        engine = hf_zero.initialize(_tiny(), cfg)
        ids = torch.randint(0, 64, (2, 8))
        for _ in range(2):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert sum("round_robin_gradients" in w for w in warnings) == 1
    assert sum("wall_clock_breakdown" in w for w in warnings) == 1
    assert any("ZeRO stage 2" in r.getMessage() for r in records if r.levelno == logging.INFO)
    assert engine.global_steps == 2


def test_unresolved_auto_without_training_args_is_an_error():
    cfg = {"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": "auto",
           "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    with pytest.raises(hf_zero.ZeroConfigError, match="auto") as err:
        hf_zero.initialize(_tiny(), cfg)
    assert "optimizer.lr" in str(err.value) or "lr" in str(err.value)
    assert "training_args" in str(err.value)
