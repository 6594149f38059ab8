"""Run under torchrun: train a tiny Llama with ``optimizer.type: "Muon"`` at each ZeRO stage.

    torchrun --standalone --nproc_per_node 2 tests/distributed/muon_worker.py OUT.pt CHECKPOINT_DIR

Writes (rank 0) ``{case: {"final_state", "ranks": [per-rank facts about the optimizer state]},
"resume": {stage: largest weight difference between a run and its resumed copy},
"direct": {name: final weight of a hand-built DTensor parameter}}``;
``test_muon_sharded.py`` holds the cases, the model and the single-process reference.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from _worker_io import save_results_and_exit  # noqa: E402
from test_muon_sharded import (  # noqa: E402
    CASES, DIRECT, MOMENTUM, MUON_LR, STEPS, WD, direct_data, make_data, muon_config, tiny_llama,
)


def _train(engine, steps) -> None:
    data = make_data(engine.env.world_size)
    for step in steps:
        ids = data[step, engine.env.rank].to(engine.env.device)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()


def _full_state(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.float().clone() for k, v in full.items()}


def run_case(zero: dict) -> dict:
    import hf_zero

    model = tiny_llama()
    engine = hf_zero.initialize(model, muon_config(zero))
    rank, world = engine.env.rank, engine.env.world_size
    _train(engine, range(STEPS))

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
    full = _full_state(model)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, facts)
    return {"final_state": full if rank == 0 else None, "ranks": per_rank}


def resume_difference(stage: int, folder: str) -> float | None:
    """Train 1 step, save a checkpoint, train 2 more; load it into a fresh engine and train the same
    2 steps: the largest weight difference (Muon's momentum and Adam's moments must come back)."""
    import hf_zero
    from hf_zero.checkpoint.sharded import load_checkpoint, save_checkpoint

    model = tiny_llama()
    engine = hf_zero.initialize(model, muon_config({"stage": stage}))
    _train(engine, [0])
    save_checkpoint(engine, folder)
    _train(engine, [1, 2])
    straight = _full_state(model)
    model = tiny_llama()
    engine = hf_zero.initialize(model, muon_config({"stage": stage}))
    load_checkpoint(engine, folder)
    _train(engine, [1, 2])
    resumed = _full_state(model)
    if dist.get_rank() != 0:
        return None  # the full state is gathered on rank 0 only
    return max(float((straight[k] - resumed[k]).abs().max()) for k in straight)


def direct_case() -> dict:
    """MuonWithAuxAdam on DTensor parameters made here (no engine): each rank's result, gathered."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from hf_zero.optim import MuonWithAuxAdam

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    init, grads = direct_data()
    params = {k: torch.nn.Parameter(distribute_tensor(init[k], mesh, [Shard(dim)])) for k, (_, dim) in DIRECT.items()}
    opt = MuonWithAuxAdam([{"params": list(params.values()), "use_muon": True}], lr=MUON_LR, momentum=MOMENTUM,
                          weight_decay=WD, ns_method="standard")
    for g in grads:
        for k, p in params.items():
            p.grad = distribute_tensor(g[k], mesh, [Shard(DIRECT[k][1])])
        opt.step()
    return {k: p.full_tensor().clone() for k, p in params.items()}


def main() -> None:
    from tests.strict_collectives import install_from_env

    install_from_env()  # HF_ZERO_STRICT_COLLECTIVES=1 (tests/distributed/_launch.py sets it by default)
    out, checkpoints = sys.argv[1], sys.argv[2]
    results = {name: run_case(zero) for name, zero in CASES.items()}
    results["direct"] = direct_case()
    results["resume"] = {stage: resume_difference(stage, os.path.join(checkpoints, f"stage{stage}"))
                         for stage in (1, 2, 3)}
    save_results_and_exit(results, out)


if __name__ == "__main__":
    main()
