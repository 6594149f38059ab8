"""Run under torchrun: train models the way users bring them and save what the tests compare.

    torchrun --standalone --nproc_per_node 2 tests/distributed/user_weights_worker.py WORKDIR OUT.pt

Three kinds of run, each at stages 0-3:

- ``seeds``: every rank builds its model with its own seed (torch seeds each process randomly;
  a LoRA is often made before the Trainer seeds), fp32;
- ``bf16ckpt``: a bf16 checkpoint loaded with ``dtype="auto"``, trained with bf16 at lr 1e-6;
- ``lora``: a LoRA (made with a per-rank seed) on a bf16 base, trained without ``--bf16``.

Writes (rank 0) ``{run name: {"losses", "final" (full fp32 weights as the optimizer holds them),
"ranks": [per rank: {"param_bytes", "frozen_dtypes", "trainable_dtypes"}]}}``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from _models import make_data, tiny_model  # noqa: E402
from _worker_io import save_results_and_exit  # noqa: E402

STEPS, MICRO, SEQ = 3, 2, 16
LORA_TARGETS = ["q_proj", "v_proj"]


def zero_config(stage: int, lr: float, bf16: bool) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
    }


def full_weights(engine) -> dict[str, torch.Tensor]:
    """The weights the optimizer updates, whole, in fp32 (collective)."""
    state = engine.state_dict()["module"]
    out = {}
    for name, value in state.items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        out[name] = value.detach().float().cpu().clone()
    return out


def train(model, cfg: dict) -> dict:
    import hf_zero

    engine = hf_zero.initialize(model, cfg)
    rank, world = engine.env.rank, engine.env.world_size
    frozen = sorted({str(p.dtype) for p in model.parameters() if not p.requires_grad})
    trainable = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})
    data = make_data(STEPS, 1, world, MICRO, SEQ)
    losses = []
    for step in range(STEPS):
        ids = data[step, 0, rank]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        if step == 0:
            param_bytes = engine.memory_report()["params"]["accelerator"]
        engine.step()
        total = loss.detach().float().reshape(1)
        dist.all_reduce(total)
        losses.append(float(total) / world)
    final = full_weights(engine)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"param_bytes": param_bytes, "frozen_dtypes": frozen, "trainable_dtypes": trainable})
    engine.close()
    return {"losses": losses, "final": final, "ranks": per_rank}


def load_bf16(workdir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.join(workdir, "bf16"), dtype="auto")


def lora_on_bf16(workdir: str, seed: int):
    from peft import LoraConfig, get_peft_model

    model = load_bf16(workdir)
    torch.manual_seed(seed)
    # init_lora_weights="gaussian" makes B random too, so the LoRA changes the loss from step 1.
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights="gaussian"))


def main() -> None:
    from tests.strict_collectives import install_from_env

    install_from_env()  # HF_ZERO_STRICT_COLLECTIVES=1 (tests/distributed/_launch.py sets it by default)
    workdir, out_path = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 0 and not os.path.isdir(os.path.join(workdir, "bf16")):
        tiny_model("llama", seed=0).to(torch.bfloat16).save_pretrained(os.path.join(workdir, "bf16"))
    dist.barrier()
    results = {}
    for stage in range(4):
        # seed = rank: rank 1's model differs from rank 0's (and from the reference's seed-0 model).
        results[f"seeds-s{stage}"] = train(tiny_model("llama", seed=rank), zero_config(stage, 5e-3, bf16=False))
        results[f"bf16ckpt-s{stage}"] = train(load_bf16(workdir), zero_config(stage, 1e-6, bf16=True))
        results[f"lora-s{stage}"] = train(lora_on_bf16(workdir, seed=100 + rank), zero_config(stage, 5e-3, bf16=False))
    save_results_and_exit(results, out_path)


if __name__ == "__main__":
    main()
