"""One configuration of the side-by-side fine-tune; ``bench/run_bench.py`` runs it under torchrun.

    torchrun --nproc_per_node 2 bench/_bench_worker.py SPEC.json

SPEC.json (written by the driver) names the configuration (``kind``: ``ddp``, ``fsdp2``,
``hf_zero`` or ``deepspeed``), the model folder, the workload and where to write results. Every
kind runs the same ``transformers.Trainer`` loop on the same synthetic data:

* ``ddp``: plain ``Trainer`` (DistributedDataParallel under accelerate);
* ``fsdp2``: ``Trainer`` with ``fsdp=True, fsdp_config={"version": 2, ...}`` (accelerate's FSDP2);
* ``hf_zero``: ``ZeroTrainer`` / ``ZeroTrainingArguments(zero_config=...)``;
* ``deepspeed``: ``Trainer`` with ``deepspeed=config`` (run by a Python where DeepSpeed imports).

Each rank writes ``rank<N>.json``: per-step wall times (a TrainerCallback, after a device sync),
logged losses, RSS after imports (the baseline), peak RSS (``ru_maxrss``), peak accelerator memory
(``torch.cuda.max_memory_allocated``; None without CUDA). This file imports only torch,
transformers (and hf_zero, peft, deepspeed when the configuration needs them) and ``_bench_lib``.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _bench_lib as lib  # noqa: E402


def rss_bytes() -> int:
    """Current resident set size of this process (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (``ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    out_dir = Path(spec["result_dir"])
    record: dict = {"rank": rank, "local_rank": local_rank, "world_size": world, "node": socket.gethostname()}
    t_start = time.perf_counter()
    try:
        run(spec, record, rank, local_rank, world)
        record["status"] = "ok"
    except BaseException as exc:  # recorded, then re-raised so torchrun reports the failure
        record["status"] = "failed"
        record["error"] = "".join(traceback.format_exception(exc))[-4000:]
        record["peak_rss_bytes"] = peak_rss_bytes()
        (out_dir / f"rank{rank}.json").write_text(json.dumps(record, indent=1))
        raise
    record["wall_s"] = time.perf_counter() - t_start
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record, indent=1))
    # Leave no communicator threads behind for the interpreter's exit (a DeepSpeed ZeRO-3 run on
    # gloo has aborted there with "terminate called without an active exception").
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run(spec: dict, record: dict, rank: int, local_rank: int, world: int) -> None:
    kind = spec["kind"]
    import torch
    import transformers
    import transformers.trainer  # the Trainer's own imports (accelerate, ...) belong to the baseline
    from transformers import AutoModelForCausalLM, TrainerCallback

    if kind == "hf_zero":
        sys.path.insert(0, spec["repo"])
        from hf_zero import ZeroTrainer, ZeroTrainingArguments  # noqa: F401
    if kind == "deepspeed":
        import deepspeed

        record["deepspeed_version"] = deepspeed.__version__
    if spec.get("lora_rank"):
        import peft  # noqa: F401
    torch.manual_seed(spec["seed"])
    record["torch_version"] = torch.__version__
    record["transformers_version"] = transformers.__version__
    record["baseline_rss_bytes"] = rss_bytes()

    cuda = torch.cuda.is_available()
    record["cuda"] = cuda
    if cuda:
        torch.cuda.set_device(local_rank)
        props = torch.cuda.get_device_properties(local_rank)
        record["device_name"] = props.name
        record["device_total_bytes"] = props.total_memory
        cap = spec.get("gpu_memory_cap_bytes")
        if cap:
            frac = lib.memory_cap_fraction(cap, props.total_memory)
            torch.cuda.set_per_process_memory_fraction(frac, local_rank)
            record["gpu_memory_cap_bytes"] = cap
            record["gpu_memory_fraction"] = frac
    elif spec.get("gpu_memory_cap_bytes"):
        print("[bench] --gpu_memory_cap ignored: no CUDA device in this process", file=sys.stderr)

    args = build_training_args(spec, cuda)

    # Full fine-tuning loads fp32 weights (mixed precision keeps fp32 masters); LoRA loads the frozen
    # base in the compute dtype, as LoRA recipes do (peft keeps the adapters in fp32).
    load_dtype = torch.bfloat16 if spec.get("lora_rank") and spec["dtype"] == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=load_dtype)
    if spec.get("gradient_checkpointing"):
        model.config.use_cache = False
    if spec.get("lora_rank"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(r=spec["lora_rank"], lora_alpha=2 * spec["lora_rank"], target_modules="all-linear", task_type="CAUSAL_LM"),
        )
    record["params"] = sum(p.numel() for p in model.parameters())
    record["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    record["rss_after_load_bytes"] = rss_bytes()

    dataset = SyntheticTokens(
        num_samples=spec["steps"] * spec["micro_batch"] * spec["grad_accum"] * world,
        seq_len=spec["seq_len"],
        vocab=model.config.vocab_size if not spec.get("lora_rank") else model.base_model.model.config.vocab_size,
        seed=spec["seed"],
    )

    step_times: list[float] = []
    losses: list[float] = []

    class StepTimer(TrainerCallback):
        """Wall time between consecutive optimizer-step ends (the first from the start of training)."""

        def _now(self) -> float:
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_begin(self, args, state, control, **kw):
            self.t = self._now()

        def on_step_end(self, args, state, control, **kw):
            now = self._now()
            step_times.append(now - self.t)
            self.t = now

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    trainer_cls = transformers.Trainer
    if kind == "hf_zero":
        from hf_zero import ZeroTrainer

        trainer_cls = ZeroTrainer
    if cuda:
        torch.cuda.reset_peak_memory_stats(local_rank)
    callbacks = [StepTimer()]
    profile = None
    if spec.get("memory_profile"):  # accelerator memory with CUDA, else this process's host memory
        from _memory_profile import MemoryProfile

        profile = MemoryProfile(model, int(spec["memory_profile"]))
        profile.loaded()
        callbacks.append(profile.callback)
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset, callbacks=callbacks)
    trainer.train()
    if profile is not None and rank == 0:
        from _memory_profile import render_markdown

        out = Path(spec["result_dir"])
        (out / "memory_profile.json").write_text(json.dumps(profile.result(), indent=1))
        (out / "memory_profile.md").write_text(render_markdown(spec["name"], profile.phases, profile.peak, profile.setup_peak))

    record["step_times_s"] = step_times
    record["losses"] = losses
    record["final_loss"] = losses[-1] if losses else None
    record["peak_rss_bytes"] = peak_rss_bytes()
    if profile is not None:
        record["memory_profile"] = profile.result()
        if not cuda:  # the host profile resets the high-water mark per phase; it kept the overall peak
            record["peak_rss_bytes"] = max(record["peak_rss_bytes"], profile.overall_peak)
    record["end_rss_bytes"] = rss_bytes()
    if cuda:
        record["peak_accel_bytes"] = torch.cuda.max_memory_allocated(local_rank)
        if profile is not None:  # the profile resets the counter per phase; it kept the overall peak
            record["peak_accel_bytes"] = max(record["peak_accel_bytes"], profile.overall_peak)
        record["peak_accel_reserved_bytes"] = torch.cuda.max_memory_reserved(local_rank)
    else:
        record["peak_accel_bytes"] = None
    record["optimizer"] = type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__
    # What actually ran: accelerate's distributed type and the wrapped model's class (FSDP2 wraps
    # in place: its class name starts with "FSDP").
    record["distributed_type"] = str(trainer.accelerator.distributed_type)
    record["wrapped_model"] = type(trainer.model_wrapped).__name__
    record["fsdp2_modules"] = sum(type(m).__name__.startswith("FSDP") for m in trainer.model_wrapped.modules())
    if kind == "deepspeed":
        ds_engine = trainer.model_wrapped
        record["deepspeed_engine"] = {
            "zero_stage": ds_engine.zero_optimization_stage(),
            "bf16": bool(ds_engine.bfloat16_enabled()),
            "fp16": bool(ds_engine.fp16_enabled()),
            "optimizer": type(ds_engine.optimizer).__name__,
            "offload_optimizer": ds_engine.zero_offload_optimizer() is not None and str(ds_engine.zero_offload_optimizer().device),
        }
    engine = getattr(trainer, "zero_engine", None)
    if engine is not None and hasattr(engine, "memory_report"):
        try:
            record["engine_memory_report"] = engine.memory_report()
        except Exception as exc:  # a report is a bonus, not a result
            record["engine_memory_report_error"] = repr(exc)
    del trainer


