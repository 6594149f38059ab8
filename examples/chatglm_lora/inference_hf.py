# -*- coding: utf-8 -*-
"""Generate with a fine-tuned model, in the style of ChatGLM3's finetune_demo/inference_hf.py.

    python inference_hf.py MODEL_DIR --prompt "类型#裙*颜色#蓝色*风格#清新*图案#蝴蝶结"

MODEL_DIR is either a LoRA adapter folder (the training output_dir or one of its checkpoint-N
folders: it has adapter_config.json) or a full model folder. For an adapter, the base model named in
adapter_config.json (``base_model_name_or_path``, as given to finetune_hf.py) is loaded first, or
--base_model when given, and the adapter is applied with ``PeftModel.from_pretrained``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

DTYPES = {"auto": "auto", "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The prompt a model saw in training: the chat template (finetune_hf.py), or the Stanford-Alpaca
# "no input" prompt (examples/finetune_qwen/finetune.py, PROMPT_DICT["prompt_no_input"]).
ALPACA_PROMPT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:"
)


def load_model_and_tokenizer(model_dir: Path, base_model: str | None, dtype, trust_remote_code: bool):
    adapter_cfg = model_dir / "adapter_config.json"
    if adapter_cfg.exists():
        from peft import PeftModel

        base = base_model or json.loads(adapter_cfg.read_text(encoding="utf-8"))["base_model_name_or_path"]
        model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype, trust_remote_code=trust_remote_code)
        model = PeftModel.from_pretrained(model, model_dir)
    else:
        base = str(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, trust_remote_code=trust_remote_code)
    # The training script saves the tokenizer next to the adapter; fall back to the base model's.
    tokenizer_dir = model_dir if (model_dir / "tokenizer_config.json").exists() else base
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust_remote_code)
    return model, tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--prompt", default="类型#裙*颜色#蓝色*风格#清新*图案#蝴蝶结")
    parser.add_argument("--prompt_format", choices=["chat", "alpaca", "plain"], default="chat",
                        help="chat: the tokenizer's chat template (as finetune_hf.py trains; plain when the "
                             "tokenizer has none); alpaca: the Alpaca prompt finetune_qwen/finetune.py trains")
    parser.add_argument("--base_model", default=None, help="override the adapter's base_model_name_or_path")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--min_new_tokens", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="auto")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--trust_remote_code", action="store_true")
    args = parser.parse_args()

    model, tokenizer = load_model_and_tokenizer(args.model_dir, args.base_model, DTYPES[args.dtype],
                                                args.trust_remote_code)
    model.to(args.device).eval()

    if args.prompt_format == "alpaca":
        text = ALPACA_PROMPT.format(instruction=args.prompt)
    elif args.prompt_format == "chat" and tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                             add_generation_prompt=True, tokenize=False)
    else:
        text = args.prompt
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(args.device)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id)
    new_tokens = out[0, inputs["input_ids"].shape[1]:]
    response = tokenizer.decode(new_tokens, skip_special_tokens=True)
    print(f"prompt: {args.prompt}")
    print(f"new token ids: {new_tokens.tolist()}")
    print(f"response: {response}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
