"""LoRA on a seq2seq model with an Accelerator loop, evaluated by generate (PEFT's
``peft_lora_seq2seq_accelerate_fsdp.py``, in the shape of the PEFT FSDP guide).

The original trains t5-base on FinancialPhraseBank; here a tiny T5 built from a config and a small
synthetic "sentence -> sentiment word" set stand in for them, so the example runs on a CPU in a
minute with nothing downloaded. The loop is the original's: ``Accelerator()``, ``get_peft_model``,
``main_process_first`` for the data, ``accelerator.prepare(model, dataloaders, optimizer,
scheduler)``, ``accelerator.backward``, ``unwrap_model(model).generate`` for the evaluation, and the
adapter saved from ``get_state_dict``.

    accelerate launch --config_file fsdp_config.yaml peft_lora_seq2seq_accelerate_fsdp.py   # accelerate's FSDP
    hf-zero run --config_file fsdp_config.yaml peft_lora_seq2seq_accelerate_fsdp.py         # hf_zero's ZeRO-3
"""

from __future__ import annotations

import argparse
import json
import os
import random

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from peft import LoraConfig, TaskType, get_peft_model
from torch.utils.data import DataLoader
from transformers import AutoModelForSeq2SeqLM, PreTrainedTokenizerFast, T5Config, get_linear_schedule_with_warmup

LABELS = ("positive", "negative", "neutral")
SUBJECTS = ("the company", "operating profit", "net sales", "the bank", "the group", "revenue")
VERBS = {"positive": ("rose", "grew", "increased", "improved"), "negative": ("fell", "dropped", "decreased", "declined"),
         "neutral": ("was", "remained", "stayed", "stood")}
TAILS = ("in the quarter", "this year", "from last year", "in finland", "compared to 2007")


def make_examples(n: int, seed: int) -> list[dict[str, str]]:
    """Sentences whose verb carries the sentiment (the FinancialPhraseBank task, in miniature)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.choice(LABELS)
        text = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS[label])} {rng.choice(TAILS)}"
        rows.append({"sentence": text, "text_label": label})
    return rows


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the example's words (T5's ids: pad 0, eos 1, unk 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = sorted({w for phrase in (*SUBJECTS, *TAILS, *LABELS, *sum(VERBS.values(), ())) for w in phrase.split()})
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def make_base_model(path: str, vocab_size: int) -> None:
    """The stand-in for t5-base: a tiny T5 with fixed weights, written where from_pretrained reads it."""
    config = T5Config(vocab_size=vocab_size, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    AutoModelForSeq2SeqLM.from_config(config).save_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", default="peft_accelerate_out")
    parser.add_argument("--num_epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--max_steps", type=int, default=0, help="stop after this many steps (0: all epochs)")
    args = parser.parse_args()

    accelerator = Accelerator()
    set_seed(42)
    model_name_or_path = os.path.join(args.output_dir, "base_model")
    peft_config = LoraConfig(task_type=TaskType.SEQ_2_SEQ_LM, inference_mode=False, r=8, lora_alpha=32, lora_dropout=0.1,
                             target_modules=["q", "k", "v", "o", "wi", "wo"])
    tokenizer = make_tokenizer()
    with accelerator.main_process_first():
        if accelerator.is_main_process and not os.path.isdir(model_name_or_path):
            make_base_model(model_name_or_path, len(tokenizer))
    model = AutoModelForSeq2SeqLM.from_pretrained(model_name_or_path)
    model = get_peft_model(model, peft_config)
    accelerator.print(model.print_trainable_parameters())

    def preprocess_function(rows):
        inputs = tokenizer([r["sentence"] for r in rows], padding=True, return_tensors="pt")
        labels = tokenizer([r["text_label"] for r in rows], padding=True, return_tensors="pt")["input_ids"]
        labels[labels == tokenizer.pad_token_id] = -100
        return {**inputs, "labels": labels}

    with accelerator.main_process_first():
        train_dataset, eval_dataset = make_examples(64, seed=1), make_examples(16, seed=2)
    accelerator.wait_for_everyone()
    train_dataloader = DataLoader(train_dataset, shuffle=True, collate_fn=preprocess_function,
                                  batch_size=args.batch_size, generator=torch.Generator().manual_seed(42))
    eval_dataloader = DataLoader(eval_dataset, collate_fn=preprocess_function, batch_size=args.batch_size)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    lr_scheduler = get_linear_schedule_with_warmup(optimizer=optimizer, num_warmup_steps=0,
                                                   num_training_steps=len(train_dataloader) * args.num_epochs)
    if getattr(accelerator.state, "fsdp_plugin", None) is not None:  # accelerate's own FSDP (accelerate launch)
        from peft.utils.other import fsdp_auto_wrap_policy

        accelerator.state.fsdp_plugin.auto_wrap_policy = fsdp_auto_wrap_policy(model)

    model, train_dataloader, eval_dataloader, optimizer, lr_scheduler = accelerator.prepare(
        model, train_dataloader, eval_dataloader, optimizer, lr_scheduler)
    accelerator.print(model)

    losses: list[float] = []
    steps = 0
    for epoch in range(args.num_epochs):
        model.train()
        total_loss = 0.0
        for batch in train_dataloader:
            outputs = model(**batch)
            loss = outputs.loss
            total_loss += loss.detach().float()
            losses.append(float(accelerator.gather_for_metrics(loss.detach()[None]).mean()))
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            steps += 1
            if args.max_steps and steps >= args.max_steps:
                break
        accelerator.print(f"epoch={epoch}: train_loss={total_loss / len(train_dataloader):.4f}")
        if args.max_steps and steps >= args.max_steps:
            break

    model.eval()
    eval_preds: list[str] = []
    for batch in eval_dataloader:
        batch = {k: v for k, v in batch.items() if k != "labels"}
        with torch.no_grad():
            outputs = accelerator.unwrap_model(model).generate(**batch, max_new_tokens=3)
        outputs = accelerator.pad_across_processes(outputs, dim=1, pad_index=tokenizer.pad_token_id)
        preds = accelerator.gather_for_metrics(outputs).detach().cpu().numpy()
        eval_preds.extend(tokenizer.batch_decode(preds, skip_special_tokens=True))
    correct = sum(pred.strip() == row["text_label"] for pred, row in zip(eval_preds, eval_dataset))
    accuracy = correct / len(eval_dataset) * 100
    accelerator.print(f"accuracy={accuracy:.1f}%")
    accelerator.print(f"eval_preds[:10]={eval_preds[:10]}")
    accelerator.print(f"labels[:10]={[row['text_label'] for row in eval_dataset[:10]]}")

    accelerator.wait_for_everyone()
    adapter_dir = os.path.join(args.output_dir, "adapter")
    accelerator.unwrap_model(model).save_pretrained(adapter_dir, is_main_process=accelerator.is_main_process,
                                                    save_function=accelerator.save,
                                                    state_dict=accelerator.get_state_dict(model))
    if accelerator.is_main_process:
        tokenizer.save_pretrained(adapter_dir)
        with open(os.path.join(args.output_dir, "metrics.json"), "w") as f:
            json.dump({"losses": losses, "accuracy": accuracy, "eval_preds": eval_preds}, f)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
