# -*- coding: utf-8 -*-
"""LoRA fine-tuning in the style of ChatGLM3's finetune_demo/finetune_hf.py (simplified).

An ordinary Hugging Face script: peft ``get_peft_model`` + ``transformers.Seq2SeqTrainer``; nothing
from hf_zero is imported. The base model is any causal LM folder: a GLM-4 checkpoint
(``THUDM/glm-4-9b-chat-hf``, ``THUDM/GLM-4-9B-0414``: transformers' native Glm/Glm4 classes), ChatGLM3
with ``--trust_remote_code``, or the committed tiny GLM-4 ``assets/tiny-glm4`` (random weights).

    python finetune_hf.py DATA_DIR MODEL_DIR CONFIG_FILE [DS_CONFIG] [--zero_config PATH | --deepspeed PATH]
                          [--<any Seq2SeqTrainingArguments field> VALUE ...]

DATA_DIR holds the files named in CONFIG_FILE's ``data_config``, one JSON record a line: AdvertiseGen
(``{"content": "类型#裙*颜色#蓝色*...", "summary": "..."}``) or ChatGLM3's converted AdvertiseGen_fix
(``{"conversations": [{"role": "user", ...}, {"role": "assistant", ...}]}``). DS_CONFIG (positional, as in the ChatGLM3
tutorial command) and ``--zero_config``/``--deepspeed`` all name the ZeRO/DeepSpeed JSON; it is handed
to the training arguments (``deepspeed=``, or ``zero_config=`` when the arguments class has that field).
Trailing ``--key value`` pairs override ``training_args`` from the YAML, e.g. ``--max_steps 6``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml
from datasets import Dataset
from peft import get_peft_config, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    GenerationConfig,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    set_seed,
)

IGNORE_INDEX = -100


# ------------------------------------------------------------------------------------- arguments
def _coerce(value: str) -> Any:
    """'6' -> 6, '1e-3' -> 0.001, 'true'/'True' -> True, '[1, 2]' -> list; anything else stays a string."""
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    try:
        return json.loads(value)
    except ValueError:
        return value


def parse_overrides(tokens: list[str], parser: argparse.ArgumentParser) -> dict[str, Any]:
    fields = {f.name for f in dataclasses.fields(Seq2SeqTrainingArguments)}
    out: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("--"):
            parser.error(f"unexpected argument {tok!r}")
        key, eq, value = tok[2:].partition("=")
        if not eq:
            if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                value = tokens[i + 1]
                i += 1
            else:
                value = "true"  # a bare flag, e.g. --bf16
        if key not in fields:
            parser.error(f"--{key} is not a Seq2SeqTrainingArguments field")
        out[key] = _coerce(value)
        i += 1
    return out


def parse_args(argv: list[str] | None = None):
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--zero_config", "--deepspeed", dest="zero_config", default=None,
                         help="ZeRO/DeepSpeed JSON (same as the optional 4th positional argument)")
    options.add_argument("--resume_from_checkpoint", default=None,
                         help="a checkpoint folder, or 'yes' for the newest in output_dir")
    options.add_argument("--trust_remote_code", action="store_true", help="for models such as ChatGLM3")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     parents=[options])
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("model_dir", type=str)
    parser.add_argument("config_file", type=Path)
    parser.add_argument("ds_config", nargs="?", default=None, help="ZeRO/DeepSpeed JSON (optional)")

    tokens = list(sys.argv[1:] if argv is None else argv)
    if "-h" in tokens or "--help" in tokens:
        parser.print_help()
        sys.exit(0)
    # The positionals come first. They are split off by hand so that argparse cannot take the value of
    # an unknown "--max_steps 6" for the optional DS_CONFIG positional.
    n_pos = 0
    while n_pos < len(tokens) and not tokens[n_pos].startswith("-"):
        n_pos += 1
    args = parser.parse_args(tokens[:n_pos])
    opts, rest = options.parse_known_args(tokens[n_pos:])
    vars(args).update(vars(opts))
    overrides = parse_overrides(rest, parser)
    if args.ds_config and args.zero_config and args.ds_config != args.zero_config:
        parser.error("two different ZeRO configs given (positional and --zero_config/--deepspeed)")
    return args, overrides


def load_ft_config(path: Path, overrides: dict[str, Any], zero_config: str | None) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    training_args = dict(cfg.get("training_args") or {})
    training_args.update(overrides)
    if zero_config:
        names = {f.name for f in dataclasses.fields(Seq2SeqTrainingArguments)}
        key = "zero_config" if "zero_config" in names else "deepspeed"
        training_args[key] = zero_config
    gen = training_args.pop("generation_config", None)
    args = Seq2SeqTrainingArguments(**training_args)
    if gen is not None:
        args.generation_config = GenerationConfig(**gen)
    cfg["training_args"] = args
    cfg["peft_config"] = get_peft_config(cfg["peft_config"]) if cfg.get("peft_config") else None
    return cfg


# ------------------------------------------------------------------------------------------ data
def load_jsonl(path: Path) -> Dataset:
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return Dataset.from_list(records)


def build_prompt(tokenizer, content: str) -> str:
    """The user turn rendered with the tokenizer's chat template, ending with the assistant header."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )


