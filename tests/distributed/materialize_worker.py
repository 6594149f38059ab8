"""Run under torchrun: low-memory loading (meta model on local rank != 0) + shard fill from rank 0.

    torchrun --standalone --nproc_per_node 2 tests/distributed/materialize_worker.py WORKDIR OUT.json

Rank 0 saves tiny models into WORKDIR; every rank loads them inside ``low_memory_loading()``,
shards them at ZeRO-3 (``hf_zero.initialize``) and checks, against the saved files and an
unsharded reference model, the gathered weights, the buffers, tied embeddings and the logits;
also LoRA, resized embeddings, and a ZeroTrainer run after ``install_low_memory_loading()``
against a normally loaded one. Every check is recorded (not asserted) per rank; rank 0 writes
``{check: {rank: [ok, detail]}}``.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from _models import VOCAB, tiny_model  # noqa: E402

RESULTS: dict[str, list] = {}
TIMINGS: dict[str, float] = {}
ZERO3 = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
}


def check(name: str, ok: bool, detail: str = "") -> None:
    RESULTS[name] = [bool(ok), str(detail)]


def _integrate_stage() -> None:
    """The real FullyShardedStage.wrap must fill meta shards from rank 0: the checks below run
    through it (a copy of the stage here would test the copy, not hf_zero)."""
    from hf_zero.engine import stages

    integrated = "sharded_from_rank0" in inspect.getsource(stages.FullyShardedStage.wrap)
    RESULTS["stage_integrated"] = [integrated, "FullyShardedStage.wrap calls sharded_from_rank0"]


def full_state(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer gathered to a full CPU tensor (collective)."""
    from hf_zero.distributed.collectives import on_mesh_device

    out = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
        # on_mesh_device: offloaded shards live in host memory, which NCCL cannot gather.
        full = on_mesh_device(t).full_tensor() if hasattr(t, "full_tensor") else t
        out[name] = full.detach().cpu().clone()
    return out


def compare(prefix: str, got: dict, want: dict, strip: str = "") -> None:
    """``got`` (gathered, FQNs maybe prefixed) must equal ``want`` bit for bit on every key of want."""
    bad, missing = [], []
    got = {k.replace(strip, "") if strip else k: v for k, v in got.items()}
    for k, v in want.items():
        if k not in got:
            missing.append(k)
        elif got[k].shape != v.shape or got[k].dtype != v.dtype or not torch.equal(got[k], v):
            bad.append(k)
    check(f"{prefix}/weights_equal", not bad and not missing, f"differ={bad[:4]} missing={missing[:4]} n={len(want)}")


def input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids()).logits.detach().float().cpu()


def load(path: str, **kw):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", **kw)


def tied(model) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.lm_head.weight is base.get_input_embeddings().weight


@contextlib.contextmanager
def full_params_at_first_shard(model):
    """Records, when hf_zero first calls torch's ``fully_shard``, how many bytes of ``model``'s
    parameters are allocated whole on this rank (not meta, not yet a DTensor shard)."""
    import torch.distributed.fsdp as fsdp

    original = fsdp.fully_shard
    held: list[int] = []

    def recording(module, *args, **kwargs):
        if not held:
            held.append(sum(p.numel() * p.element_size() for p in model.parameters()
                            if not p.is_meta and not hasattr(p, "placements")))
        return original(module, *args, **kwargs)

    fsdp.fully_shard = recording
    try:
        yield held
    finally:
        fsdp.fully_shard = original


