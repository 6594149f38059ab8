"""Two-import ZeroTrainer script (launched with torchrun) that exercises what users touch beyond
plain training: LoRA (peft) with gradient checkpointing, evaluate, predict, generate, MoE blocks.

    torchrun --nproc_per_node 2 scripts/zero_trainer_worker.py OUT_DIR SCENARIO:STAGE [SCENARIO:STAGE ...]

Runs each scenario in turn in the same two processes (one launch: the interpreter start and the
imports cost more than a tiny run) and writes OUT_DIR/SCENARIO-sSTAGE/result.json on rank 0 with
what the test compares. ``save_fails`` breaks rank 0's model writer for good: list it last.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_zero import ZeroTrainer, ZeroTrainingArguments
from hf_zero.checkpoint.export16 import gather_full_state_dict

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "distributed"))
from _models import tiny_model  # noqa: E402


def dataset(n: int, seq: int = 24, vocab: int = 128) -> Dataset:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab, (n, seq), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def main() -> None:
    root = Path(sys.argv[1])
    for run in sys.argv[2:]:
        scenario, stage = run.split(":")
        out = root / f"{scenario}-s{stage}"
        out.mkdir(parents=True, exist_ok=True)
        run_scenario(scenario, int(stage), out)


def run_scenario(scenario: str, stage: int, out: Path) -> None:
    cfg = {
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": "auto"},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
    }
    common = dict(
        output_dir=str(out), zero_config=cfg, per_device_train_batch_size=2, per_device_eval_batch_size=2,
        max_steps=3, logging_steps=1, report_to="none", save_strategy="no", learning_rate=5e-3, seed=5,
    )
    result: dict = {}
    if scenario == "lora":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(REPO / "assets" / "tiny-qwen2")
        tok = AutoTokenizer.from_pretrained(REPO / "assets" / "tiny-qwen2")
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"]))
        args = ZeroTrainingArguments(gradient_checkpointing=True, **common)
        trainer = ZeroTrainer(model=model, args=args, train_dataset=dataset(16, vocab=500), eval_dataset=dataset(4, vocab=500), processing_class=tok)
        trainer.train()
        result["eval"] = trainer.evaluate()
        pred = trainer.predict(dataset(4, vocab=500))
        result["predict_shape"] = list(pred.predictions.shape)
        prompt = tok("hello", return_tensors="pt")
        with torch.no_grad():
            gen = trainer.model.generate(**prompt, max_new_tokens=5, do_sample=False)
        result["generated_len"] = int(gen.shape[1] - prompt["input_ids"].shape[1])
        trainer.save_model()
        adapter = gather_full_state_dict(trainer.model, dtype=torch.float32, state_dict_filter=lambda k: "lora_" in k)
        result["frozen_sharded"] = stage == 3 and all(
            hasattr(p, "to_local") and p.to_local().numel() < p.numel() for n, p in trainer.model.named_parameters() if not p.requires_grad and p.dim() == 2 and p.shape[0] >= 2
        )
        if trainer.args.should_save:
            torch.save(adapter, out / "engine_adapter.pt")
    elif scenario == "save_fails":
        # Rank 0 cannot write the model (a full disk): every rank must get an error, none may wait.
        import errno

        args = ZeroTrainingArguments(ddp_timeout=120, **common)
        trainer = ZeroTrainer(model=tiny_model("llama"), args=args, train_dataset=dataset(16))
        trainer.train()
        if trainer.args.process_index == 0:
            from hf_zero.checkpoint import export16

            class FullDisk(export16.SafetensorsStreamWriter):  # the disk fills up in the weights file
                def write(self, name, tensor):
                    raise OSError(errno.ENOSPC, "No space left on device")

            export16.SafetensorsStreamWriter = FullDisk
        try:
            trainer.save_model()
            result["save_error"] = None
        except Exception as exc:
            result["save_error"] = f"{type(exc).__name__}: {exc}"
        errors = [None, None]
        torch.distributed.all_gather_object(errors, result["save_error"])
        result["save_errors"] = errors
    elif scenario == "moe":
        args = ZeroTrainingArguments(**common)
        trainer = ZeroTrainer(model=tiny_model("qwen2_moe"), args=args, train_dataset=dataset(16))
        trainer.train()
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    result["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    result["grad_norms"] = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    result["world_size"] = trainer.args.world_size
    if trainer.args.should_save:
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    from hf_zero.distributed.env import exit_cleanly

    exit_cleanly(0)
