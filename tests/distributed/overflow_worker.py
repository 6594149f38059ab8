"""torchrun worker: fp16 overflows on 2 ranks, with and without an offloaded optimizer.

    torchrun --standalone --nproc_per_node 2 tests/distributed/overflow_worker.py STAGE OUT.pt NVME_DIR

* ``lm``: a (nan) overflow on ONE rank must skip the step on every rank; the same run with the optimizer
  offloaded to cpu must skip the same steps and end at the same weights.
* ``regression``: transformers' regression model (tests/fp16_regression.py) with 8 samples per rank
  per step, as 8 x 1 and as 2 x 4 micro-batches (the latter with the optimizer offloaded too).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from _models import make_data, tiny_model  # noqa: E402
from offload_worker import full_state  # noqa: E402


def _offload(zero: dict, offload: str, nvme: str) -> dict:
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload, "nvme_path": nvme}
    return zero


def _lm_run(stage: int, offload: str, nvme: str) -> dict:
    import hf_zero
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": _offload({"stage": stage}, offload, nvme),
        "fp16": {"enabled": True, "initial_scale_power": 10, "hysteresis": 1, "loss_scale_window": 100},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 10, "warmup_type": "linear"}},
    }
    model = tiny_model("llama")
    engine = hf_zero.initialize(model, cfg)
    rank = engine.env.rank
    data = make_data(3, 1, 2, 2, 16)
    start_lr = engine.get_lr()[0]
    record = []
    for step in range(3):
        ids = data[step, 0, rank]
        loss = engine(input_ids=ids, labels=ids).loss
        if step == 0 and rank == 1:
            # Only this rank's gradients overflow, at the first step (where the default initial
            # scale 2**16 overflows almost every fp16 run) and to nan (as fp16 overflows usually
            # end: inf - inf in a softmax), which the reduction spreads to every rank's shard.
            loss = loss * float("nan")
        before = {k: v.clone() for k, v in get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()}
        engine.backward(loss)
        engine.step()
        after = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        changed = any(not torch.equal(before[k], after[k]) for k in before)
        record.append({"lr": engine.get_lr()[0], "scale": engine.loss_scale, "skipped": engine.skipped_steps,
                       "global_steps": engine.global_steps, "weights_changed": changed,
                       "grad_norm": engine.get_global_grad_norm()})
    weights = full_state(engine)  # the fp32 masters, also offloaded ones
    engine.close()
    gathered = [None, None]
    dist.all_gather_object(gathered, record)
    return {"records": gathered, "start_lr": start_lr, "weights": weights}


def _regression_run(stage: int, batch: int, accumulation: int, offload: str, nvme: str) -> dict:
    import hf_zero
    from tests.fp16_regression import RegressionModel, train_hf_zero, zero_config

    torch.manual_seed(0)
    engine = hf_zero.initialize(RegressionModel(), zero_config(stage, batch, accumulation, offload, nvme))
    try:
        return train_hf_zero(engine)
    finally:
        engine.close()


def main() -> None:
    from tests.strict_collectives import install_from_env

    install_from_env()  # HF_ZERO_STRICT_COLLECTIVES=1 (tests/distributed/_launch.py sets it by default)
    stage, out, nvme = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    # (NVMe offload takes the same gradient path; one process covers it: tests/unit/test_fp16_skips.py)
    lm = {offload: _lm_run(stage, offload, nvme) for offload in ("none", "cpu")}
    regression = {f"{offload}-{batch}x{accumulation}": _regression_run(stage, batch, accumulation, offload, nvme)
                  for offload, batch, accumulation in (("none", 8, 1), ("none", 2, 4), ("cpu", 2, 4))}
    if dist.get_rank() == 0:
        torch.save({"stage": stage, "lm": lm, "regression": regression}, out)
    dist.barrier()
    from hf_zero.distributed.env import exit_cleanly

    exit_cleanly(0)


if __name__ == "__main__":
    main()
