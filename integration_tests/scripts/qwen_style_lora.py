# A LoRA fine-tuning script in the shape of the transformers-4 / DeepSpeed era (Qwen's and LLaVA's
# finetune.py), written for hf_zero's tests. It talks to DeepSpeed directly, as those scripts do:
#   - `from deepspeed import zero`, `ZeroParamStatus`, `hasattr(param, "ds_id")`,
#     `zero.GatheredParameters` to collect LoRA weights, `deepspeed.comm` for ranks and barriers;
#   - `transformers.integrations.deepspeed.is_deepspeed_zero3_enabled()` to choose the save path, and
#     `trainer.model_wrapped._zero3_consolidated_16bit_state_dict()` on that path;
#   - saves only `if training_args.local_rank == 0`;
#   - launch lines with transformers-4 flags (--evaluation_strategy, --warmup_ratio).
# It saves the adapter twice, the two ways such scripts do: through `trainer._save(dir, state_dict)`
# (into --output_dir) and as `lora_weights.bin` collected parameter by parameter.
# `--post_train_scale_lora_b F` multiplies one LoRA weight by F on rank 0 inside
# `zero.GatheredParameters(..., modifier_rank=0)` after training: every rank's shard must get the edit.

import json
import os
from dataclasses import dataclass, field

import torch
import transformers
from torch.utils.data import Dataset
from transformers import Trainer
from transformers.integrations import deepspeed as hf_deepspeed

import deepspeed
from deepspeed import zero
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from peft import LoraConfig, get_peft_model

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
    use_lora: bool = field(default=True)
    post_train_scale_lora_b: float = field(default=1.0)


@dataclass
class LoraArguments:
    lora_r: int = 4
    lora_alpha: int = 8
    lora_dropout: float = 0.0
    lora_target_modules: str = "q_proj,v_proj"
    lora_bias: str = "none"


local_rank = None


def rank0_print(*args):
    if local_rank == 0:
        print(*args, flush=True)


def fetch_param(param):
    """A CPU copy of a parameter, gathered first when ZeRO-3 partitioned it."""
    if hasattr(param, "ds_id"):
        if param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
            raise RuntimeError(f"unexpected ds_status {param.ds_status}")
        with zero.GatheredParameters([param]):
            return param.data.detach().cpu().clone()
    return param.detach().cpu().clone()


def lora_state(named_params, bias):
    if bias != "none":
        raise NotImplementedError(bias)
    return {name: fetch_param(p) for name, p in named_params if "lora_" in name}


def save_for_hf(trainer, output_dir, bias):
    if hf_deepspeed.is_deepspeed_zero3_enabled():
        state_dict = trainer.model_wrapped._zero3_consolidated_16bit_state_dict()
    elif trainer.args.use_lora:
        state_dict = lora_state(trainer.model.named_parameters(), bias)
    else:
        state_dict = trainer.model.state_dict()
    if trainer.args.should_save and trainer.args.local_rank == 0:
        trainer._save(output_dir, state_dict=state_dict)


class InstructionDataset(Dataset):
    def __init__(self, path, tokenizer, max_len, max_examples):
        with open(path, encoding="utf-8") as f:
            rows = json.load(f)[:max_examples]
        self.items = []
        for row in rows:
            prompt = f"Instruction: {row['instruction']}\nInput: {row.get('input', '')}\nAnswer: "
            p_ids = tokenizer(prompt)["input_ids"]
            ids = (p_ids + tokenizer(row["output"] + tokenizer.eos_token)["input_ids"])[:max_len]
            labels = ([IGNORE_INDEX] * len(p_ids) + ids[len(p_ids):])[:max_len]
            if any(t != IGNORE_INDEX for t in labels):
                self.items.append((torch.tensor(ids), torch.tensor(labels)))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {"input_ids": self.items[i][0], "labels": self.items[i][1]}


def make_collator(pad_id):
    def collate(batch):
        ids = torch.nn.utils.rnn.pad_sequence([b["input_ids"] for b in batch], batch_first=True, padding_value=pad_id)
        labels = torch.nn.utils.rnn.pad_sequence([b["labels"] for b in batch], batch_first=True,
                                                 padding_value=IGNORE_INDEX)
        return {"input_ids": ids, "labels": labels, "attention_mask": ids.ne(pad_id)}

    return collate


def train():
    global local_rank
    parser = transformers.HfArgumentParser((ModelArguments, DataArguments, TrainingArguments, LoraArguments))
    model_args, data_args, training_args, lora_args = parser.parse_args_into_dataclasses()
    local_rank = training_args.local_rank
    transformers.set_seed(training_args.seed)  # the adapter's random initialisation too

    model = transformers.AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_args.model_name_or_path, padding_side="right")
    if training_args.use_lora:
        config = LoraConfig(r=lora_args.lora_r, lora_alpha=lora_args.lora_alpha,
                            target_modules=lora_args.lora_target_modules.split(","),
                            lora_dropout=lora_args.lora_dropout, bias=lora_args.lora_bias, task_type="CAUSAL_LM")
        model = get_peft_model(model, config)
        if local_rank == 0:
            model.print_trainable_parameters()

    dataset = InstructionDataset(data_args.data_path, tokenizer, training_args.model_max_length,
                                 data_args.max_examples)
    trainer = Trainer(model=model, tokenizer=tokenizer, args=training_args, train_dataset=dataset,
                      data_collator=make_collator(tokenizer.pad_token_id))
    trainer.train()
    trainer.save_state()

    if training_args.post_train_scale_lora_b != 1.0:
        name, param = next((n, p) for n, p in trainer.model.named_parameters() if "lora_B" in n)
        with zero.GatheredParameters([param], modifier_rank=0):
            if deepspeed.comm.get_rank() == 0:
                param.data.mul_(training_args.post_train_scale_lora_b)
        rank0_print(f"scaled {name} by {training_args.post_train_scale_lora_b}")

    save_for_hf(trainer, training_args.output_dir, lora_args.lora_bias)
    collected = lora_state(trainer.model.named_parameters(), lora_args.lora_bias)
    if local_rank == 0:
        torch.save(collected, os.path.join(training_args.output_dir, "lora_weights.bin"))
    deepspeed.comm.barrier()
    rank0_print("zero3:", hf_deepspeed.is_deepspeed_zero3_enabled())


if __name__ == "__main__":
    train()
