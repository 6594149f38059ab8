"""Per-rank peak host memory of one Accelerator LoRA loop: hf_zero's ZeRO-3 with parameter offload
against accelerate's own FSDP2 with CPU offload (and accelerate's DDP as a baseline), on CPU.

    OMP_NUM_THREADS=1 python bench/accelerate_fsdp_memory.py --d_model 768 --layers 8 --vocab 16384 --steps 4

The training script is the same for every launcher: a T5 + LoRA loop in the shape of PEFT's FSDP
guide (source 003; ``examples/peft_accelerate``), built from a config (d_model, layers given here)
and saved once, then ``from_pretrained`` in every rank. The launchers, each with 2 CPU ranks:

- ``hf_zero``: ``hf-zero run --config_file fsdp.yaml`` (FULL_SHARD, ``fsdp_offload_params: true``,
  TRANSFORMER_BASED_WRAP ``T5Block``): ZeRO-3 with parameter and optimizer offload;
- ``accelerate_fsdp``: the variables ``accelerate launch --config_file fsdp.yaml`` gives its ranks
  (accelerate's own ``prepare_multi_gpu_env``), run by torchrun. accelerate runs FSDP only on
  accelerators (on CPU it silently runs DDP), so the worker sets accelerate's state up for FSDP on
  gloo first (as ``bench/_bench_worker.py`` does for ``Trainer --fsdp``); the offload policy is not
  pinned (pinning needs an accelerator); ``sync_module_states``/``cpu_ram_efficient_loading`` are
  off (each rank loads the checkpoint itself); T5's three embedding modules are made one module
  (accelerate 1.15 + torch 2.13 refuse to shard T5 otherwise, see ``_one_embedding_module``);
- ``accelerate_ddp``: the same script without FSDP (every rank holds the whole model).

Source 003 replaces the plugin's wrap policy with PEFT's ``fsdp_auto_wrap_policy``; accelerate's
FSDP2 path ignores that FSDP1 policy and would shard the root only, so the bench keeps the YAML's
``T5Block`` units for both FSDP rows (the "FSDP2 units" column shows what was built).

Each rank reports its resident set (MiB) above a baseline taken after the libraries are imported
and before the model is loaded: after ``from_pretrained`` (safetensors pages are mapped lazily, so
little is resident yet), the peak during ``accelerator.prepare``, after it, and the peak during
training (``VmHWM`` reset through ``/proc/self/clear_refs``; glibc serves allocations above 128 KiB
with mmap so freed tensors leave the resident set). On CPU "device" and "host" memory are the same
memory: the numbers say what each approach keeps resident per rank, not what a GPU would hold.
Prints Markdown tables (with ratios of the busiest rank against each launcher); ``--json`` the raw
numbers.
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
FSDP_YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_offload_params: true
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: T5Block
  fsdp_cpu_ram_efficient_loading: false
  fsdp_sync_module_states: false
mixed_precision: 'no'
num_machines: 1
num_processes: 2
"""


