"""A reward function for GRPO runs in the tests (TRL's ``--reward_funcs module.function``)."""

from __future__ import annotations


def distinct_words(completions: list, **kwargs) -> list[float]:
    """More distinct words, more reward: varies between completions of a tiny random model."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(len(set(t.split()))) for t in texts]
