"""Trainer options that only show on more than one rank, each run by transformers' own Trainer (plain
DDP) and by ZeroTrainer in the same torchrun launch (one launch, one start-up, for all of them):

- ``average_tokens_across_devices`` False (stages 0-3) and its default True (stage 0). The labels
  mask a different number of tokens on each rank, so the two settings train differently.
- ``--optim galore_adamw`` with ``optim_target_modules`` (stages 2, 3), where galore_torch is
  installed: GaLore's projection (an SVD of each gradient) meets a DTensor shard there.
- a submodule called directly after ``train()`` (stages 0, 1; the plain Trainer's model allows it).
- a model with 0-dim parameters (``_scalar_model.py``) with the config's ``optimizer`` section
  (AdamW at stage 2, Lamb at stage 3 with ``offload_optimizer``), against DDP with the same update
  over ``model.parameters()``: how often the optimizer holds and stepped each parameter, and the
  scalars read on every rank after ``train()`` (only rank 0 holds the element of a 1-element shard).

    torchrun --nproc_per_node 2 two_rank_options.py OUT_DIR

Each run saves its model (``save_model``) and state (``save_state``) under OUT_DIR/<run>; rank 0
writes OUT_DIR/result.json with the submodule outputs, the errors runs raised and the scalar runs'
counts and reads (one entry per rank).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from hf_zero.engine.sharded_optimizer import ShardedOptimizerError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # integration_tests/: the shared helpers
from _scalar_model import SCALARS, scalar_dataset, scalar_model, update_counts  # noqa: E402
from _tiny import make_trainer  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "assets" / "tiny-qwen2"
GALORE = dict(optim="galore_adamw", optim_target_modules=["q_proj", "v_proj"],
              optim_args="rank=4, update_proj_gap=2, scale=0.25")


def masked_dataset(n: int = 16, seq: int = 16) -> Dataset:
    """Random sequences whose labels mask a random prefix (1 to 13 tokens), as a prompt would be:
    the label-token count differs between ranks' batches."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, 500, (n, seq), generator=g)
    labels = ids.clone()
    for row, masked in zip(labels, torch.randint(1, seq - 2, (n,), generator=g)):
        row[: int(masked)] = -100
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def train(out: Path, name: str, stage: int | None, **options):
    """Train the tiny Qwen2 3 steps (2 ranks x 2 sequences x 2 accumulation steps); ``stage`` None is
    the plain Trainer. Saves the model and the state under out/name."""
    arguments = dict(output_dir=str(out / name), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     learning_rate=2e-3, max_grad_norm=1.0)
    arguments.update(options)
    model = AutoModelForCausalLM.from_pretrained(TINY)
    trainer = make_trainer(out, stage, model=model, trainer_kwargs={"train_dataset": masked_dataset()}, **arguments)
    trainer.train()
    trainer.save_model()
    trainer.save_state()
    return model


def submodule_outputs(model) -> dict:
    """What a user gets from calling parts of the trained model directly (no gathering)."""
    ids = torch.tensor([[5, 17, 42, 99]])
    with torch.no_grad():
        embedded = model.get_input_embeddings()(ids)
        mlp = model.model.layers[0].mlp(embedded)
    return {"embedding": embedded.tolist(), "mlp": mlp.tolist()}


def train_scalar_model(out: Path, name: str, kind: str, stage: int | None, offload: str = "none") -> dict:
    """The 0-dim-parameter model 4 steps (2 ranks x 8 rows): DDP (``stage`` None) with the ``kind``
    update built over ``model.parameters()``, or ZeroTrainer with the config's optimizer section.
    Returns this rank's update counts and scalar reads after ``train()``; saves the state (losses)."""
    from transformers import Trainer, TrainingArguments

    from hf_zero import ZeroTrainer, ZeroTrainingArguments
    from hf_zero.optim import Lamb

    options = dict(output_dir=str(out / name), per_device_train_batch_size=8, max_steps=4, logging_steps=1,
                   report_to="none", save_strategy="no", learning_rate=5e-2, weight_decay=0.01, seed=3,
                   use_cpu=True, disable_tqdm=True)
    model = scalar_model()
    if stage is None:
        make = {"AdamW": lambda ps: torch.optim.AdamW(ps, lr=5e-2, weight_decay=0.01),
                "Lamb": lambda ps: Lamb(ps, lr=5e-2, weight_decay=0.01)}[kind]
        trainer = Trainer(model=model, args=TrainingArguments(**options), train_dataset=scalar_dataset(),
                          optimizers=(make(model.parameters()), None))
    else:
        zero = {"stage": stage, **({"offload_optimizer": {"device": offload}} if offload != "none" else {})}
        cfg = {"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto",
               "optimizer": {"type": kind, "params": {"lr": "auto", "weight_decay": "auto"}}}
        trainer = ZeroTrainer(model=model, args=ZeroTrainingArguments(zero_config=cfg, **options),
                              train_dataset=scalar_dataset())
    trainer.train()
    trainer.save_state()
    reads = {n: getattr(trainer.model, n).item() for n in SCALARS}  # every rank reads, as a script does
    reads["a.tolist"] = trainer.model.a.tolist()
    return {**update_counts(trainer), "reads": reads}


def main() -> None:
    out = Path(sys.argv[1])
    logging.getLogger("transformers").setLevel(logging.ERROR)
    result: dict = {"submodule": {}, "errors": {}}

    plain = train(out, "ddp_per_rank", None, average_tokens_across_devices=False)
    result["submodule"]["ddp"] = submodule_outputs(plain)
    for stage in (0, 1, 2, 3):
        model = train(out, f"s{stage}_per_rank", stage, average_tokens_across_devices=False)
        if stage <= 1:
            result["submodule"][f"s{stage}"] = submodule_outputs(model)

    train(out, "ddp_default", None)
    train(out, "s0_default", 0)

    if importlib.util.find_spec("galore_torch") is None:  # not a test dependency: runs where installed
        stage_runs = ()
    else:
        train(out, "ddp_galore", None, **GALORE)
        stage_runs = (2, 3)
    for stage in stage_runs:
        try:
            train(out, f"s{stage}_galore", stage, **GALORE)
        except ShardedOptimizerError as err:
            result["errors"][f"s{stage}_galore"] = str(err)

    result["scalar"] = {}
    for name, kind, stage, offload in (("ddp_scalar_adamw", "AdamW", None, "none"), ("s2_scalar_adamw", "AdamW", 2, "none"),
                                       ("ddp_scalar_lamb", "Lamb", None, "none"), ("s3_scalar_lamb_offload", "Lamb", 3, "cpu")):
        try:
            mine = train_scalar_model(out, name, kind, stage, offload)
        except Exception as err:  # noqa: BLE001 - recorded, so that only the scalar tests fail
            mine = {"error": f"{type(err).__name__}: {err}"}
        per_rank = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(per_rank, mine)
        result["scalar"][name] = per_rank

    if torch.distributed.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
