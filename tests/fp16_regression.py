"""transformers' regression test (y = a*x + b) under fp16, and DeepSpeed's fp16 rules in plain torch.

The reference for hf_zero's overflow skips, one process (tests/unit/test_fp16_skips.py) and two
ranks (tests/distributed/overflow_worker.py). DeepSpeed keeps the fp16 gradients of every micro-step
in one fp16 sum (``data_types.grad_accum_dtype`` defaults to the model dtype at every ZeRO stage,
offloaded or not) and checks that sum for inf/nan once, at the accumulation boundary; at stage 3
each rank's gradient is divided by the world size in fp16 before the reduce-scatter sums it
(``reduce_scatter_coalesced``). :func:`deepspeed_fp16_reference` is that, written out; in one
process it reproduces DeepSpeed 0.19.8's own run (:data:`DEEPSPEED`) to the last bit.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

LR = 0.1
STEPS = 8  # the default initial_scale_power 16 overflows the first four (hysteresis 2 eats one)
SKIPPED = [0, 1, 2, 3]
SCALES = [2.0**16, 2.0**15, 2.0**14, 2.0**13] + [2.0**13] * (STEPS - 4)

# DeepSpeed 0.19.8 (deepspeed.initialize, torch AdamW(lr=0.1, weight_decay=0), fp16 defaults,
# gradient_clipping 0, one CPU process on gloo), the same at ZeRO stages 1, 2 and 3: steps 0-3
# skipped at the scales of SCALES, and these fp32 masters at the end.
DEEPSPEED = {
    (16, 1): {"a": 0.3706865608692169, "b": 0.3955685794353485},
    (4, 4): {"a": 0.37070614099502563, "b": 0.3955514430999756},
}

# How far an implementation that skips DeepSpeed's steps may land from its weights. The first
# update after the skips moves each weight by exactly lr (Adam's first step is lr * sign(g)). The
# other three are lr * m/sqrt(v), a ratio of gradients: a relative error delta in every gradient
# moves it by at most 2 * delta * |m/sqrt(v)|, and |m/sqrt(v)| <= 1.01 within four Adam steps
# (Cauchy-Schwarz over its averaging weights; 2 below leaves room). delta: hf_zero's gradients
# differ from the reference's by at most five fp16 roundings (2**-11 each): the 16-bit weights and
# inputs of the forward, the output gradient, the per-sample product, the sum, and the cross-rank
# sum; hf_zero's fp32 sums over micro-steps and ranks skip the reference's. At stages 0/1 this
# model's forward is fp32 under autocast and skips all of them. One update more or less moves a
# weight by ~lr, over 30x the bound.
DELTA = 5 * 2.0**-11
TOL = 3 * LR * 2 * DELTA * 2


class RegressionModel(nn.Module):
    """transformers' ``tests/trainer/test_trainer.py`` RegressionModel, with 1-element parameters
    (DeepSpeed cannot broadcast 0-dim fp16 parameters; 0-dim ones have their own tests)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(1))
        self.b = nn.Parameter(torch.zeros(1))

    def forward(self, input_x, labels):
        y = input_x * self.a + self.b
        return nn.functional.mse_loss(y, labels)


def regression_data() -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' RegressionDataset (a=2, b=3, 64 samples, seed 42), twice: 8 steps of 16."""
    np.random.seed(42)
    x = np.random.normal(size=(64,)).astype(np.float32)
    y = (2 * x + 3 + np.random.normal(scale=0.1, size=(64,))).astype(np.float32)
    return torch.tensor(x).repeat(2), torch.tensor(y).repeat(2)


def micro_batch(step: int, micro: int, rank: int, batch: int, accumulation: int, world: int) -> slice:
    """The samples a rank reads at one micro-step: every step reads the next batch * accumulation *
    world samples, so runs of the same effective batch see the same samples in each step."""
    start = ((step * accumulation + micro) * world + rank) * batch
    return slice(start, start + batch)


