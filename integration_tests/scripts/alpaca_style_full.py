# A full fine-tuning script in the shape of Stanford Alpaca's train.py (transformers 4 era), written
# for hf_zero's tests. What it relies on: the save function Alpaca ships for the Trainer's FSDP,
# `safe_save_model_for_hf_trainer`: `trainer.model.state_dict()` on every rank, then
# `trainer._save(output_dir, state_dict=cpu_state_dict)` on the saving rank. The data and collator
# are the FastChat-style script's (same folder): only the save differs.

import sys
from pathlib import Path

import transformers
from transformers import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fastchat_style_full import Collator, ConversationDataset, DataArguments, ModelArguments, TrainingArguments  # noqa: E402


def safe_save_model_for_hf_trainer(trainer: transformers.Trainer, output_dir: str):
    """Collects the state dict and dump to disk."""
    state_dict = trainer.model.state_dict()
    if trainer.args.should_save:
        cpu_state_dict = {key: value.cpu() for key, value in state_dict.items()}
        del state_dict
        trainer._save(output_dir, state_dict=cpu_state_dict)  # noqa


def train():
    parser = transformers.HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()
    transformers.set_seed(training_args.seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        model_args.model_name_or_path, model_max_length=training_args.model_max_length, padding_side="right"
    )
    dataset = ConversationDataset(data_args.data_path, tokenizer, training_args.model_max_length,
                                  data_args.max_examples)
    trainer = Trainer(model=model, tokenizer=tokenizer, args=training_args, train_dataset=dataset,
                      data_collator=Collator(tokenizer.pad_token_id))
    trainer.train()
    trainer.save_state()
    safe_save_model_for_hf_trainer(trainer=trainer, output_dir=training_args.output_dir)


if __name__ == "__main__":
    train()
