"""Tiny models and deterministic data shared by the 2-rank workers and the 1-process references."""

from __future__ import annotations

import torch

VOCAB = 128


def tiny_model(kind: str, seed: int = 0):
    """A randomly initialised 2-layer causal LM (hidden 64); same weights for the same seed.

    ``qwen2_tied`` ties input and output embeddings; ``llama`` does not; ``qwen2_moe`` has MoE blocks;
    ``llama_odd`` has first dimensions no shard group divides (vocabulary 131, MLP 125): padded shards.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen2MoeConfig

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    if kind == "qwen2_tied":
        cfg = Qwen2Config(tie_word_embeddings=True, **common)
    elif kind == "llama":
        cfg = LlamaConfig(tie_word_embeddings=False, **common)
    elif kind == "llama_odd":
        cfg = LlamaConfig(tie_word_embeddings=False, **{**common, "vocab_size": VOCAB + 3, "intermediate_size": 125})
    elif kind == "qwen2_moe":
        cfg = Qwen2MoeConfig(
            tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=64, **common,
        )
    else:
        raise ValueError(kind)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")


def make_data(steps: int, gas: int, world: int, micro: int, seq: int, seed: int = 1234) -> torch.Tensor:
    """Token ids shaped (steps, gas, world, micro, seq): rank r at micro-step k of step s reads
    ``data[s, k, r]``; the 1-process reference reads ``data[s, k]`` flattened over ranks."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (steps, gas, world, micro, seq), generator=g)
