# A LoRA fine-tuning script in the shape of Qwen's finetune.py (QwenLM/Qwen, run by
# finetune/finetune_lora_ds.sh with ZeRO-2) and LLaVA's, written for hf_zero's tests. It follows
# Qwen's code where it matters and talks to DeepSpeed directly, as those scripts do:
#   - `from transformers import deepspeed` (the transformers-4 module) and
#     `deepspeed.is_deepspeed_zero3_enabled()`: at ZeRO-3 on a base model (no "chat" in the model
#     path) it refuses to start ("ZeRO3 is incompatible with LoRA when finetuning on base model"),
#     loads with `low_cpu_mem_usage=not zero3`, and picks the save path with it;
#   - Qwen also trains the embeddings and LM head of a base model (`modules_to_save=["wte",
#     "lm_head"]`); left out here: with the peft installed for these tests (0.21), Qwen's LoRA-only
#     state dict then fails in peft's save_pretrained (KeyError 'modules_to_save.default.weight'),
#     on the plain DDP run too;
#   - `from deepspeed import zero`, `ZeroParamStatus`, `hasattr(param, "ds_id")`:
#     `get_peft_state_maybe_zero_3` reads each LoRA parameter through `maybe_zero_3`;
#   - `safe_save_model_for_hf_trainer`: `_zero3_consolidated_16bit_state_dict()` at ZeRO-3, the
#     LoRA state otherwise, then `trainer._save(dir, state_dict)` on `local_rank == 0`;
#   - launch lines with transformers-4 flags (--evaluation_strategy, --warmup_ratio).
# It also saves the LoRA weights it collects as `lora_weights.bin`, and
# `--post_train_scale_lora_b F` multiplies one LoRA weight by F on rank 0 inside
# `zero.GatheredParameters(..., modifier_rank=0)` after training: every rank's shard must get the edit.

import json
import os
from dataclasses import dataclass, field

import torch
import transformers
from torch.utils.data import Dataset
from transformers import Trainer, deepspeed
from transformers.trainer_pt_utils import LabelSmoother

import deepspeed as ds
from deepspeed import zero
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from peft import LoraConfig, get_peft_model

IGNORE_INDEX = LabelSmoother.ignore_index


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


def maybe_zero_3(param):
    if hasattr(param, "ds_id"):
        assert param.ds_status == ZeroParamStatus.NOT_AVAILABLE
        with zero.GatheredParameters([param]):
            param = param.data.detach().cpu().clone()
    else:
        param = param.detach().cpu().clone()
    return param


# Borrowed from peft.utils.get_peft_model_state_dict (as Qwen's)
def get_peft_state_maybe_zero_3(named_params, bias):
    if bias == "none":
        to_return = {k: t for k, t in named_params if "lora_" in k}
    elif bias == "all":
        to_return = {k: t for k, t in named_params if "lora_" in k or "bias" in k}
    else:
        raise NotImplementedError
    to_return = {k: maybe_zero_3(v) for k, v in to_return.items()}
    return to_return


def safe_save_model_for_hf_trainer(trainer: transformers.Trainer, output_dir: str, bias="none"):
    """Collects the state dict and dump to disk."""
    # check if zero3 mode enabled
    if deepspeed.is_deepspeed_zero3_enabled():
        state_dict = trainer.model_wrapped._zero3_consolidated_16bit_state_dict()
    else:
        if trainer.args.use_lora:
            state_dict = get_peft_state_maybe_zero_3(trainer.model.named_parameters(), bias)
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

    is_chat_model = "chat" in model_args.model_name_or_path.lower()
    if training_args.use_lora and deepspeed.is_deepspeed_zero3_enabled() and not is_chat_model:
        raise RuntimeError("ZeRO3 is incompatible with LoRA when finetuning on base model.")
    model_load_kwargs = {"low_cpu_mem_usage": not deepspeed.is_deepspeed_zero3_enabled()}

    model = transformers.AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, **model_load_kwargs)
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
            if ds.comm.get_rank() == 0:
                param.data.mul_(training_args.post_train_scale_lora_b)
        rank0_print(f"scaled {name} by {training_args.post_train_scale_lora_b}")

    safe_save_model_for_hf_trainer(trainer=trainer, output_dir=training_args.output_dir, bias=lora_args.lora_bias)
    collected = get_peft_state_maybe_zero_3(trainer.model.named_parameters(), lora_args.lora_bias)
    if local_rank == 0:
        torch.save(collected, os.path.join(training_args.output_dir, "lora_weights.bin"))
    ds.comm.barrier()
    rank0_print("zero3:", deepspeed.is_deepspeed_zero3_enabled())


if __name__ == "__main__":
    train()
