"""Run under torchrun: train each case with hf_zero on every rank and save what the tests compare.

    torchrun --standalone --nproc_per_node 2 tests/distributed/parity_worker.py CASES.json OUT.pt

Writes (rank 0) ``{case name: {"losses", "final_state", "lrs", "loss_scales", "skipped",
"memory" (one report per rank), "sharding" (per-rank facts about the tensors)}}``.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from _cases import Case  # noqa: E402
from _models import make_data, tiny_model  # noqa: E402
from _worker_io import save_results_and_exit  # noqa: E402


def run_case(case: Case) -> dict:
    import hf_zero
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    model = tiny_model(case.model)
    engine = hf_zero.initialize(model, case.zero_config())
    rank, world = engine.env.rank, engine.env.world_size
    data = make_data(case.steps, case.gas, world, case.micro, case.seq)
    losses, lrs, scales, norms = [], [], [], []
    for step in range(case.steps):
        total = torch.zeros(())
        for k in range(case.gas):
            ids = data[step, k, rank].to(engine.env.device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            total += loss.detach().float().cpu()
            if step == case.steps - 1 and k == case.gas - 1:
                memory = engine.memory_report()  # gradients still present before the last step
            engine.step()
        dist.all_reduce(total)
        losses.append(float(total) / (case.gas * world))
        lrs.append(engine.get_lr()[0])
        scales.append(engine.loss_scale)
        norms.append(engine.get_global_grad_norm())

    local = engine.stage.local_optimizer(engine.optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    sharding = {
        "dtensor_params": sum(isinstance(p, DTensor) for p in model.parameters()),
        "local_param_numel": sum(
            (p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters()
        ),
        "full_param_numel": sum(p.numel() for p in model.parameters()),
        "optimizer_param_names": sorted(names[id(p)] for g in local.param_groups for p in g["params"] if p in local.state),
        "global_steps": engine.global_steps,
        "skipped_steps": engine.skipped_steps,
    }
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"memory": memory, "sharding": sharding})
    return {
        "losses": losses,
        "lrs": lrs,
        "loss_scales": scales,
        "grad_norms": norms,
        "final_state": {k: v.float().clone() for k, v in full.items()} if rank == 0 else None,
        "ranks": per_rank,
    }


def main() -> None:
    from tests.strict_collectives import install_from_env

    install_from_env()  # HF_ZERO_STRICT_COLLECTIVES=1 (tests/distributed/_launch.py sets it by default)
    cases_path, out_path = sys.argv[1], sys.argv[2]
    with open(cases_path) as f:
        cases = [Case(**c) for c in json.load(f)]
    results = {}
    for case in cases:
        results[case.name] = run_case(case)
    save_results_and_exit(results, out_path)


if __name__ == "__main__":
    main()
