#!/usr/bin/env python
"""Generate the tiny, committed assets that the examples and integration tests use.

There is no model hub on the test machines, so everything an example needs is produced here,
deterministically (fixed seeds, no clocks, no network), and committed under ``assets/``:

* ``assets/data/alpaca_tiny.json``          200 Alpaca records {"instruction", "input", "output"}
* ``assets/data/advertise_gen_tiny.jsonl``  100 AdvertiseGen records {"content", "summary"}
* ``assets/data/advertise_gen_tiny_dev.jsonl`` 20 more, for evaluation
* ``assets/tiny-qwen2/``  Qwen2ForCausalLM (hidden 64, 2 layers, 4 heads, 2 kv heads, tied embeddings)
* ``assets/tiny-llama/``  LlamaForCausalLM (same sizes, untied embeddings)
* ``assets/tiny-glm4/``   Glm4ForCausalLM, GLM-4-0414's architecture (same sizes, untied embeddings, qkv bias,
  fused gate_up_proj, partial rotary), the base model of examples/chatglm_lora/

All model folders carry the same tokenizer: a byte-level BPE (vocab 512) trained with the
``tokenizers`` library on the two data sets, saved with ``save_pretrained`` so that
``AutoTokenizer.from_pretrained(folder)`` loads it offline. Model weights are random (seeded), not
pretrained: fine-tuning starts at loss ~ ln(512) ~ 6.2 and falls visibly within a few steps.

Regenerate (from the repository root):

    python scripts/make_tiny_assets.py            # writes assets/
    python scripts/make_tiny_assets.py --check    # regenerates into a temp dir, compares byte for byte
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import random
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SEED = 1234
VOCAB_SIZE = 512
REPO_ROOT = Path(__file__).resolve().parents[1]

# Special tokens. ids 0..4, in this order.
PAD, EOS, BOS, IM_START, IM_END = "<|pad|>", "<|endoftext|>", "<|startoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, EOS, BOS, IM_START, IM_END]

# transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX (digits split one by one).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# A ChatML-style template (as Qwen uses). inference_hf.py / finetune_hf.py render prompts with it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The Stanford-Alpaca prompt (what examples/finetune_qwen/finetune.py wraps each record in). It is part
# of the tokenizer's training text so that BPE learns it and prompts stay short.
ALPACA_PROMPT_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:"
)

WORDS = [
    "apple", "river", "stone", "cloud", "green", "house", "light", "music", "ocean", "paper",
    "plant", "quiet", "sugar", "table", "water", "bread", "chair", "dream", "earth", "flame",
    "grape", "heart", "lemon", "money", "night", "piano", "queen", "robot", "smile", "tiger",
    "cat", "dog", "sun", "moon", "tree", "bird", "fish", "book", "milk", "rain",
    "snow", "wind", "star", "road", "ship", "door", "hand", "king", "leaf", "rose",
]


# ----------------------------------------------------------------------------------------- data
def make_alpaca(rng: random.Random, n: int) -> list[dict]:
    """Small, learnable instruction tasks: arithmetic, word reversal, capitals, first letter, length."""
    out = []
    for i in range(n):
        task = i % 7
        w = rng.choice(WORDS)
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        if task == 0:
            rec = {"instruction": "Add the two numbers.", "input": f"{a} + {b}", "output": str(a + b)}
        elif task == 1:
            a, b = max(a, b), min(a, b)
            rec = {"instruction": "Subtract the second number from the first.", "input": f"{a} - {b}",
                   "output": str(a - b)}
        elif task == 2:
            rec = {"instruction": "Reverse the letters of the word.", "input": w, "output": w[::-1]}
        elif task == 3:
            rec = {"instruction": "Write the word in capital letters.", "input": w, "output": w.upper()}
        elif task == 4:
            rec = {"instruction": "What is the first letter of the word?", "input": w, "output": w[0]}
        elif task == 5:
            rec = {"instruction": "Count the letters in the word.", "input": w, "output": str(len(w))}
        else:  # no input: exercises Alpaca's prompt_no_input branch
            rec = {"instruction": f"What is {a} plus {b}?", "input": "", "output": f"{a} plus {b} is {a + b}."}
        out.append(rec)
    rng.shuffle(out)
    return out


ADV_TYPES = {"裙": "裙子", "连衣裙": "连衣裙", "裤": "裤子", "上衣": "上衣", "外套": "外套", "衬衫": "衬衫"}
ADV_COLORS = ["蓝色", "白色", "黑色", "红色", "粉色", "绿色"]
ADV_STYLES = {"清新": "清新自然", "简约": "简约大方", "复古": "复古优雅", "休闲": "休闲舒适", "性感": "性感迷人"}
ADV_PATTERNS = {"蝴蝶结": "俏皮的蝴蝶结", "条纹": "经典的条纹", "格子": "文艺的格子", "印花": "精致的印花", "纯色": "干净的纯色"}
ADV_MATERIALS = {"棉": "柔软亲肤的棉质面料", "雪纺": "轻盈飘逸的雪纺面料", "牛仔": "耐穿有型的牛仔面料", "针织": "温暖舒适的针织面料"}
ADV_ENDINGS = ["穿出好气质。", "轻松打造时尚造型。", "让你在人群中脱颖而出。", "日常出行都很合适。"]


def make_advertise_gen(rng: random.Random, n: int) -> list[dict]:
    """AdvertiseGen-format records (ChatGLM3 finetune demo): attribute string -> ad copy."""
    out = []
    for _ in range(n):
        typ = rng.choice(sorted(ADV_TYPES))
        color = rng.choice(ADV_COLORS)
        style = rng.choice(sorted(ADV_STYLES))
        pattern = rng.choice(sorted(ADV_PATTERNS))
        keys = [("类型", typ), ("颜色", color), ("风格", style), ("图案", pattern)]
        material = None
        if rng.random() < 0.5:
            material = rng.choice(sorted(ADV_MATERIALS))
            keys.insert(1, ("材质", material))
        content = "*".join(f"{k}#{v}" for k, v in keys)
        summary = f"这款{color}{ADV_TYPES[typ]}，{ADV_STYLES[style]}，搭配{ADV_PATTERNS[pattern]}图案，"
        if material:
            summary += f"选用{ADV_MATERIALS[material]}，"
        summary += rng.choice(ADV_ENDINGS)
        out.append({"content": content, "summary": summary})
    return out


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


# ------------------------------------------------------------------------------------ tokenizer
def tokenizer_corpus(alpaca: list[dict], adv: list[dict]) -> list[str]:
    texts = []
    for r in alpaca:
        tmpl = ALPACA_PROMPT_INPUT if r["input"] else ALPACA_PROMPT_NO_INPUT
        texts.append(tmpl.format_map(r) + r["output"])
    for r in adv:
        texts.append(f"{IM_START}user\n{r['content']}{IM_END}\n{IM_START}assistant\n{r['summary']}{IM_END}\n")
    return texts


def make_tokenizer(texts: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # Byte-level BPE with exactly Qwen2's normalizer and pre-tokenizer: for a folder whose config says
    # model_type "qwen2", AutoTokenizer returns transformers' Qwen2Tokenizer, which rebuilds the pipeline
    # with these settings around the saved vocab/merges; other model types load tokenizer.json as is.
    # Training with the same settings makes both give identical ids.
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=256,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# --------------------------------------------------------------------------------------- models
def make_model(kind: str, tokenizer):
    import torch
    from transformers import (
        GenerationConfig,
        Glm4Config,
        Glm4ForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )
    if kind == "qwen2":
        config = Qwen2Config(tie_word_embeddings=True, **common)
        cls = Qwen2ForCausalLM
    elif kind == "llama":
        config = LlamaConfig(tie_word_embeddings=False, **common)
        cls = LlamaForCausalLM
    elif kind == "glm4":
        # GLM-4-0414 (transformers' native Glm4): q/k/v biases, one gate_up_proj, extra post-norms,
        # rotary embedding on half of each head. head_dim is given because Glm4Config's default is 128.
        config = Glm4Config(tie_word_embeddings=False, head_dim=16, attention_bias=True, **common)
        cls = Glm4ForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(SEED)
    model = cls(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)],
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        max_new_tokens=32,
    )
    return model


def portable_tokenizer_config(path: Path) -> None:
    """Rewrite ``tokenizer_config.json`` as transformers 4.56+ and 5.x both read it: transformers 5
    writes ``tokenizer_class: TokenizersBackend`` and ``extra_special_tokens`` as a list, which 4.x
    cannot load; ``PreTrainedTokenizerFast`` and ``additional_special_tokens`` give the same
    tokenizer (same ids, special tokens and chat template) in both."""
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if isinstance(config.get("extra_special_tokens"), list):
        config["additional_special_tokens"] = config.pop("extra_special_tokens")
    config.pop("backend", None)
    path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------------------- main
def generate(out_dir: Path) -> list[Path]:
    import torch

    torch.use_deterministic_algorithms(True)
    rng = random.Random(SEED)
    alpaca = make_alpaca(rng, 200)
    adv = make_advertise_gen(rng, 100)
    adv_dev = make_advertise_gen(rng, 20)

    data_dir = out_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    write_json(data_dir / "alpaca_tiny.json", alpaca)
    write_jsonl(data_dir / "advertise_gen_tiny.jsonl", adv)
    write_jsonl(data_dir / "advertise_gen_tiny_dev.jsonl", adv_dev)

    tokenizer = make_tokenizer(tokenizer_corpus(alpaca, adv))
    for kind, name in (("qwen2", "tiny-qwen2"), ("llama", "tiny-llama"), ("glm4", "tiny-glm4")):
        folder = out_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        model = make_model(kind, tokenizer)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        portable_tokenizer_config(folder / "tokenizer_config.json")
    return sorted(p for p in out_dir.rglob("*") if p.is_file() and p.name != "README.md")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "assets", help="output folder (default: assets/)")
    ap.add_argument("--check", action="store_true",
                    help="regenerate into a temporary folder and compare with --out byte for byte")
    args = ap.parse_args(argv)

    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            files = generate(Path(tmp))
            bad = []
            for f in files:
                rel = f.relative_to(tmp)
                committed = args.out / rel
                if not committed.exists() or not filecmp.cmp(f, committed, shallow=False):
                    bad.append(str(rel))
            if bad:
                print("differs from a fresh regeneration:", *bad, sep="\n  ")
                return 1
            print(f"OK: {len(files)} files in {args.out} match a fresh regeneration")
            return 0

    files = generate(args.out)
    total = sum(f.stat().st_size for f in files)
    for f in files:
        print(f"{f.stat().st_size:>9}  {f.relative_to(args.out)}")
    print(f"{total:>9}  total bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