def build_training_args(spec: dict, cuda: bool):
    """The TrainingArguments of this configuration (identical workload for every kind)."""
    import transformers

    kind = spec["kind"]
    common = dict(
        output_dir=str(Path(spec["result_dir"]) / "trainer_out"),
        per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=spec["grad_accum"],
        max_steps=spec["steps"],
        learning_rate=spec["learning_rate"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=spec["seed"],
        dataloader_num_workers=0,
        gradient_checkpointing=bool(spec.get("gradient_checkpointing")),
        bf16=spec["dtype"] == "bf16",
    )
    if kind == "ddp":
        if not cuda:
            common["use_cpu"] = True
        if spec.get("lora_rank"):
            common["ddp_find_unused_parameters"] = False
        return transformers.TrainingArguments(**common)
    if kind == "fsdp2":
        fsdp = dict(
            fsdp=True,
            fsdp_config={
                "version": 2,
                "reshard_after_forward": True,
                "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                "transformer_layer_cls_to_wrap": spec["layer_cls"],
                "state_dict_type": "SHARDED_STATE_DICT",
            },
        )
        if cuda:
            return transformers.TrainingArguments(**common, **fsdp)
        return fsdp_cpu_args(common, fsdp)
    if kind == "hf_zero":
        from hf_zero import ZeroTrainingArguments

        return ZeroTrainingArguments(**common, zero_config=spec["zero_config"])
    if kind == "deepspeed":
        if cuda:
            return transformers.TrainingArguments(**common, deepspeed=spec["zero_config"])
        return deepspeed_cpu_args(common, spec["zero_config"])
    raise ValueError(f"unknown kind {kind!r}")


def fsdp_cpu_args(common: dict, fsdp: dict):
    """``TrainingArguments(fsdp=True, ...)`` that really shards on a machine without a GPU.

    accelerate turns FSDP on only for accelerator process groups (``MULTI_GPU``, ``MULTI_XPU``, ...);
    with ``use_cpu`` the Trainer silently runs DDP instead. Work-around: set up accelerate's state
    first (gloo, the FSDP2 plugin the arguments describe, distributed type FSDP) and tell the
    arguments to use it (``use_configured_state``). FSDP2 itself runs on CPU tensors and gloo.
    """
    import transformers
    from accelerate import PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, TorchDynamoPlugin

    PartialState(cpu=True, backend="gloo")
    args = transformers.TrainingArguments(**common, **fsdp, use_cpu=True, accelerator_config={"use_configured_state": True})
    plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    state = AcceleratorState(mixed_precision=args.mixed_precision, cpu=True, fsdp_plugin=plugin,
                             dynamo_plugin=TorchDynamoPlugin(), _from_accelerator=True)
    # AcceleratorState copies PartialState's fields each time it is constructed: set both.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.distributed_type = DistributedType.FSDP
    if args.mixed_precision != "no":
        plugin.set_mixed_precision(args.mixed_precision)
    state.fsdp_plugin = plugin
    return args


def deepspeed_cpu_args(common: dict, ds_config: dict):
    """``TrainingArguments(deepspeed=...)`` on a machine without a GPU.

    transformers sets DeepSpeed up only on accelerators: with ``use_cpu`` it ignores DeepSpeed and
    without it it asks accelerate for an NCCL/ccl process group. Work-around: build accelerate's
    ``PartialState`` for DeepSpeed with gloo first and tell the arguments to use it
    (``use_configured_state``); bf16 is switched on after the arguments' validation, which refuses
    bf16 on a CPU that is not marked ``use_cpu``.
    """
    import transformers
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    bf16 = common.pop("bf16")
    args = transformers.TrainingArguments(**common, bf16=False, deepspeed=ds_config, accelerator_config={"use_configured_state": True})
    if bf16:
        # The HF DeepSpeed config resolved "auto" from bf16=False: set bf16 and rebuild it and the
        # accelerate plugin, as Trainer does for hyper-parameter sweeps.
        from accelerate.utils import DeepSpeedPlugin
        from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

        args.bf16 = True
        args.mixed_precision = "bf16"
        args.hf_deepspeed_config = HfTrainerDeepSpeedConfig(ds_config)
        args.hf_deepspeed_config.trainer_config_process(args)
        args.deepspeed_plugin = DeepSpeedPlugin(hf_ds_config=args.hf_deepspeed_config)
    return args


class SyntheticTokens:
    """Learnable synthetic sequences: each sample counts up from a random start with a random stride
    (mod vocabulary), so the loss falls as the model learns the rule. Same data for every config."""

    def __init__(self, num_samples: int, seq_len: int, vocab: int, seed: int):
        import torch

        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (num_samples, 1), generator=g)
        stride = torch.randint(1, 8, (num_samples, 1), generator=g)
        self.ids = (start + stride * torch.arange(seq_len)) % vocab

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: torchrun ... bench/_bench_worker.py SPEC.json")
    main(sys.argv[1])