def prompt_and_answer(batch: dict[str, list], tokenizer) -> list[tuple[str, str]]:
    """(rendered prompt, answer) per record: AdvertiseGen's content/summary, or a ChatGLM3-style
    conversation whose last assistant turn is the answer and whose earlier turns make the prompt."""
    if "conversations" in batch:
        pairs = []
        for turns in batch["conversations"]:
            *history, last = turns
            if last["role"] != "assistant":
                raise ValueError(f"a conversation must end with an assistant turn, got {last['role']!r}: {turns}")
            pairs.append((tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False),
                          last["content"]))
        return pairs
    if "content" not in batch or "summary" not in batch:
        raise ValueError(f"records need content/summary (AdvertiseGen) or conversations; got {sorted(batch)}")
    return [(build_prompt(tokenizer, c), s) for c, s in zip(batch["content"], batch["summary"])]


def process_batch(batch: dict[str, list], tokenizer, max_input_length: int, max_output_length: int):
    """Prompt tokens are masked with IGNORE_INDEX; the answer and its end token are learned."""
    end_ids = tokenizer.convert_tokens_to_ids(["<|im_end|>"]) if "<|im_end|>" in tokenizer.get_vocab() else []
    end_ids = end_ids + [tokenizer.eos_token_id]
    batched_input_ids, batched_labels = [], []
    for prompt, summary in prompt_and_answer(batch, tokenizer):
        prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
        answer_ids = tokenizer(summary, add_special_tokens=False).input_ids
        prompt_ids = prompt_ids[:max_input_length]
        answer_ids = answer_ids[: max_output_length - len(end_ids)] + end_ids
        batched_input_ids.append(prompt_ids + answer_ids)
        batched_labels.append([IGNORE_INDEX] * len(prompt_ids) + answer_ids)
    return {"input_ids": batched_input_ids, "labels": batched_labels}


def load_split(data_dir: Path, name: str | None, tokenizer, cfg) -> Dataset | None:
    if not name:
        return None
    ds = load_jsonl(data_dir / name)
    return ds.map(
        process_batch,
        batched=True,
        remove_columns=ds.column_names,
        num_proc=cfg["data_config"].get("num_proc"),
        fn_kwargs=dict(
            tokenizer=tokenizer,
            max_input_length=cfg["max_input_length"],
            max_output_length=cfg["max_output_length"],
        ),
    )


# ------------------------------------------------------------------------------------------ main
def where_the_model_went(output_dir: str, is_adapter: bool) -> str:
    """The closing lines on rank 0: where the result is and how to load it or generate with it."""
    def shown(path: str) -> str:  # relative to where the user is, unless that means climbing out
        rel = os.path.relpath(os.path.abspath(path))
        return os.path.abspath(path) if rel.startswith("..") else rel

    out = shown(output_dir)
    inference = shown(os.path.join(os.path.dirname(os.path.abspath(__file__)), "inference_hf.py"))
    checkpoints = sorted((p for p in Path(output_dir).glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
                         key=lambda p: int(p.name.split("-")[-1]))
    what = ("LoRA adapter is in {}/ (adapter_config.json, adapter_model.safetensors, tokenizer)" if is_adapter
            else "model is in {}/ (safetensors weights, config.json, tokenizer)")
    load = (f"peft.AutoPeftModelForCausalLM.from_pretrained({out!r})" if is_adapter
            else f"transformers.AutoModelForCausalLM.from_pretrained({out!r})")
    lines = ["\nThe fine-tuned " + what.format(out), f"  Load it:  {load}",
             f"  Try it:   python {inference} {out} --prompt \"类型#裙*颜色#蓝色*风格#清新*图案#蝴蝶结\""]
    if checkpoints:
        lines.append(f"  A checkpoint works the same way: python {inference} {shown(str(checkpoints[-1]))} --prompt ...")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    cli, overrides = parse_args(argv)
    cfg = load_ft_config(cli.config_file, overrides, cli.zero_config or cli.ds_config)
    training_args: Seq2SeqTrainingArguments = cfg["training_args"]

    # The Trainer seeds only when it is built; seed here too, so that the LoRA matrices (drawn by
    # get_peft_model) are the same in every run and on every rank.
    set_seed(training_args.seed)
    tokenizer = AutoTokenizer.from_pretrained(cli.model_dir, trust_remote_code=cli.trust_remote_code,
                                              padding_side="right")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(cli.model_dir, trust_remote_code=cli.trust_remote_code,
                                                 use_cache=False)
    if cfg["peft_config"] is not None:
        model = get_peft_model(model, cfg["peft_config"])
        model.print_trainable_parameters()
    if training_args.gradient_checkpointing:
        model.enable_input_require_grads()  # LoRA + checkpointing: the frozen embeddings' output needs grad

    data_config = cfg["data_config"]
    train_dataset = load_split(cli.data_dir, data_config.get("train_file"), tokenizer, cfg)
    eval_dataset = None
    if str(getattr(training_args.eval_strategy, "value", training_args.eval_strategy)) != "no":
        eval_dataset = load_split(cli.data_dir, data_config.get("val_file"), tokenizer, cfg)
    print("train dataset:", train_dataset)

    trainer = Seq2SeqTrainer(
        model=model,
        args=training_args,
        data_collator=DataCollatorForSeq2Seq(tokenizer, padding="longest", return_tensors="pt",
                                             label_pad_token_id=IGNORE_INDEX),
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
    )

    resume = cli.resume_from_checkpoint
    if resume is not None and resume.lower() == "yes":
        resume = True
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_state()
    trainer.save_model()  # the adapter (adapter_config.json + adapter_model.safetensors) + tokenizer
    if trainer.is_world_process_zero():
        print(where_the_model_went(training_args.output_dir, cfg["peft_config"] is not None), flush=True)

    test_file = data_config.get("test_file")
    if test_file:
        test_dataset = load_split(cli.data_dir, test_file, tokenizer, cfg)
        trainer.predict(test_dataset)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
