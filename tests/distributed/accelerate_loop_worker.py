"""One Accelerator training loop, run plainly (accelerate's own DDP) or handed to hf_zero.

    torchrun --nproc_per_node 2 accelerate_loop_worker.py plain OUT
    torchrun --nproc_per_node 2 accelerate_loop_worker.py zero OUT CASES_JSON
    python accelerate_loop_worker.py resume OUT CASE_JSON STATE_DIR    (1 process, from a 2-rank save_state)

The loop is what accelerate's examples write: prepare(model, optimizer, dataloader, scheduler),
``accumulate``, ``backward``, ``clip_grad_norm_`` at sync steps, optimizer/scheduler step,
``gather_for_metrics`` of the loss, ``unwrap_model`` + ``get_state_dict`` + ``save_pretrained``,
``save_state`` after step ``SAVE_AT``. The script is the same in every mode; only the zero mode
calls ``use_hf_zero_accelerator`` first. Each rank builds its model from its own seed: both
accelerate's DDP and hf_zero start from rank 0's weights.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _models import tiny_model  # noqa: E402

STEPS, GAS, MICRO, SEQ, SAVE_AT = 4, 2, 2, 12, 2
SAMPLES = STEPS * GAS * MICRO * 2  # two ranks' worth


def _data():
    g = torch.Generator().manual_seed(99)
    ids = torch.randint(0, 128, (SAMPLES, SEQ), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def _collate(rows):
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def train(out_dir: str, *, micro: int = MICRO, constant_lr: bool = False, resume_from: str | None = None) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    accelerator = Accelerator(gradient_accumulation_steps=GAS)
    set_seed(1000 + accelerator.process_index)  # ranks differ: rank 0's weights must win everywhere
    model = tiny_model("llama", seed=accelerator.process_index)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    decay = (lambda step: 1.0) if constant_lr else (lambda step: max(0.1, 1.0 - step / 20))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, decay)
    loader = torch.utils.data.DataLoader(_data(), batch_size=micro, shuffle=False, collate_fn=_collate)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    start = 0
    if resume_from:
        accelerator.load_state(resume_from)
        start = SAVE_AT
        loader = accelerator.skip_first_batches(loader, SAVE_AT * GAS)
    losses, lrs = [], []
    step = start
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            losses.append(float(accelerator.gather_for_metrics(loss.detach()[None]).mean()))
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            lrs.append(scheduler.get_last_lr()[0])
            if step == SAVE_AT and not resume_from:
                accelerator.save_state(os.path.join(out_dir, "state"))
        if step == STEPS:
            break
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(os.path.join(out_dir, "model"), is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save, state_dict=accelerator.get_state_dict(model))
    accelerator.wait_for_everyone()
    return {"losses": losses, "lrs": lrs}


def main() -> None:
    from tests.strict_collectives import install_from_env

    install_from_env()  # HF_ZERO_STRICT_COLLECTIVES=1 (tests/distributed/_launch.py sets it by default)
    mode, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    if mode == "plain":
        result = {"plain": train(os.path.join(out, "plain"))}
    elif mode == "zero":
        from hf_zero.accelerate_support import use_hf_zero_accelerator

        result = {}
        for case in json.loads(open(sys.argv[3]).read()):
            use_hf_zero_accelerator(case["config"])
            result[case["name"]] = train(os.path.join(out, case["name"]), constant_lr=case.get("constant_lr", False))
    elif mode == "resume":  # one process continues a 2-rank run: same global batch (2 x MICRO)
        from hf_zero.accelerate_support import use_hf_zero_accelerator

        case = json.loads(open(sys.argv[3]).read())
        use_hf_zero_accelerator(case["config"])
        result = {"resumed": train(os.path.join(out, "resumed"), micro=2 * MICRO, constant_lr=True,
                                   resume_from=sys.argv[4])}
    else:
        raise SystemExit(f"unknown mode {mode}")
    if rank == 0:
        with open(os.path.join(out, f"{mode}.json"), "w") as f:
            json.dump(result, f)
    from hf_zero.distributed.env import exit_cleanly

    exit_cleanly(0)


if __name__ == "__main__":
    main()