def run_plain(workdir: str, kind: str, bf16: bool = False, offload: bool = False) -> None:
    """from_pretrained under low_memory_loading -> hf_zero.initialize at stage 3 -> compare.

    ``bf16``: load in bf16 and train with bf16 enabled (fp32 master shards made from bf16 weights).
    ``offload``: parameters and optimizer state offloaded to the CPU (FSDP2's CPU offload policy)."""
    import hf_zero
    from safetensors.torch import load_file

    from hf_zero.engine.materialize import has_meta_params, low_memory_loading

    rank = dist.get_rank()
    path = os.path.join(workdir, kind)
    kw = {"dtype": torch.bfloat16} if bf16 else {}
    config = {**ZERO3, "bf16": {"enabled": True}} if bf16 else dict(ZERO3)
    name = f"{kind}-bf16" if bf16 else kind
    if offload:
        config["zero_optimization"] = {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": False},
                                       "offload_optimizer": {"device": "cpu", "pin_memory": False}}
        name += "-offload"
    t0 = time.perf_counter()
    with low_memory_loading():
        model = load(path, **kw)
    TIMINGS[f"{name}/load"] = time.perf_counter() - t0
    meta = has_meta_params(model)
    check(f"{name}/meta_on_rank1_only", meta == (rank != 0), f"rank {rank} meta={meta}")
    want_tied = kind == "qwen2_tied"
    check(f"{name}/tied_after_load", tied(model) == want_tied, f"tied={tied(model)}")
    ref = load(path, **kw)  # unsharded reference, normal load on every rank
    check(f"{name}/ref_not_meta", not has_meta_params(ref))
    ref_logits = logits_of(ref)
    ref_buffers = {n: b.clone() for n, b in ref.named_buffers()}

    t0 = time.perf_counter()
    with full_params_at_first_shard(model) as held:
        engine = hf_zero.initialize(model, config)
    TIMINGS[f"{name}/initialize"] = time.perf_counter() - t0
    # Review F8: rank 0 used to upcast its whole model to fp32 before sharding (280 GB of host
    # RAM for a 70B model); now every rank's parameters are meta by then and shards are cast as
    # they are filled.
    check(f"{name}/no_full_params_when_sharding", held and held[0] == 0,
          f"bytes of full (unsharded, allocated) parameters at the first fully_shard: {held}")
    check(f"{name}/no_meta_after_wrap", not has_meta_params(model) and not any(b.is_meta for b in model.buffers()))
    check(f"{name}/tied_after_wrap", tied(model) == want_tied, f"tied={tied(model)}")
    saved = load_file(os.path.join(path, "model.safetensors"))
    if bf16:  # what the fp32 master shards hold: the bf16 weights, widened
        saved = {k: v.to(torch.bfloat16).float() for k, v in saved.items()}
    gathered = full_state(model)
    if offload:  # the device copies are 16-bit shards (the fp32 masters live with the offloaded optimizer)
        saved = {k: v.to(gathered[k].dtype) for k, v in saved.items()}
    compare(name, gathered, saved)
    if want_tied:
        check(f"{name}/lm_head_is_embedding", torch.equal(gathered["lm_head.weight"], saved["model.embed_tokens.weight"]))
    compare(f"{name}/buffers", gathered, ref_buffers)
    logits = logits_of(engine.module)
    check(f"{name}/logits_equal", torch.equal(logits, ref_logits), f"max diff {float((logits - ref_logits).abs().max()):.3g}")
    # One training step runs (FSDP lazy init after to_empty, gradients, optimizer state).
    ids = input_ids()
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    after = full_state(model)
    moved = sum(not torch.equal(after[k], saved[k]) for k in saved)
    # In bf16, a 1e-3 step does not move every value (norm weights of 1.0 stay 1.0).
    enough = moved > len(saved) // 2 if offload else moved == len(saved)
    check(f"{name}/train_step", torch.isfinite(loss).item() and enough, f"loss={float(loss):.4f} moved={moved}/{len(saved)}")


def run_fp32_opt_offload(workdir: str) -> None:
    """fp32 weights, bf16 training, only the optimizer offloaded: the shards reach fully_shard and
    the fill in bf16, and each rank's fp32 masters are its shard of the saved fp32 weights, exact
    (they travel in fp32 through the scatter; taken from the bf16 shard they would be rounded)."""
    import torch.distributed.fsdp as fsdp
    from safetensors.torch import load_file

    import hf_zero
    from hf_zero.engine.materialize import low_memory_loading

    name = "fp32-weights-opt-offload"
    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.join(workdir, "qwen2_tied")
    with low_memory_loading():
        model = load(path)
    seen: list[torch.dtype] = []
    original = fsdp.fully_shard

    def spy(module, *args, **kwargs):
        seen.extend(p.dtype for p in module.parameters() if p.requires_grad and not hasattr(p, "placements"))
        return original(module, *args, **kwargs)

    config = {**ZERO3, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False}}}
    fsdp.fully_shard = spy
    try:
        engine = hf_zero.initialize(model, config)
    finally:
        fsdp.fully_shard = original
    check(f"{name}/sharded_in_bf16", seen and all(d == torch.bfloat16 for d in seen),
          f"dtypes fully_shard received: {sorted({str(d) for d in seen})}")
    saved = load_file(os.path.join(path, "model.safetensors"))
    names = {p: n for n, p in model.named_parameters()}
    bad = []
    for slot in engine.offload.optimizer.slots:
        n = names[slot.param]
        local = slot.param.to_local()
        want = torch.chunk(saved[n].float(), world, dim=0)[rank] if local.numel() else saved[n].float()[:0]
        if local.dtype != torch.bfloat16 or slot.master.dtype != torch.float32 or \
                not torch.equal(slot.master.view(local.shape), want.reshape(local.shape)):
            bad.append(n)
    rounded = sum(not torch.equal(v.float(), v.to(torch.bfloat16).float()) for v in saved.values())
    check(f"{name}/masters_exact", not bad and len(engine.offload.optimizer.slots) > 0 and rounded > 0,
          f"differ={bad[:4]}; saved tensors bf16 cannot hold: {rounded}")
    ids = input_ids()
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    check(f"{name}/train_step", bool(torch.isfinite(loss).item()), f"loss={float(loss):.4f}")


