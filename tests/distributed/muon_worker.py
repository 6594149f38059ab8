"""Run under torchrun: train a tiny Llama with ``optimizer.type: "Muon"`` at each ZeRO stage.

    torchrun --standalone --nproc_per_node 2 tests/distributed/muon_worker.py OUT.pt

Writes (rank 0) ``{case: {"final_state", "ranks": [per-rank facts about the optimizer state]}}``;
``test_muon_sharded.py`` holds the cases, the model and the single-process reference.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from _worker_io import save_results_and_exit  # noqa: E402
from test_muon_sharded import CASES, STEPS, make_data, muon_config, tiny_llama  # noqa: E402


def run_case(zero: dict) -> dict:
    import hf_zero
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = tiny_llama()
    engine = hf_zero.initialize(model, muon_config(zero))
    rank, world = engine.env.rank, engine.env.world_size
    data = make_data(world)
    for step in range(STEPS):
        ids = data[step, rank].to(engine.env.device)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    local = engine.stage.local_optimizer(engine.optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    momentum = {}
    for group in local.param_groups:
        for p in group["params"]:
            buf = local.state.get(p, {}).get("momentum_buffer")
            if buf is not None:
                shard = buf.to_local() if hasattr(buf, "to_local") else buf
                momentum[names[id(p)]] = (group["use_muon"], shard.numel(), p.numel())
    facts = {"optimizer": type(local).__name__, "momentum": momentum,
             "adam_params": sorted(names[id(p)] for g in local.param_groups if not g["use_muon"] for p in g["params"])}
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    per_rank = [None] * world
    dist.all_gather_object(per_rank, facts)
    return {
        "final_state": {k: v.float().clone() for k, v in full.items()} if rank == 0 else None,
        "ranks": per_rank,
    }


def main() -> None:
    results = {name: run_case(zero) for name, zero in CASES.items()}
    save_results_and_exit(results, sys.argv[1])


if __name__ == "__main__":
    main()
