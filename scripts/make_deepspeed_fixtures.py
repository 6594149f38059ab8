"""Make the DeepSpeed checkpoints hf_zero's tests read, with DeepSpeed itself.

Run with a Python where DeepSpeed imports (never hf_zero's environment; DeepSpeed is not a
dependency of hf_zero)::

    /tmp/ds-venv/bin/python scripts/make_deepspeed_fixtures.py [--out tests/unit/data/deepspeed_checkpoints] [--keep_full]

For each case (ZeRO stage x dtype: ZeRO-1/2/3 fp32, ZeRO-2/3 bf16, ZeRO-2 fp16 with dynamic loss
scaling, which DeepSpeed runs on its CPU accelerator) it trains a tiny GPT-2 (hidden 9, vocabulary 37, MLP 21: odd
sizes, so DeepSpeed pads its flat buffers and ZeRO-3's per-rank pieces) for 4 steps on 2 CPU ranks
with gloo (in bf16 with the position embedding frozen), under transformers' ``Trainer`` with ``deepspeed=ds.json`` and ``save_steps=2``, exactly
as a user's ``--deepspeed`` run does. It keeps ``checkpoint-2/`` and runs DeepSpeed's own
``deepspeed.utils.zero_to_fp32`` on it (``convert_zero_checkpoint_to_fp32_state_dict``) into
``<case>/zero_to_fp32/pytorch_model.bin`` (its torch.save output: its safetensors output refuses the
tied embedding): the reference hf_zero's reader is compared with.

Pruned from each kept checkpoint, to keep the fixtures small (listed in ``MANIFEST.json``; ``--keep_full``
keeps them): DeepSpeed's copies of ``zero_to_fp32.py``/``zero_to_torch.py`` (hf_zero never runs
them), ``model.safetensors`` (the Trainer's 16-bit save, not DeepSpeed's files),
``training_args.bin`` (hf_zero never loads it) and the ``rng_state_R.pth`` files (only a resume reads
them). Everything else is DeepSpeed's and the Trainer's files as written. ``MANIFEST.json`` records the versions, the configs, the losses of all 4 steps (what a
resumed run must log at steps 3-4) and each file's size.

Without a GPU, DeepSpeed under the Trainer needs two work-arounds (as bench/_bench_worker.py):
accelerate's ``PartialState(backend="gloo")`` with ``ACCELERATE_USE_DEEPSPEED=true`` and
``accelerator_config={"use_configured_state": True}``, and bf16 switched on after the arguments'
validation. The optimizer is the Trainer's own AdamW (no DeepSpeed op to build).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "tests" / "unit" / "data" / "deepspeed_checkpoints"
WORLD = 2
STEPS = 4
SAVE_STEPS = 2
PRUNED = ("zero_to_fp32.py", "zero_to_torch.py", "model.safetensors", "training_args.bin", "rng_state_0.pth", "rng_state_1.pth")
SEQ = 8
# Cases that also keep DeepSpeed's per-parameter optimizer state (ds_to_universal) as a reference.
UNIVERSAL_CASES = ("zero2_bf16", "zero2_fp16", "zero3_bf16")

# name -> (zero_optimization section, dtype)
CASES: dict[str, tuple[dict, str]] = {
    "zero1_fp32": ({"stage": 1}, "fp32"),
    "zero2_fp32": ({"stage": 2}, "fp32"),
    "zero2_bf16": ({"stage": 2}, "bf16"),
    "zero2_fp16": ({"stage": 2}, "fp16"),
    "zero3_fp32": ({"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}, "fp32"),
    # Small sub-groups: several fp32_flat_groups per rank.
    "zero3_bf16": ({"stage": 3, "sub_group_size": 300, "stage3_gather_16bit_weights_on_model_save": False}, "bf16"),
}

MODEL_CONFIG = dict(vocab_size=37, n_positions=SEQ, n_embd=9, n_layer=1, n_head=3, n_inner=21,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)


def ds_config(zero: dict, dtype: str) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if dtype == "fp16":  # dynamic loss scaling, a small first scale (DeepSpeed's fp16 runs on its CPU accelerator)
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    return config


# ----------------------------------------------------------------------------------------------- worker
def worker(case: str, out_dir: str, resume: str | None = None) -> None:
    """One rank of the Trainer + DeepSpeed run (under torchrun); ``resume``: a checkpoint to resume."""
    import torch
    import transformers
    from accelerate import PartialState
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer

    zero, dtype = CASES[case]
    config = ds_config(zero, dtype)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    common = dict(output_dir=out_dir, per_device_train_batch_size=2, max_steps=STEPS, save_steps=SAVE_STEPS,
                  save_strategy="steps", logging_steps=1, learning_rate=3e-2, weight_decay=0.01, warmup_steps=1,
                  lr_scheduler_type="linear", seed=7, report_to="none", disable_tqdm=True, save_only_model=False)
    args = transformers.TrainingArguments(**common, bf16=False, deepspeed=config,
                                          accelerator_config={"use_configured_state": True})
    if dtype in ("bf16", "fp16"):
        from accelerate.utils import DeepSpeedPlugin
        from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

        setattr(args, dtype, True)
        args.mixed_precision = dtype
        args.hf_deepspeed_config = HfTrainerDeepSpeedConfig(config)
        args.hf_deepspeed_config.trainer_config_process(args)
        args.deepspeed_plugin = DeepSpeedPlugin(hf_ds_config=args.hf_deepspeed_config)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**MODEL_CONFIG))
    if dtype == "bf16":  # a frozen parameter: DeepSpeed keeps it in the model-states files (frozen_param_*)
        model.transformer.wpe.weight.requires_grad_(False)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, MODEL_CONFIG["vocab_size"], (STEPS * WORLD * 2, SEQ), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]  # a list is a map-style dataset
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=resume)
    if int(os.environ.get("RANK", "0")) == 0:
        losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        Path(out_dir, "losses.json").write_text(json.dumps(losses))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------- driver
def _launch(case: str, out_dir: Path, resume: Path | None = None) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), "--master_port",
           str(29500 + sorted(CASES).index(case)), __file__, "--worker", case, str(out_dir)] + ([str(resume)] if resume else [])
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)


def resumed_losses(case: str, checkpoint: Path) -> list[float]:
    """The losses of all steps logged by DeepSpeed's own run resumed from ``checkpoint`` (a copy of it:
    its files are never changed), the first ``SAVE_STEPS`` from its trainer_state.json."""
    work = Path(tempfile.mkdtemp(prefix=f"ds-resume-{case}-"))
    try:
        shutil.copytree(checkpoint, work / checkpoint.name)
        _launch(case, work / "out", work / checkpoint.name)
        return json.loads((work / "out" / "losses.json").read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _file_sizes(dest: Path) -> dict[str, int]:
    return {str(p.relative_to(dest)): p.stat().st_size for p in sorted(dest.rglob("*"))
            if p.is_file() and p.name != "MANIFEST.json"}


def _reference_note(case: str) -> str:
    note = ("zero_to_fp32/: deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict"
            f"(checkpoint-{SAVE_STEPS}, safe_serialization=False) before pruning")
    if case in UNIVERSAL_CASES:
        note += ("; universal/optimizer_state.pt: deepspeed.checkpoint.ds_to_universal --inject_missing_state, "
                 "per parameter fp32/exp_avg/exp_avg_sq/step")
    return note


def universal_reference(tag_dir: Path, dest: Path) -> None:
    """DeepSpeed's own per-parameter optimizer state: ``ds_to_universal`` (``--inject_missing_state``:
    a Trainer run records no ``universal_checkpoint_info``) on a copy of ``tag_dir``, its
    ``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt`` gathered into ``dest/optimizer_state.pt`` =
    ``{name: {"fp32", "exp_avg", "exp_avg_sq", "step"}}`` (tensors only; the full folder is 45 small files)."""
    import torch

    work = Path(tempfile.mkdtemp(prefix="ds-universal-"))
    try:
        shutil.copytree(tag_dir, work / tag_dir.name)
        subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                        str(work / tag_dir.name), "--output_folder", str(work / "universal"), "--num_extract_workers",
                        "1", "--num_merge_workers", "1", "--inject_missing_state"], check=True)
        state = {}
        for folder in sorted((work / "universal" / "zero").iterdir()):
            if folder.is_dir():
                state[folder.name] = {}
                for key in ("fp32", "exp_avg", "exp_avg_sq", "step"):
                    if not (folder / f"{key}.pt").is_file():  # a shared parameter's folder (lm_head.weight): fp32 only
                        continue
                    value = torch.load(folder / f"{key}.pt", weights_only=False)  # DeepSpeed's own output
                    state[folder.name][key] = value["param"] if isinstance(value, dict) else value
        dest.mkdir(parents=True, exist_ok=True)
        torch.save(state, dest / "optimizer_state.pt")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def make_case(case: str, out_root: Path, keep_full: bool) -> dict:
    import deepspeed
    import torch
    import transformers

    zero, dtype = CASES[case]
    work = Path(tempfile.mkdtemp(prefix=f"ds-{case}-"))
    _launch(case, work / "out")
    checkpoint = work / "out" / f"checkpoint-{SAVE_STEPS}"
    dest = out_root / case
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    shutil.copytree(checkpoint, dest / checkpoint.name)
    # DeepSpeed's own conversion, from the full (unpruned) checkpoint.
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    # safe_serialization=False: DeepSpeed 0.19.8's safetensors path raises on tied weights ("Some tensors
    # share memory": GPT-2's lm_head.weight is transformer.wte.weight); its torch.save path writes both names.
    convert_zero_checkpoint_to_fp32_state_dict(str(checkpoint), str(dest / "zero_to_fp32"), safe_serialization=False)
    if case in UNIVERSAL_CASES:
        universal_reference(checkpoint / f"global_step{SAVE_STEPS}", dest / "universal")
    pruned = []
    if not keep_full:
        for name in PRUNED:
            if (dest / checkpoint.name / name).exists():
                (dest / checkpoint.name / name).unlink()
                pruned.append(name)
    files = _file_sizes(dest)
    record = {
        "deepspeed_version": deepspeed.__version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "world_size": WORLD,
        "dtype": dtype,
        "ds_config": ds_config(zero, dtype),
        "model_config": MODEL_CONFIG,
        "steps": STEPS,
        "save_steps": SAVE_STEPS,
        "losses": json.loads((work / "out" / "losses.json").read_text()),
        "pruned": pruned,
        "reference": _reference_note(case),
        "files": files,
    }
    record["resumed_losses"] = resumed_losses(case, dest / checkpoint.name)  # from the pruned files, as tests read them
    (dest / "MANIFEST.json").write_text(json.dumps(record, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return record


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(argv[1], argv[2], argv[3] if len(argv) > 3 else None)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--keep_full", action="store_true", help="do not prune the checkpoints")
    parser.add_argument("--resumed_only", action="store_true",
                        help="only (re)record DeepSpeed's own losses resumed from each existing case's checkpoint")
    parser.add_argument("--universal_only", action="store_true",
                        help="only (re)make the ds_to_universal reference of the existing cases in --out")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.resumed_only:
        for case in args.cases.split(","):
            record = json.loads((out / case / "MANIFEST.json").read_text())
            record["resumed_losses"] = resumed_losses(case, out / case / f"checkpoint-{SAVE_STEPS}")
            (out / case / "MANIFEST.json").write_text(json.dumps(record, indent=1) + "\n")
            print(f"{case}: resumed losses {record['resumed_losses']}", flush=True)
        return 0
    if args.universal_only:
        for case in args.cases.split(","):
            if case in UNIVERSAL_CASES:
                dest = out / case
                universal_reference(dest / f"checkpoint-{SAVE_STEPS}" / f"global_step{SAVE_STEPS}", dest / "universal")
                record = json.loads((dest / "MANIFEST.json").read_text())
                record["reference"] = _reference_note(case)
                record["files"] = _file_sizes(dest)
                (dest / "MANIFEST.json").write_text(json.dumps(record, indent=1) + "\n")
        return 0
    for case in args.cases.split(","):
        record = make_case(case, out, args.keep_full)
        print(f"{case}: {sum(record['files'].values())} bytes, losses {record['losses']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