def run_broadcast_and_noop(workdir: str) -> None:
    """The broadcast fill method, and the no-op when no rank has meta tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_zero.engine.materialize import capture_full_state, has_meta_params, low_memory_loading, sharded_from_rank0

    path = os.path.join(workdir, "llama")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with low_memory_loading():
        model = load(path)
    with sharded_from_rank0(model, mesh, method="broadcast"):
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    from safetensors.torch import load_file

    check("broadcast/no_meta", not has_meta_params(model))
    compare("broadcast", full_state(model), load_file(os.path.join(path, "model.safetensors")))

    plain = load(path)  # outside low_memory_loading: real on every rank
    check("noop/capture_is_none", capture_full_state(plain, mesh, sync_all=False) is None)

    # A block that fails after the parameters were released (an offload setup error, say) gives
    # rank 0 its model back, weights intact; the other ranks' would have been replaced anyway.
    before = {n: p.detach().clone() for n, p in plain.named_parameters()}
    try:
        with sharded_from_rank0(plain, mesh, release_parameters=True):
            inside_meta = has_meta_params(plain)
            raise RuntimeError("setup failed inside the block")
    except RuntimeError as exc:
        raised = "setup failed" in str(exc)
    check("release/meta_inside_block", inside_meta)
    check("release/error_propagates", raised)
    after = dict(plain.named_parameters())
    if dist.get_rank() == 0:
        check("release/rank0_restored_on_error", after.keys() == before.keys() and all(
            not after[n].is_meta and torch.equal(after[n], v) for n, v in before.items()))
    else:
        check("release/rank0_restored_on_error", has_meta_params(plain))  # documented: not restored here


def run_peft(workdir: str) -> None:
    """LoRA on a meta base model: get_peft_model works; rank 0's random LoRA weights reach every rank."""
    import hf_zero
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    from hf_zero.engine.materialize import has_meta_params, low_memory_loading

    rank = dist.get_rank()
    path = os.path.join(workdir, "qwen2_tied")
    with low_memory_loading():
        base = load(path)
    torch.manual_seed(100 + rank)  # different LoRA init per rank: rank 0's must win
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    lora_meta = any(p.is_meta for n, p in model.named_parameters() if "lora_" in n)
    check("peft/lora_meta_on_rank1_only", lora_meta == (rank != 0), f"lora meta={lora_meta}")
    # Rank 0's pre-shard weights and logits are the reference; every rank receives them.
    ref = [None, None]
    if rank == 0:
        ref = [{n: p.detach().clone() for n, p in model.named_parameters()}, logits_of(model)]
    dist.broadcast_object_list(ref, src=0)
    ref_params, ref_logits = ref
    engine = hf_zero.initialize(model, ZERO3)
    check("peft/no_meta_after_wrap", not has_meta_params(model))
    gathered = full_state(model)
    compare("peft", gathered, ref_params)
    saved = load_file(os.path.join(path, "model.safetensors"))
    base_got = {k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in gathered.items()}
    compare("peft/base", base_got, saved)
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    check("peft/only_lora_trainable", trainable and all("lora_" in n for n in trainable), f"{len(trainable)} trainable")
    logits = logits_of(engine.module)
    check("peft/logits_equal", torch.equal(logits, ref_logits), f"max diff {float((logits - ref_logits).abs().max()):.3g}")


