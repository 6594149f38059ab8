"""The tiny Qwen2 checkpoint and token data the in-process Trainer tests share."""

from __future__ import annotations

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
