"""An fp32 export of a run whose optimizer is offloaded writes the fp32 masters, not the 16-bit copies.

A bf16 checkpoint (a tiny Llama saved in bf16, loaded with ``dtype="auto"``) trains 3 bf16 steps on
2 gloo ranks at stages 1 and 3, with ``offload_optimizer: cpu`` and without. Compared: the
offloaded run's ``save_16bit_model(engine, dtype="fp32")`` files with the masters as the offloaded
optimizer stores them (and with the model's 16-bit copies, which are those masters rounded, and
which an export of the copies would have written); ``gather_full_state_dict`` with the files; and
at stage 3 with the run without offload, whose FSDP2 fp32 shards are the masters (the same
numerics; at stage 1 the two runs differ: without offload autocast computes over fp32 weights).

    torchrun --standalone --nproc_per_node 2 tests/distributed/test_offload_export.py BASE OUT   (the worker)
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

STEPS = 3
CASES = {f"s{stage}{'_offload' if offload else ''}": (stage, offload) for stage in (1, 3) for offload in (False, True)}


def _config(stage: int, offload: bool) -> dict:
    zero: dict = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        # lr 1e-3: updates far below bf16's resolution of the weights, so the masters drift off
        # the bf16 grid (exactly what a 16-bit copy cannot hold).
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
        "zero_optimization": zero,
    }


# ---------------------------------------------------------------------------------------- worker
def _worker(base: str, out: str) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    import hf_zero
    from _models import make_data
    from _worker_io import save_results_and_exit
    from hf_zero.checkpoint.export16 import gather_full_state_dict, save_16bit_model

    results = {}
    for name, (stage, offload) in CASES.items():
        model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
        assert next(model.parameters()).dtype == torch.bfloat16
        engine = hf_zero.initialize(model, _config(stage, offload))
        rank, world = engine.env.rank, engine.env.world_size
        data = make_data(STEPS, 1, world, 2, 16)
        for step in range(STEPS):
            ids = data[step, 0, rank]
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        save_16bit_model(engine, os.path.join(os.path.dirname(out), name), dtype="fp32")
        gathered = gather_full_state_dict(engine, dtype="fp32")
        results[name] = {"gathered": gathered if rank == 0 else None,
                         "masters": _optimizer_masters(engine) if offload else None,
                         "bf16": gather_full_state_dict(engine, dtype=None)}  # the model's own 16-bit copies
        dist.barrier()
    save_results_and_exit(results, out)


def _optimizer_masters(engine) -> dict[str, torch.Tensor]:
    """The fp32 masters as the offloaded optimizer stores them (its checkpoint view), whole: at
    stage 3 each rank's shards gathered, at stage 1 each owner's whole tensors collected."""
    import torch.distributed as dist

    from hf_zero.distributed.collectives import on_mesh_device

    _, masters = engine.offload.optimizer.checkpoint_state()
    if engine.stage.stage >= 2:  # host shards: gathered from the mesh's device, as a GPU run must
        return {n: on_mesh_device(m).full_tensor().detach().clone() for n, m in sorted(masters.items())}
    mine = {n: m.detach().clone() for n, m in masters.items()}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {n: t for part in everyone for n, t in part.items()}


# ---------------------------------------------------------------------------------------- tests
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from _launch import torchrun
    from _models import tiny_model

    tmp = tmp_path_factory.mktemp("offload_export")
    tiny_model("llama").to(torch.bfloat16).save_pretrained(tmp / "base")  # a bf16 checkpoint
    out = tmp / "out.pt"
    torchrun(__file__, str(tmp / "base"), str(out))
    return tmp, torch.load(out, weights_only=False)


def _exported(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    assert files, f"nothing exported in {folder}"
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("stage", [1, 3])
def test_fp32_export_holds_the_optimizers_masters_not_the_16bit_copies(results, stage):
    tmp, res = results
    got, case = _exported(tmp / f"s{stage}_offload"), res[f"s{stage}_offload"]
    masters, copies = case["masters"], case["bf16"]
    assert masters and set(masters) <= set(got)
    off_grid = total = 0
    for key, master in masters.items():
        assert got[key].dtype == torch.float32, key
        assert torch.equal(got[key], master), key
        # The model's 16-bit copy is the master rounded: what the export used to write.
        assert copies[key].dtype == torch.bfloat16 and torch.equal(copies[key], master.bfloat16()), key
        off_grid += int((master != master.bfloat16().float()).sum())
        total += master.numel()
    assert off_grid > 0.5 * total, f"only {off_grid} of {total} master values are off the bf16 grid"


def test_stage3_fp32_export_equals_the_run_without_offload(results):
    """Without offload FSDP2's fp32 shards are the masters: an independent reference (same numerics)."""
    tmp, _ = results
    reference, got = _exported(tmp / "s3"), _exported(tmp / "s3_offload")
    assert got.keys() == reference.keys()
    for key, ref in reference.items():
        torch.testing.assert_close(got[key], ref, rtol=1e-6, atol=1e-8, msg=key)


@pytest.mark.parametrize("stage", [1, 3])
def test_gathered_state_dict_equals_the_export(results, stage):
    tmp, res = results
    files = _exported(tmp / f"s{stage}_offload")
    gathered = res[f"s{stage}_offload"]["gathered"]
    for key, value in files.items():
        assert torch.equal(gathered[key], value), key


if __name__ == "__main__":
    from tests.strict_collectives import install_from_env

    install_from_env()  # HF_ZERO_STRICT_COLLECTIVES=1 (tests/distributed/_launch.py sets it by default)
    _worker(sys.argv[1], sys.argv[2])
