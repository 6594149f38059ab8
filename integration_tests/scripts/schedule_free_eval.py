"""A Trainer script with a schedule-free optimizer and an evaluation at every step (each one
switches the optimizer to eval() and back to train()). Run plainly or under ``hf-zero run``.

    python schedule_free_eval.py OUTPUT_DIR PER_DEVICE_BATCH [--zero_config ds.json]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoModelForCausalLM, Trainer, TrainingArguments  # noqa: E402

from _tiny import TINY, token_dataset  # noqa: E402

out, batch, *rest = sys.argv[1:]
extra = {"zero_config": rest[1]} if rest[:1] == ["--zero_config"] else {"use_cpu": True}
args = TrainingArguments(output_dir=out, per_device_train_batch_size=int(batch), per_device_eval_batch_size=2,
                         max_steps=3, logging_steps=1, eval_strategy="steps", eval_steps=1, report_to="none",
                         save_strategy="no", learning_rate=5e-3, seed=3, optim="schedule_free_adamw",
                         lr_scheduler_type="constant", disable_tqdm=True, **extra)
trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(TINY), args=args, train_dataset=token_dataset(),
                  eval_dataset=token_dataset(n=4, seed=2))
trainer.train()
trainer.save_state()
