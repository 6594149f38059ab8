"""One rank of a 2-rank ZeroTrainer run resuming a DeepSpeed checkpoint (a committed fixture).

Usage (under torchrun): deepspeed_resume_worker.py CASE STAGE OUT_JSON [fail_on_rank1]

The arguments are those of scripts/make_deepspeed_fixtures.py's DeepSpeed run (the same data,
schedule and clipping, 4 samples per step: 2 ranks x batch 2, or 4 ranks x batch 1); rank 0 writes
the logged losses to OUT_JSON. With ``fail_on_rank1`` rank 1 cannot read DeepSpeed's files (an
injected OSError) and every rank writes the error it raised to OUT_JSON.rankN.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

DATA = Path(__file__).resolve().parents[1] / "unit" / "data" / "deepspeed_checkpoints"


def dist_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def main(case: str, stage: int, out: str, fail_on_rank1: bool = False) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_zero import ZeroTrainer, ZeroTrainingArguments
    from tests.strict_collectives import install_from_env

    install_from_env()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    info = json.loads((DATA / case / "MANIFEST.json").read_text())
    ids = torch.randint(3, info["model_config"]["vocab_size"], (info["steps"] * 4, 8),
                        generator=torch.Generator().manual_seed(11))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = ZeroTrainingArguments(
        output_dir=os.path.join(os.path.dirname(out), "run"), per_device_train_batch_size=4 // dist_world(), max_steps=info["steps"],
        save_strategy="no", logging_steps=1, learning_rate=3e-2, weight_decay=0.01, warmup_steps=1,
        lr_scheduler_type="linear", seed=7, report_to="none", disable_tqdm=True, use_cpu=True,
        bf16=info["dtype"] == "bf16", zero_config={"zero_optimization": {"stage": stage}, "gradient_clipping": 1.0})
    torch.manual_seed(123 + int(os.environ.get("RANK", "0")))  # ranks build different weights: all are replaced
    model = GPT2LMHeadModel(GPT2Config(**info["model_config"]))
    if info["dtype"] == "bf16":
        model.transformer.wpe.weight.requires_grad_(False)
    trainer = ZeroTrainer(model=model, args=args, train_dataset=data)
    if fail_on_rank1:
        from hf_zero.checkpoint.deepspeed_files.fp32_weights import DeepSpeedWeights

        def unreadable(self, *args, **kwargs):
            raise OSError("injected: rank 1 cannot read the rank files")

        if dist.get_rank() == 1:
            DeepSpeedWeights.read = unreadable
        try:
            trainer.train(resume_from_checkpoint=str(DATA / case / f"checkpoint-{info['save_steps']}"))
            raised = None
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
            raised = {"type": type(exc).__name__, "message": str(exc)}
        Path(f"{out}.rank{dist.get_rank()}").write_text(json.dumps(raised))
        return
    trainer.train(resume_from_checkpoint=str(DATA / case / f"checkpoint-{info['save_steps']}"))
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps([e["loss"] for e in trainer.state.log_history if "loss" in e]))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], fail_on_rank1=sys.argv[4:] == ["fail_on_rank1"])
