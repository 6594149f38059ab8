"""The tiny Qwen2 checkpoint and token data the in-process Trainer tests share."""

from __future__ import annotations

import logging

import torch
from datasets import Dataset

from _run import REPO

TINY = REPO / "assets" / "tiny-qwen2"
"""A 2-layer Qwen2 (hidden 64) with its tokenizer, made by scripts/make_tiny_assets.py."""


def token_dataset(n: int = 16, seq: int = 16, seed: int = 11) -> Dataset:
    """``n`` random sequences of ``seq`` token ids (labels = inputs), the same for a given seed."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (n, seq), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def make_trainer(tmp_path, stage, *, model=None, seq2seq=False, zero=None, trainer_kwargs=None, **arguments):
    """A Trainer over the tiny Qwen2 (or ``model``) and 16 random sequences: transformers' own when
    ``stage`` is None, else hf_zero's with ``{"zero_optimization": {"stage": stage}}`` (plus
    ``zero``). ``arguments`` override the training arguments, ``trainer_kwargs`` the Trainer's."""
    from transformers import (AutoModelForCausalLM, Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer,
                              TrainingArguments)

    from hf_zero import ZeroSeq2SeqTrainer, ZeroSeq2SeqTrainingArguments, ZeroTrainer, ZeroTrainingArguments

    logging.getLogger("transformers").setLevel(logging.ERROR)
    options = dict(output_dir=str(tmp_path / f"out-{stage}"), per_device_train_batch_size=4, max_steps=3,
                   logging_steps=1, report_to="none", save_strategy="no", learning_rate=1e-3, seed=3,
                   use_cpu=True, disable_tqdm=True)
    options.update(arguments)
    trainer_kwargs = dict(trainer_kwargs or {})
    trainer_kwargs.setdefault("train_dataset", token_dataset())
    if model is None and "model_init" not in trainer_kwargs:
        model = AutoModelForCausalLM.from_pretrained(TINY)
    if stage is None:
        args_cls, trainer_cls = (Seq2SeqTrainingArguments, Seq2SeqTrainer) if seq2seq else (TrainingArguments, Trainer)
        args = args_cls(**options)
    else:
        args_cls, trainer_cls = (ZeroSeq2SeqTrainingArguments, ZeroSeq2SeqTrainer) if seq2seq else (ZeroTrainingArguments, ZeroTrainer)
        args = args_cls(zero_config={"zero_optimization": {"stage": stage}, **(zero or {})}, **options)
    return trainer_cls(model=model, args=args, **trainer_kwargs)
