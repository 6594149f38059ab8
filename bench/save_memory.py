"""Peak host memory of saving a model's 16-bit weights, against the model's size.

    python bench/save_memory.py --stage 3 --hidden 512 --layers 8

Builds a random Llama-shaped model, shards it with ``hf_zero.initialize`` (one process, CPU/gloo),
and saves its bf16 weights two ways, each in a fresh process so no allocator state carries over:

- ``hf_zero``: ``save_16bit_model`` (what ``ZeroTrainer.save_model`` calls): gathers and writes one
  tensor at a time;
- ``gather+save_pretrained``: the whole 16-bit state dict gathered to the host, then
  ``save_pretrained(state_dict=...)``, which is how the Trainer (and DeepSpeed's
  ``stage3_gather_16bit_weights_on_model_save``) save.

The number is how much the process's resident set grew at its peak during the save (``VmHWM``
reset through ``/proc/self/clear_refs`` just before; Linux only), after one warm-up save so
first-call imports are not counted. glibc is told to serve every allocation above 128 KiB with
mmap (``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave the resident set and the peak is what
was alive at once. Prints a Markdown table; ``--json`` prints the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MiB = 1024 * 1024
MODES = ("hf_zero", "gather+save_pretrained")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) * 1024


def _peak_growth(fn) -> int:
    import gc

    gc.collect()
    base = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    fn()
    return _status_bytes("VmHWM") - base


def measure(mode: str, stage: int, hidden: int, layers: int, vocab: int, out_dir: str) -> dict:
    """Run in this process: build, shard and save; returns the model's and the save's bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_zero
    from hf_zero.checkpoint.export16 import gather_full_state_dict, save_16bit_model

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                                         num_attention_heads=max(1, hidden // 64), vocab_size=vocab))
    engine = hf_zero.initialize(model=model, config={
        "zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})

    def save(target: str) -> None:
        if mode == "hf_zero":
            save_16bit_model(engine, target, dtype=torch.bfloat16)
        else:
            state = gather_full_state_dict(engine, dtype=torch.bfloat16)
            model.save_pretrained(target, state_dict=state)

    save(os.path.join(out_dir, "warm-up"))
    grew = _peak_growth(lambda: save(os.path.join(out_dir, "measured")))
    result = {
        "mode": mode,
        "stage": stage,
        "model_bytes_16bit": sum(p.numel() for p in model.parameters()) * 2,
        "largest_tensor_bytes_16bit": max(p.numel() for p in model.parameters()) * 2,
        "peak_growth_bytes": grew,
    }
    engine.close()
    return result


def run_in_subprocess(mode: str, stage: int, hidden: int, layers: int, vocab: int) -> dict:
    """:func:`measure` in a fresh process with a fixed mmap threshold (see the module docstring)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024), "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as out_dir:
        cmd = [sys.executable, __file__, "--measure", mode, "--stage", str(stage), "--hidden", str(hidden),
               "--layers", str(layers), "--vocab", str(vocab), "--out", out_dir]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, nargs="+", default=[0, 3])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--json", action="store_true", help="print the raw numbers as JSON")
    parser.add_argument("--measure", choices=MODES, help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, args.stage[0], args.hidden, args.layers, args.vocab, args.out)))
        return 0
    rows = [run_in_subprocess(mode, stage, args.hidden, args.layers, args.vocab) for stage in args.stage for mode in MODES]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print("| stage | save | model (bf16) | largest tensor | peak host growth | growth / model |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['stage']} | {r['mode']} | {r['model_bytes_16bit'] / MiB:.1f} MiB | "
              f"{r['largest_tensor_bytes_16bit'] / MiB:.2f} MiB | {r['peak_growth_bytes'] / MiB:.1f} MiB | "
              f"{r['peak_growth_bytes'] / r['model_bytes_16bit']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
