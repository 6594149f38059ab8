"""Which parameters low-memory loading treats as offloaded (engine/rank0_shards.py): FSDP2 keeps its
units' parameter groups under torch-private names that changed in torch 2.12, and a silent miss
would put offloaded shards in accelerator memory on a GPU run."""

from __future__ import annotations

import torch

import hf_zero
from hf_zero.engine.rank0_shards import _offloaded_params


def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1))


def test_parameter_offload_units_are_found_on_this_torch():
    cfg = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}, "train_micro_batch_size_per_gpu": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine = hf_zero.initialize(_tiny(), cfg)
    model = engine.forward_module
    assert _offloaded_params(model) == {id(p) for p in model.parameters()}


def test_no_offload_no_ids():
    cfg = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    assert _offloaded_params(hf_zero.initialize(_tiny(), cfg).forward_module) == set()