def deepspeed_fp16_reference(batch: int, accumulation: int, world: int = 1, forward: torch.dtype = torch.float16) -> dict:
    """Plain torch, DeepSpeed's fp16 rules: fp32 masters, an fp16 model copy, each rank's gradient
    divided by ``world`` and summed over ranks in fp16, micro-steps summed in fp16, the sum
    checked once per step, DynamicLossScaler(2**16, hysteresis 2), AdamW(lr, no decay).

    ``forward=torch.float32``: the same rules for a forward that runs in fp32 (hf_zero's stages 0/1
    run it under autocast, which leaves this model's elementwise ops in fp32): gradients and their
    sums in fp32, and a step overflows when a sum is past what fp16 can hold. In one process the
    two agree; over ranks a rank's own fp16 gradient can overflow where the mean fits."""
    x, y = regression_data()
    master = [torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)]
    opt = torch.optim.AdamW(master, lr=LR, weight_decay=0.0)
    scale, hysteresis = 2.0**16, 2
    skipped, scales = [], []
    for step in range(STEPS):
        model = [m.detach().to(forward).requires_grad_() for m in master]
        total = [torch.zeros(1, dtype=forward) for _ in master]
        for micro in range(accumulation):
            reduced = [torch.zeros(1, dtype=forward) for _ in master]
            for rank in range(world):
                s = micro_batch(step, micro, rank, batch, accumulation, world)
                loss = nn.functional.mse_loss(x[s].to(forward) * model[0] + model[1], y[s].to(forward))
                grads = torch.autograd.grad(loss.float() / accumulation * scale, model)
                reduced = [r + g / world for r, g in zip(reduced, grads)]
            total = [t + r for t, r in zip(total, reduced)]  # in fp16: it overflows as one sum
        if not all(bool(torch.isfinite(t.half()).all()) for t in total):
            skipped.append(step)
            if hysteresis == 1:
                scale /= 2
            else:
                hysteresis -= 1
        else:  # (no growth: the 1000-step window is never reached here)
            for m, t in zip(master, total):
                m.grad = t.float() / scale
            opt.step()
            opt.zero_grad()
        scales.append(scale)
    return {"skipped": skipped, "scales": scales, "a": float(master[0].detach()), "b": float(master[1].detach())}


def zero_config(stage: int, batch: int, accumulation: int, offload: str, nvme_path: str) -> dict:
    """The DeepSpeed config of these runs (fp16 with its defaults)."""
    zero: dict = {"stage": stage}
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload, "pin_memory": True, "nvme_path": nvme_path}
    return {"zero_optimization": zero, "fp16": {"enabled": True}, "train_micro_batch_size_per_gpu": batch,
            "gradient_accumulation_steps": accumulation,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}}


def train_hf_zero(engine) -> dict:
    """DeepSpeed's loop (``step()`` after every micro-batch) over :func:`regression_data` on an
    hf_zero engine; the skipped steps, the scale after each step and the final fp32 weights (every
    rank must call it)."""
    from hf_zero.distributed.collectives import on_mesh_device

    x, y = regression_data()
    rank, world = engine.env.rank, engine.env.world_size
    batch, accumulation = engine.config.train_micro_batch_size_per_gpu, engine.gradient_accumulation_steps
    skipped, scales = [], []
    for step in range(STEPS):
        for micro in range(accumulation):
            s = micro_batch(step, micro, rank, batch, accumulation, world)
            engine.backward(engine(x[s].to(engine.env.device), y[s].to(engine.env.device)))
            engine.step()
        if engine.last_step_skipped:
            skipped.append(step)
        scales.append(engine.loss_scale)
    weights = {}
    for name, value in engine.state_dict()["module"].items():  # the fp32 masters, also offloaded ones
        value = on_mesh_device(value).full_tensor() if hasattr(value, "full_tensor") else value
        weights[name] = float(value.reshape(-1)[0])
    return {"skipped": skipped, "scales": scales, **weights}
