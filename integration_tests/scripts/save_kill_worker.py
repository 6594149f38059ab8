"""A one-process ZeroTrainer run that is killed (SIGKILL, no clean-up of any kind) at a chosen step
of a save, for integration_tests/test_trainer_save_safety.py.

    python save_kill_worker.py OUT --kill model_shard      # 2nd save_model killed mid-file
    python save_kill_worker.py OUT --kill checkpoint_aside # checkpoint-2 re-saved, killed between
                                                           # moving it aside and renaming the new in
    python save_kill_worker.py OUT --resume                # a new run resuming from OUT

Before each kill the worker writes what the folder held (``OUT/reference/``), so the test can
check that what survives is complete and the same.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.trainer_utils import get_last_checkpoint

from hf_zero import ZeroTrainer, ZeroTrainingArguments

TINY = Path(__file__).resolve().parents[2] / "assets" / "tiny-qwen2"


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _trainer(out: str, max_steps: int) -> ZeroTrainer:
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, 500, (16, 16), generator=g)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = ZeroTrainingArguments(
        output_dir=out, zero_config={"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"},
        per_device_train_batch_size=4, max_steps=max_steps, save_steps=2, report_to="none",
        learning_rate=5e-3, seed=3, disable_tqdm=True,
    )
    return ZeroTrainer(model=AutoModelForCausalLM.from_pretrained(TINY), args=args, train_dataset=data,
                       processing_class=AutoTokenizer.from_pretrained(TINY))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kill", choices=["model_shard", "checkpoint_aside"])
    parser.add_argument("--resume", action="store_true")
    a = parser.parse_args()

    if a.resume:
        trainer = _trainer(a.out, max_steps=3)  # construction restores a checkpoint moved aside
        last = get_last_checkpoint(a.out)
        print(f"LAST_CHECKPOINT {last}")
        trainer.train(resume_from_checkpoint=last)
        print(f"RESUMED_TO {trainer.state.global_step}")
        return

    trainer = _trainer(a.out, max_steps=2)
    trainer.train()  # writes checkpoint-2
    if a.kill == "model_shard":
        trainer.save_max_shard_size = "200KB"  # several files, so the kill lands between two of them
        model_dir = os.path.join(a.out, "model")
        trainer.save_model(model_dir)
        shutil.copytree(model_dir, os.path.join(a.out, "reference"))
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(1.0)  # the interrupted save would have written other weights
        from hf_zero.checkpoint import export16

        written = []

        class Dying(export16.SafetensorsStreamWriter):
            def write(self, name, tensor):
                written.append(self.path)
                if len(set(written)) == 2:  # inside the second file
                    _die()
                super().write(name, tensor)

        export16.SafetensorsStreamWriter = Dying
        trainer.save_model(model_dir)
    else:
        shutil.copytree(os.path.join(a.out, "checkpoint-2"), os.path.join(a.out, "reference"))
        from hf_zero.checkpoint import atomic_dir

        atomic_dir._exchange = lambda x, y: False  # a filesystem without renameat2's swap
        real_replace = os.replace
        final = os.path.join(os.path.abspath(a.out), "checkpoint-2")

        def replace(src, dst):
            if os.fspath(dst) == final:  # checkpoint-2 is aside, the new one about to move in
                _die()
            real_replace(src, dst)

        atomic_dir.os.replace = replace
        trainer._save_checkpoint(trainer.model_wrapped, None)
    print("NOT KILLED")


if __name__ == "__main__":
    main()