def _reset_peak() -> None:
    """VmHWM := current RSS, so the next VmHWM read is the peak since now (Linux clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) * 1024


# ------------------------------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> None:
    """The training script every launcher runs (source 003's loop on the saved tiny-to-small T5)."""
    import gc

    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from peft import LoraConfig, TaskType, get_peft_model
    from torch.utils.data import DataLoader
    from transformers import AutoModelForSeq2SeqLM

    sys.path.insert(0, str(REPO / "examples" / "peft_accelerate"))
    from peft_lora_seq2seq_accelerate_fsdp import make_examples, make_tokenizer

    accelerator = _accelerate_fsdp_on_cpu() if args.launcher == "accelerate_fsdp" else Accelerator()
    # What prepare imports lazily (preparing a DataLoader imports ``datasets``, with pandas and
    # pyarrow: ~80 MiB), imported before the baseline so that libraries do not count as model memory.
    import accelerate.utils.fsdp_utils  # noqa: F401
    import datasets  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    set_seed(42)
    tokenizer = make_tokenizer()
    gc.collect()
    base = _status("VmRSS")  # interpreter + libraries of this launcher, no model yet
    model = AutoModelForSeq2SeqLM.from_pretrained(args.base)
    model = get_peft_model(model, LoraConfig(task_type=TaskType.SEQ_2_SEQ_LM, r=8, lora_alpha=32, lora_dropout=0.1))

    def collate(rows):
        inputs = tokenizer([r["sentence"] for r in rows], padding=True, return_tensors="pt")
        labels = tokenizer([r["text_label"] for r in rows], padding=True, return_tensors="pt")["input_ids"]
        labels[labels == tokenizer.pad_token_id] = -100
        return {**inputs, "labels": labels}

    loader = DataLoader(make_examples(args.steps * 2 * args.batch, seed=1), batch_size=args.batch, collate_fn=collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # Source 003 sets ``fsdp_plugin.auto_wrap_policy = peft.utils.other.fsdp_auto_wrap_policy(model)``
    # here. That is an FSDP1 policy: accelerate's FSDP2 path does not recognise it and then shards the
    # root only (the whole model gathered at once), so the bench keeps the YAML's T5Block wrapping,
    # the same units hf_zero builds.
    if args.launcher == "accelerate_fsdp":
        _one_embedding_module(model)
    gc.collect()
    loaded = _status("VmRSS")
    _reset_peak()
    model, loader, optimizer = accelerator.prepare(model, loader, optimizer)
    gc.collect()
    prepare_peak, prepared = _status("VmHWM"), _status("VmRSS")
    _reset_peak()
    model.train()
    losses = []
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    train_peak = _status("VmHWM")
    from torch.distributed.fsdp import FSDPModule

    report = {"launcher": args.launcher, "rank": accelerator.process_index,
              "distributed_type": str(accelerator.distributed_type),
              # What really ran: FSDP2 units in the prepared model (0 = nothing sharded, e.g. DDP).
              "fsdp_units": sum(isinstance(m, FSDPModule) for m in model.modules()),
              # Everything below is above ``base``: what the model and training added to the process.
              "base_mib": base / MiB, "loaded_mib": (loaded - base) / MiB,
              "prepare_peak_mib": (prepare_peak - base) / MiB, "prepared_mib": (prepared - base) / MiB,
              "train_peak_mib": (train_peak - base) / MiB, "losses": losses}
    with open(os.path.join(args.out, f"{args.launcher}-{accelerator.process_index}.json"), "w") as f:
        json.dump(report, f)
    accelerator.wait_for_everyone()


def _accelerate_fsdp_on_cpu():
    """An ``Accelerator`` that runs accelerate's own FSDP2 on CPU ranks.

    accelerate turns FSDP on only for accelerator process groups (``MULTI_GPU``, ``MULTI_XPU``, ...):
    with ``ACCELERATE_USE_CPU`` it silently runs DDP. As ``bench/_bench_worker.py`` does for the
    Trainer, set accelerate's state up first (gloo, the FSDP plugin built from the ``FSDP_*``
    variables ``accelerate launch`` exported, distributed type FSDP); the ``Accelerator`` then uses
    it and ``prepare`` calls accelerate's ``fsdp2_prepare_model`` on CPU tensors.
    """
    import torch
    from accelerate import Accelerator, PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, TorchDynamoPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    PartialState(cpu=True, backend="gloo")
    plugin = FullyShardedDataParallelPlugin()
    if isinstance(plugin.cpu_offload, CPUOffloadPolicy) and not torch.cuda.is_available():
        # accelerate's CPUOffloadPolicy() pins the host shards, which needs an accelerator; the
        # offload itself (shards and optimizer state on the host) is the same without pinning.
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
    state = AcceleratorState(cpu=True, fsdp_plugin=plugin, dynamo_plugin=TorchDynamoPlugin(), _from_accelerator=True)
    # AcceleratorState copies PartialState's fields each time it is constructed: set both.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    accelerator = Accelerator(cpu=True)
    if accelerator.distributed_type != DistributedType.FSDP:
        raise SystemExit(f"accelerate did not keep FSDP on CPU (got {accelerator.distributed_type}): the row would be DDP")
    return accelerator


def _one_embedding_module(model) -> None:
    """Let accelerate's FSDP2 shard a T5: make its three embedding modules one module.

    T5 ties ``shared``, ``encoder.embed_tokens`` and ``decoder.embed_tokens`` (three ``nn.Embedding``
    objects, one weight) and ``lm_head``. accelerate 1.15's ``fsdp2_prepare_model`` puts ``shared``
    and ``lm_head`` in one unit and leaves the stacks' ``embed_tokens`` to the root, which torch
    2.13's FSDP2 refuses ("shared with a parameter already managed by another FSDP group"). With
    the stacks pointing at the ``shared`` module itself the weight, the numerics and the memory are
    unchanged and the module is in one unit.
    """
    base = model.get_base_model()
    for stack in (base.encoder, base.decoder):
        if stack.embed_tokens is not base.shared and stack.embed_tokens.weight is base.shared.weight:
            stack.embed_tokens = base.shared


# ------------------------------------------------------------------------------------------- driver
def _env(extra: dict[str, str]) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": "131072", **extra}


def _accelerate_fsdp_env(config: Path) -> dict[str, str]:
    """What accelerate's launcher exports for ``accelerate launch --config_file config``."""
    import accelerate.commands.launch as launch
    from accelerate.utils.launch import prepare_multi_gpu_env

    args, _, _ = launch._validate_launch_command(launch.launch_command_parser().parse_args(
        ["--config_file", str(config), "x.py"]))
    env = {k: v for k, v in prepare_multi_gpu_env(args).items() if k.startswith(("ACCELERATE_", "FSDP_"))}
    env["ACCELERATE_USE_CPU"] = "true"
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--launcher", help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--d_model", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8, help="blocks in the encoder and in the decoder")
    parser.add_argument("--vocab", type=int, default=16384, help="embedding rows (the task uses the first few)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    with tempfile.TemporaryDirectory(prefix="hf_zero_acc_bench_") as tmp:
        _bench(args, Path(tmp))


def _bench(args: argparse.Namespace, tmp: Path) -> None:
    """Save the base model under ``tmp``, run every launcher on it, print the tables."""
    import torch
    from transformers import AutoModelForSeq2SeqLM, T5Config

    base = tmp / "base"
    config = T5Config(vocab_size=args.vocab, d_model=args.d_model, d_kv=64, d_ff=4 * args.d_model,
                      num_layers=args.layers, num_heads=max(1, args.d_model // 64), decoder_start_token_id=0,
                      pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = AutoModelForSeq2SeqLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(base)
    del model
    (tmp / "fsdp.yaml").write_text(FSDP_YAML)
    common = ["--worker", "--base", str(base), "--out", str(tmp), "--steps", str(args.steps), "--batch", str(args.batch)]
    me = str(Path(__file__).resolve())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", me]
    runs = {
        "hf_zero": ([sys.executable, "-m", "hf_zero.cli.main", "run", "--config_file", str(tmp / "fsdp.yaml"), me],
                    {}),
        "accelerate_fsdp": (torchrun, _accelerate_fsdp_env(tmp / "fsdp.yaml")),
        "accelerate_ddp": (torchrun, {"ACCELERATE_USE_CPU": "true"}),
    }
    for name, (cmd, extra) in runs.items():
        proc = subprocess.run([*cmd, *common, "--launcher", name], capture_output=True, text=True, cwd=REPO,
                              env=_env(extra), timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = [json.loads((tmp / f"{name}-{rank}.json").read_text()) for name in runs for rank in (0, 1)]
    if args.json:
        print(json.dumps({"params": params, "rows": rows}, indent=1))
        return
    print(f"T5 d_model={args.d_model} layers={args.layers}+{args.layers} vocab={args.vocab}: {params / 1e6:.1f} M "
          f"parameters ({params * 4 / MiB:.0f} MiB fp32); LoRA r=8; 2 CPU ranks; {args.steps} steps of batch "
          f"{args.batch} per rank\n")
    print("MiB above each rank's RSS before loading the model (interpreter and libraries of that launcher)\n")
    print("| launcher | accelerate's distributed_type | FSDP2 units | rank | loaded model | peak in prepare | "
          "after prepare | peak in training | losses |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['launcher']} | {r['distributed_type'].split('.')[-1]} | {r['fsdp_units']} | {r['rank']} | "
              f"{r['loaded_mib']:.0f} | {r['prepare_peak_mib']:.0f} | {r['prepared_mib']:.0f} | "
              f"{r['train_peak_mib']:.0f} | {' '.join(f'{x:.4f}' for x in r['losses'])} |")
    # Ratios of the busiest rank: the training peak is what the source's "1.65x the GPU memory" is about.
    for key, what in (("train_peak_mib", "peak in training"), ("prepared_mib", "resident after prepare")):
        top = {name: max(r[key] for r in rows if r["launcher"] == name) for name in runs}
        print(f"\n| {what}, max rank | MiB | " + " | ".join(f"vs {n}" for n in runs) + " |")
        print("|---|---:|" + "---:|" * len(runs))
        for name in runs:
            print(f"| {name} | {top[name]:.0f} | " + " | ".join(f"{top[name] / top[o]:.2f}x" for o in runs) + " |")

if __name__ == "__main__":
    main()