def run_resize(workdir: str, kind: str) -> None:
    """resize_token_embeddings (mean-initialised new rows, as Alpaca-style scripts do) on a meta
    model: rank 0's resized weights reach every rank, tying kept."""
    import hf_zero

    from hf_zero.engine.materialize import has_meta_params, low_memory_loading

    rank = dist.get_rank()
    with low_memory_loading():
        model = load(os.path.join(workdir, kind))
    model.resize_token_embeddings(VOCAB + 8)  # mean_resizing: reads values on rank 0, skipped on meta
    emb = model.get_input_embeddings().weight.data
    emb[-8:] = emb[:-8].mean(dim=0, keepdim=True)  # smart_tokenizer_and_embedding_resize
    check(f"resize-{kind}/meta_on_rank1_only", has_meta_params(model) == (rank != 0))
    ref = [None, None]
    if rank == 0:
        ref = [full_state(model), logits_of(model)]
    dist.broadcast_object_list(ref, src=0)
    engine = hf_zero.initialize(model, ZERO3)
    gathered = full_state(model)
    compare(f"resize-{kind}", gathered, ref[0])
    check(f"resize-{kind}/shape", gathered["model.embed_tokens.weight"].shape[0] == VOCAB + 8)
    check(f"resize-{kind}/tied_after_wrap", tied(model) == (kind == "qwen2_tied"))
    logits = logits_of(engine.module)
    check(f"resize-{kind}/logits_equal", torch.equal(logits, ref[1]), f"max diff {float((logits - ref[1]).abs().max()):.3g}")


def run_trainer(workdir: str) -> None:
    """The launcher's way: install_low_memory_loading(), an unmodified Trainer script (ZeroTrainer,
    stage 3) trains 3 steps and saves; losses and the saved weights equal a normally loaded run."""
    from datasets import Dataset
    from safetensors.torch import load_file

    from hf_zero import ZeroTrainer, ZeroTrainingArguments
    from hf_zero.engine.materialize import has_meta_params, install_low_memory_loading, uninstall_low_memory_loading

    ids = torch.randint(0, VOCAB, (12, 16), generator=torch.Generator().manual_seed(5))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    cfg = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto",
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}}
    runs = {}
    for mode in ("normal", "low_memory"):
        if mode == "low_memory":
            install_low_memory_loading()
        try:
            model = load(os.path.join(workdir, "qwen2_tied"))
            meta = has_meta_params(model)
            args = ZeroTrainingArguments(
                output_dir=os.path.join(workdir, f"trainer-{mode}"), zero_config=cfg, per_device_train_batch_size=2,
                max_steps=3, logging_steps=1, report_to="none", save_strategy="no", learning_rate=5e-3, seed=3,
            )
            trainer = ZeroTrainer(model=model, args=args, train_dataset=data)
            trainer.train()
            trainer.save_model()
        finally:
            uninstall_low_memory_loading()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        runs[mode] = (meta, losses)
    rank = dist.get_rank()
    check("trainer/meta_on_rank1_only", runs["low_memory"][0] == (rank != 0) and not runs["normal"][0])
    check("trainer/losses_equal", runs["low_memory"][1] == runs["normal"][1] and len(runs["normal"][1]) == 3,
          f"{runs['normal'][1]} vs {runs['low_memory'][1]}")
    dist.barrier()
    a = load_file(os.path.join(workdir, "trainer-normal", "model.safetensors"))
    b = load_file(os.path.join(workdir, "trainer-low_memory", "model.safetensors"))
    check("trainer/saved_equal", a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"{len(a)} tensors")


def main() -> None:
    workdir, out = sys.argv[1], sys.argv[2]
    from hf_zero.distributed.env import init_distributed
    from tests.strict_collectives import install_from_env

    install_from_env()  # HF_ZERO_STRICT_COLLECTIVES=1: test-only strict collectives, never by hf_zero
    init_distributed()
    rank = dist.get_rank()
    if rank == 0:
        for kind in ("qwen2_tied", "llama"):
            tiny_model(kind, seed=3).save_pretrained(os.path.join(workdir, kind))
    dist.barrier()
    _integrate_stage()
    for step in (lambda: run_plain(workdir, "qwen2_tied"), lambda: run_plain(workdir, "llama"),
                 lambda: run_plain(workdir, "llama", bf16=True),
                 lambda: run_plain(workdir, "qwen2_tied", bf16=True, offload=True),
                 lambda: run_fp32_opt_offload(workdir),
                 lambda: run_broadcast_and_noop(workdir), lambda: run_peft(workdir),
                 lambda: run_resize(workdir, "qwen2_tied"), lambda: run_resize(workdir, "llama"),
                 lambda: run_trainer(workdir)):
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - reported per rank, the test shows it
            import traceback

            check(f"exception/{len(RESULTS)}", False, "".join(traceback.format_exception(exc))[-3000:])
            raise
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"results": RESULTS, "timings": TIMINGS})
    if rank == 0:
        merged: dict = {"checks": {}, "timings": everyone[0]["timings"]}
        for r, res in enumerate(everyone):
            for name, value in res["results"].items():
                merged["checks"].setdefault(name, {})[str(r)] = value
        with open(out, "w") as f:
            json.dump(merged, f, indent=1)


if __name__ == "__main__":
    main()
