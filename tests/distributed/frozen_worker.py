"""Run under torchrun (2 ranks): frozen second models beside a trained one, at stages 0-3.

For each stage: a policy engine (``hf_zero.initialize``) and a reference model built as a user's
would be on each rank (stage 3: rank 1 on the meta device, as low-memory loading builds it; other
stages: rank 1 with other random weights), prepared with ``hf_zero.prepare_frozen_model``. Rank 0
writes, per stage: the reference's logits on each rank's batch, its parameter bytes on each rank,
whether its parameters require grad, the policy's and reference's full weights before and after a
TR-DPO-style sync written as TRL writes it, and the logits after that sync.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from _models import VOCAB, tiny_model

ALPHA = 0.25


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().cpu().clone()


def logits_then_a_policy_step(engine, ref, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen reference's logits on this rank's batch, then one training step of the policy
    (so that a later sync mixes two different models): ``(ids, logits)``."""
    g = torch.Generator().manual_seed(3 + rank)
    ids = torch.randint(0, VOCAB, (2, 12), generator=g)
    with torch.no_grad():
        logits = ref(input_ids=ids).logits.float()
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return ids, logits


def _local_bytes(model) -> int:
    return sum((p.to_local() if hasattr(p, "to_local") else p).untyped_storage().nbytes() for p in model.parameters())


def run_stage(stage: int, dtype: str) -> dict:
    import hf_zero

    rank = dist.get_rank()
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": dtype == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    engine = hf_zero.initialize(tiny_model("llama", seed=1), cfg)
    if stage == 3 and rank == 1:
        with torch.device("meta"):
            ref = tiny_model("llama", seed=2)
    else:
        ref = tiny_model("llama", seed=2 if rank == 0 else 5)
    ref = hf_zero.prepare_frozen_model(ref, cfg)
    ids, logits = logits_then_a_policy_step(engine, ref, rank)
    policy = engine.module.module if hasattr(engine.module, "module") else engine.module
    before = {"ref": [_full(p) for p in ref.parameters()], "policy": [_full(p) for p in policy.parameters()]}
    # TRL's SyncRefModelCallback._sync_target_model, as TRL writes it.
    for target_param, copy_param in zip(ref.parameters(), policy.parameters(), strict=True):
        target_param.data.mul_(1.0 - ALPHA).add_(copy_param.data, alpha=ALPHA)
    after = [_full(p) for p in ref.parameters()]
    with torch.no_grad():
        synced_logits = ref(input_ids=ids).logits.float()
    engine.close()
    return {
        "ids": ids, "logits": logits, "synced_logits": synced_logits, "bytes": _local_bytes(ref),
        "requires_grad": any(p.requires_grad for p in ref.parameters()), "training": ref.training,
        "before": before, "after": after,
    }


def main() -> None:
    from tests.strict_collectives import install_from_env

    install_from_env()  # HF_ZERO_STRICT_COLLECTIVES=1 (tests/distributed/_launch.py sets it by default)
    from hf_zero.distributed.env import init_distributed

    init_distributed()
    out = sys.argv[1]
    results = {}
    for stage, dtype in ((0, "fp32"), (1, "bf16"), (2, "fp32"), (3, "fp32"), (3, "bf16")):
        mine = run_stage(stage, dtype)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        results[f"s{stage}-{dtype}"] = everyone
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, meta_at_stage1())
    results["meta-s1"] = everyone
    if dist.get_rank() == 0:
        torch.save(results, out)


def meta_at_stage1() -> str | None:
    """Rank 1 built the model on the meta device at a stage that replicates it: every rank must
    raise (none may wait in the broadcasts); returns this rank's error message."""
    import hf_zero

    if dist.get_rank() == 1:
        with torch.device("meta"):
            model = tiny_model("llama", seed=2)
    else:
        model = tiny_model("llama", seed=2)
    try:
        hf_zero.prepare_frozen_model(model, {"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 2})
    except ValueError as exc:
        return str(exc)
    return None


if __name__ == "__main__":
    main()
