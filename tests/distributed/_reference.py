"""The single-process reference: plain PyTorch, no hf_zero engine, same seed and global batch.

Precision semantics mirror each sharding family (see ``hf_zero/precision/policy.py``):
stages 0/1 run the forward under autocast on fp32 parameters; stages 2/3 compute with parameters
cast to 16 bit (``functional_call`` on ``p.to(dtype)``, whose backward returns fp32 gradients, as
FSDP2's mixed precision does). fp16 multiplies the loss by the engine's initial loss scale.
"""

from __future__ import annotations


import torch
from torch.func import functional_call

from _cases import LR, Case
from _drift_bound import adam_step_drift, assert_within, gradient_noise
from _models import make_data, tiny_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# How close a run must come to the reference, per dtype: (loss rtol, grad-norm rtol, weight
# deviation relative to the update size, :func:`update_deviation`). fp32 runs are also checked entry
# by entry within the drift bound (``_drift_bound.py``).
TOLERANCE = {"fp32": (1e-5, 1e-4, 1e-4), "bf16": (2e-3, 5e-2, 5e-2), "fp16": (1e-3, 2e-2, 2e-2)}


def update_deviation(state: dict, ref: dict) -> float:
    """|w_run - w_ref| / |w_ref - w_initial| over all weights (``ref``: :func:`reference_run`'s)."""
    num = sum(float(((state[k] - ref["final_state"][k]) ** 2).sum()) for k in ref["final_state"])
    den = sum(float(((ref["final_state"][k] - ref["initial_state"][k]) ** 2).sum()) for k in ref["final_state"])
    return (num / den) ** 0.5


def assert_matches_reference(got: dict, ref: dict, case: Case) -> None:
    """A run's losses, gradient norms and final weights (``parity_worker``'s result) against the
    reference's, to :data:`TOLERANCE`; fp32 weights entry by entry within the drift bound."""
    loss_rtol, norm_rtol, weight_tol = TOLERANCE[case.dtype]
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=loss_rtol, atol=0)
    torch.testing.assert_close(got["grad_norms"], ref["grad_norms"], rtol=norm_rtol, atol=0)
    assert set(got["final_state"]) == set(ref["final_state"])
    assert update_deviation(got["final_state"], ref) < weight_tol
    if case.dtype == "fp32":  # entry by entry, within what reduction order explains (_drift_bound.py)
        for name, tensor in ref["final_state"].items():
            assert_within(got["final_state"][name], tensor, ref["drift"].get(name, 0.0), name, case.steps)
    assert all(r["sharding"]["global_steps"] == case.steps for r in got["ranks"])


def reference_run(case: Case, world: int = 2) -> dict:
    from hf_zero.optim.schedulers import build_scheduler
    from hf_zero.config import load_config

    model = tiny_model(case.model)
    dtype = DTYPES[case.dtype]
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    cfg = load_config(case.zero_config(), world_size=world)
    sched = build_scheduler(cfg.scheduler, opt) if cfg.scheduler else None
    scale = 2.0**8 if case.dtype == "fp16" else 1.0
    data = make_data(case.steps, case.gas, world, case.micro, case.seq)
    losses, lrs, norms = [], [], []
    drift = {n: torch.zeros_like(p) for n, p in params.items()}  # what reduction order may move (fp32)
    for step in range(case.steps):
        total = 0.0
        for k in range(case.gas):
            ids = data[step, k].reshape(world * case.micro, case.seq)
            if dtype == torch.float32:
                out = model(input_ids=ids, labels=ids)
            elif case.stage in (0, 1):
                with torch.autocast("cpu", dtype=dtype):
                    out = model(input_ids=ids, labels=ids)
            else:
                cast = {n: p.to(dtype) for n, p in params.items()}
                out = functional_call(model, cast, args=(), kwargs={"input_ids": ids, "labels": ids}, tie_weights=True)
            (out.loss.float() / case.gas * scale).backward()
            total += float(out.loss.detach())
        if scale != 1.0:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(1.0 / scale)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip if case.clip > 0 else float("inf"))
        norms.append(float(norm))
        lr, delta = opt.param_groups[0]["lr"], gradient_noise(p.grad for p in params.values())
        opt.step()
        for n, p in params.items():
            state = opt.state[p]
            drift[n] += adam_step_drift(state["exp_avg_sq"], int(state["step"]), lr, (0.9, 0.999), 1e-8, delta)
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / case.gas)
        lrs.append(opt.param_groups[0]["lr"])
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    opt_bytes = sum(
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0
    )
    initial = {k: v.detach().float().clone() for k, v in tiny_model(case.model).state_dict().items()}
    by_id = {id(p): n for n, p in params.items()}  # a tied weight has two keys and one parameter
    drift = {k: drift[by_id[id(v)]] for k, v in model.state_dict(keep_vars=True).items() if id(v) in by_id}
    return {"losses": losses, "lrs": lrs, "grad_norms": norms, "final_state": state, "initial_state": initial,
            "optimizer_state_bytes": opt_bytes, "drift": drift}
