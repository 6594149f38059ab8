# A full fine-tuning script in the shape of FastChat's train.py (transformers 4 era), written for
# hf_zero's tests. What it relies on from the Trainer:
#   - `Trainer(tokenizer=...)` (transformers 4's name for processing_class);
#   - `training_args.local_rank` for rank-0 printing;
#   - the save branch: `trainer.is_deepspeed_enabled` -> `trainer.save_model()`, otherwise an FSDP1
#     full-state-dict save (`FSDP.state_dict_type`), which fails on current torch for a model that
#     FSDP1 did not wrap.
# It does not import deepspeed.

import json
from dataclasses import dataclass, field

import torch
import transformers
from torch.utils.data import Dataset
from transformers import Trainer

IGNORE_INDEX = -100


@dataclass
class ModelArguments:
    model_name_or_path: str = field(default="assets/tiny-qwen2")


@dataclass
class DataArguments:
    data_path: str = field(default="assets/data/alpaca_tiny.json")
    max_examples: int = field(default=64)


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    model_max_length: int = field(default=48)


local_rank = None


def rank0_print(*args):
    if local_rank == 0:
        print(*args, flush=True)


class ConversationDataset(Dataset):
    """Each example as a two-turn chat; only the assistant turn is trained on."""

    def __init__(self, path, tokenizer, max_len, max_examples):
        with open(path, encoding="utf-8") as f:
            rows = json.load(f)[:max_examples]
        self.items = []
        for row in rows:
            user = f"USER: {row['instruction']} {row.get('input', '')}".strip() + " ASSISTANT: "
            u_ids = tokenizer(user)["input_ids"]
            a_ids = tokenizer(row["output"] + tokenizer.eos_token)["input_ids"]
            ids = (u_ids + a_ids)[:max_len]
            labels = ([IGNORE_INDEX] * len(u_ids) + a_ids)[:max_len]
            if any(t != IGNORE_INDEX for t in labels):
                self.items.append((ids, labels))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        ids, labels = self.items[i]
        return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)}


@dataclass
class Collator:
    pad_id: int

    def __call__(self, batch):
        ids = torch.nn.utils.rnn.pad_sequence([b["input_ids"] for b in batch], batch_first=True,
                                              padding_value=self.pad_id)
        labels = torch.nn.utils.rnn.pad_sequence([b["labels"] for b in batch], batch_first=True,
                                                 padding_value=IGNORE_INDEX)
        return {"input_ids": ids, "labels": labels, "attention_mask": ids.ne(self.pad_id)}


def save_with_fsdp_full_state_dict(trainer):
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    policy = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(trainer.model, StateDictType.FULL_STATE_DICT, policy):
        trainer.save_model()


def train():
    global local_rank
    parser = transformers.HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    local_rank = training_args.local_rank
    transformers.set_seed(training_args.seed)  # the adapter's random initialisation too

    model = transformers.AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    model.config.use_cache = False
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        model_args.model_name_or_path, model_max_length=training_args.model_max_length, padding_side="right"
    )
    dataset = ConversationDataset(data_args.data_path, tokenizer, training_args.model_max_length,
                                  data_args.max_examples)
    rank0_print(f"{len(dataset)} examples")
    trainer = Trainer(model=model, tokenizer=tokenizer, args=training_args, train_dataset=dataset,
                      data_collator=Collator(tokenizer.pad_token_id))
    trainer.train()
    model.config.use_cache = True
    trainer.save_state()
    if trainer.is_deepspeed_enabled:
        trainer.save_model()
    else:
        save_with_fsdp_full_state_dict(trainer)
    rank0_print("saved by", "save_model" if trainer.is_deepspeed_enabled else "the FSDP branch")


if __name__ == "__main__":
    train()
