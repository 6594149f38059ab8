"""torchrun worker: fp16 overflow on ONE rank must skip the step on every rank.

    torchrun --standalone --nproc_per_node 2 tests/distributed/overflow_worker.py STAGE OUT.json
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from _models import make_data, tiny_model  # noqa: E402


def main() -> None:
    import hf_zero
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    stage, out = int(sys.argv[1]), sys.argv[2]
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage},
        "fp16": {"enabled": True, "initial_scale_power": 10, "hysteresis": 1, "loss_scale_window": 100},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 10, "warmup_type": "linear"}},
    }
    model = tiny_model("llama")
    engine = hf_zero.initialize(model, cfg)
    rank = engine.env.rank
    data = make_data(3, 1, 2, 2, 16)
    record = []
    for step in range(3):
        ids = data[step, 0, rank]
        loss = engine(input_ids=ids, labels=ids).loss
        if step == 1 and rank == 1:
            loss = loss * float("inf")  # only this rank's gradients overflow
        before = {k: v.clone() for k, v in get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()}
        engine.backward(loss)
        engine.step()
        after = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        changed = any(not torch.equal(before[k], after[k]) for k in before)
        record.append({"lr": engine.get_lr()[0], "scale": engine.loss_scale, "skipped": engine.skipped_steps,
                       "global_steps": engine.global_steps, "weights_changed": changed,
                       "grad_norm": engine.get_global_grad_norm()})
    gathered = [None, None]
    dist.all_gather_object(gathered, record)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    from hf_zero.distributed.env import exit_cleanly

    exit_cleanly(0)


if __name__ == "__main__":
    main()
