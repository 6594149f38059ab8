"""Run under torchrun: checkpoint scenarios (16-bit export, sharded save/resume, interrupted saves).

    torchrun --standalone --nproc_per_node N tests/distributed/checkpoint_worker.py TASKS.json OUT.pt

``TASKS.json`` is a list of ``{"kind": ..., "name": ..., ...}``; rank 0 writes
``{name: result}`` to ``OUT.pt``. Every scenario trains on the same global batch of 4 sequences
per step whatever the world size (rank r of W reads rows r*4/W..(r+1)*4/W), so a run on 1 rank and
one on 2 ranks take the same steps and losses can be compared across world sizes.
"""

from __future__ import annotations

import faulthandler
import json
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from _cases import Case  # noqa: E402
from _models import make_data, tiny_model  # noqa: E402

GLOBAL_BATCH = 4
SEQ = 16
STEPS = 6
DATA = make_data(STEPS, 1, 1, GLOBAL_BATCH, SEQ)[:, 0, 0]  # (steps, 4, 16)


def build(task: dict):
    import hf_zero

    model = tiny_model(task["model"])
    if task.get("peft"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    case = Case(stage=task["stage"], dtype=task.get("dtype", "fp32"), gas=1, model=task["model"], steps=STEPS)
    return hf_zero.initialize(model, case.zero_config())


def train(engine, steps) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        ids = DATA[step].chunk(world)[rank].to(engine.env.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().cpu().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def rng_probe() -> list:
    """One draw from each generator, per rank (drawn at the same point of both runs)."""
    mine = [random.random(), float(np.random.rand()), float(torch.rand(1))]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def fp32_weights(engine) -> dict | None:
    from hf_zero.checkpoint.export16 import gather_full_state_dict

    full = gather_full_state_dict(engine, dtype=torch.float32)
    return full if dist.get_rank() == 0 else None


def task_export(task: dict) -> dict:
    from hf_zero.checkpoint.export16 import save_16bit_model

    engine = build(task)
    train(engine, range(3))  # the warm-up keeps the lr at 0 for the first step
    expected = fp32_weights(engine)
    written = {}
    for dtype, sub in (("fp32", "fp32"), ("bf16", "bf16")):
        out = os.path.join(task["dir"], sub)
        written[dtype] = save_16bit_model(engine, out, dtype=dtype, max_shard_size=task.get("max_shard_size", "5GB"))
    return {"expected": expected, "written": written, "dirs": {d: os.path.join(task["dir"], d) for d in ("fp32", "bf16")}}


def task_train_save(task: dict) -> dict:
    from hf_zero.checkpoint.sharded import save_checkpoint

    engine = build(task)
    before = train(engine, range(3))
    expected = fp32_weights(engine)
    if dist.get_rank() == 0 and task.get("foreign_file"):
        # A file the Trainer might have written into the directory first must survive the save.
        os.makedirs(task["ckpt"], exist_ok=True)
        with open(os.path.join(task["ckpt"], task["foreign_file"]), "w") as f:
            f.write("{}\n")
    dist.barrier()
    save_checkpoint(engine, task["ckpt"], extra_state={"step": 3, "note": task["name"]})
    scale = engine.loss_scale
    probe = rng_probe()
    after = train(engine, range(3, STEPS))
    return {"before": before, "after": after, "expected": expected, "rng": probe, "global_steps": engine.global_steps,
            "loss_scale_saved": scale}


def task_resume(task: dict) -> dict:
    from hf_zero.checkpoint.sharded import load_checkpoint

    engine = build(task)
    # Draw from the generators first: a resumed run must not depend on what happened before loading.
    torch.rand(7), random.random(), np.random.rand(3)
    extra = load_checkpoint(engine, task["ckpt"])
    steps_loaded = engine.global_steps
    lr_loaded = engine.get_lr()
    scale = engine.loss_scale
    probe = rng_probe()
    after = train(engine, range(3, STEPS))
    return {"after": after, "extra": extra, "rng": probe, "global_steps_loaded": steps_loaded, "lr_loaded": lr_loaded,
            "loss_scale_loaded": scale}


def task_interrupt(task: dict) -> dict:
    """Saves that fail mid-way raise on every rank and leave no final (or temporary) directory."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    import hf_zero.checkpoint.sharded as sharded

    engine = build(task)
    train(engine, range(1))
    rank = dist.get_rank()
    results = {}
    for where in ("marker", "data_rank1"):
        ckpt = os.path.join(task["dir"], f"ckpt-{where}")
        if where == "marker":
            original, owner, attr = sharded._write_marker, sharded, "_write_marker"

            def broken(path, info):
                with open(path, "w") as f:
                    f.write('{"format": "hf_zero.sharded", "form')  # half-written, then the "crash"
                raise OSError("simulated crash while writing the marker")
        else:
            original, owner, attr = dcp_fs.FileSystemWriter.write_data, dcp_fs.FileSystemWriter, "write_data"

            def broken(self, plan, planner, _original=original):
                if dist.get_rank() == 1:
                    raise OSError("simulated disk full on rank 1")
                return _original(self, plan, planner)

        setattr(owner, attr, broken)
        try:
            sharded.save_checkpoint(engine, ckpt)
            error = None
        except BaseException as exc:  # noqa: BLE001 - the test checks what was raised
            error = f"{type(exc).__name__}: {exc}"
        finally:
            setattr(owner, attr, original)
        dist.barrier()
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        leftovers = sorted(n for n in os.listdir(task["dir"]) if n.startswith(f"ckpt-{where}"))
        results[where] = {"errors": errors, "leftovers": leftovers if rank == 0 else None}
        dist.barrier()
    # The engine still saves fine afterwards.
    good = os.path.join(task["dir"], "ckpt-after")
    sharded.save_checkpoint(engine, good)
    results["after"] = sorted(os.listdir(good))
    return results


def task_crafted(task: dict) -> dict:
    """Resume from copies of a checkpoint with one file replaced by a pickle that would run code:
    the DCP metadata, a non-tensor .distcp entry (read by every rank), rank 1's RNG file (read by
    rank 1 only). Every rank must raise, none may hang, and nothing may run."""
    import shutil

    from _crafted import exec_pickle, exec_torch_file, replace_entry

    from hf_zero.checkpoint.sharded import load_checkpoint

    rank = dist.get_rank()
    results = {}
    for kind in ("metadata", "bytes_entry", "rng_rank1"):
        ckpt = os.path.join(task["dir"], kind)
        sentinel = ckpt + ".ran"
        tampered = None
        if rank == 0:
            shutil.copytree(task["ckpt"], ckpt)
            if kind == "metadata":
                tampered = os.path.join(ckpt, ".metadata")
                with open(tampered, "wb") as f:
                    f.write(exec_pickle(sentinel))
            elif kind == "bytes_entry":
                tampered = str(replace_entry(ckpt, "lr_scheduler.last_batch_iteration", exec_torch_file(sentinel)))
            else:
                tampered = os.path.join(ckpt, "hf_zero_rng_1.pth")
                with open(tampered, "wb") as f:
                    f.write(exec_torch_file(sentinel))
        dist.barrier()
        engine = build(task)
        try:
            load_checkpoint(engine, ckpt)
            error = None
        except BaseException as exc:  # noqa: BLE001 - the test checks what was raised
            error = f"{type(exc).__name__}: {exc}"
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        results[kind] = {"errors": errors, "file": tampered, "ran": os.path.exists(sentinel)}
        dist.barrier()
    return results


TASKS = {"export": task_export, "train_save": task_train_save, "resume": task_resume, "interrupt": task_interrupt,
         "crafted": task_crafted}


def main() -> None:
    faulthandler.enable()  # a native abort prints every thread's Python stack
    from tests.strict_collectives import install_from_env

    install_from_env()  # HF_ZERO_STRICT_COLLECTIVES=1 (tests/distributed/_launch.py sets it by default)
    tasks_path, out_path = sys.argv[1], sys.argv[2]
    with open(tasks_path) as f:
        tasks = json.load(f)
    results = {}
    for task in tasks:
        results[task["name"]] = TASKS[task["kind"]](task)
    if dist.get_rank() == 0:
        torch.save(results, out_path + ".tmp")
        os.replace(out_path + ".tmp", out_path)
    dist.barrier()
    dist.destroy_process_group()
    # Skip C++ static destructors: on torch 2.13 CPU a process that trained under FSDP2 + gloo
    # sometimes aborts after main() returned ("terminate called without an active exception",
    # no Python frame), about 1 launch in 10 under load. The results are on disk by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
