"""Run under a 2-node launch (2 x 2 gloo ranks): offloaded optimizers and parameters on the
hierarchical layouts (MiCS's replicate x shard mesh, hpZ's reshard_after_forward=int), and frozen
reference models on them.

    hf-zero run --nnodes 2 --node_rank R --master_addr 127.0.0.1 --master_port P --nproc_per_node 2 \\
        tests/distributed/hier_offload_worker.py CASES.json OUT.pt NVME_DIR

Writes (rank 0) ``{case name: {"losses", "grad_norms", "final_state", "ranks": [per-rank facts]}}``
for each :class:`HierOffloadCase` (its ``baseline`` entry too when the case asks for one: the same
config without offload), and ``{"frozen-<name>": [per-rank results]}`` for each frozen case.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from _cases import Case  # noqa: E402
from _models import VOCAB, make_data, tiny_model  # noqa: E402
from _worker_io import save_results_and_exit  # noqa: E402
from frozen_worker import logits_then_a_policy_step  # noqa: E402
from offload_worker import OffloadCase, full_state, train  # noqa: E402

ALPHA = 0.25  # TR-DPO's sync weight in the frozen cases


@dataclass(frozen=True)
class HierOffloadCase:
    """An offload case (:class:`OffloadCase`, whose config it reuses) on a hierarchical layout."""

    stage: int
    dtype: str
    gas: int
    model: str
    optimizer: str = "cpu"  # offload_optimizer.device: none | cpu | nvme
    params: str = "none"  # offload_param.device: none | cpu | nvme
    mics: int = -1
    hpz: int = 1
    steps: int = 4
    max_in_cpu: int = 1_000_000_000
    vocab: int = VOCAB
    """A vocabulary that is not a multiple of the world size (e.g. 130: 65 rows per rank of a shard
    group of 2, 33 padded ones of 4) makes FSDP2 pad by the shard group; no 1-process reference then
    (``_reference.py`` builds the standard tiny models): the case is compared with ``baseline``."""
    baseline: bool = False
    """Also train the same config without offload (the exact comparison)."""

    @property
    def base(self) -> Case:
        return Case(stage=self.stage, dtype=self.dtype, gas=self.gas, model=self.model, steps=self.steps,
                    mics=self.mics, hpz=self.hpz)

    @property
    def offload(self) -> OffloadCase:
        return OffloadCase(stage=self.stage, dtype=self.dtype, gas=self.gas, model=self.model,
                           optimizer=self.optimizer, params=self.params, steps=self.steps, max_in_cpu=self.max_in_cpu)

    @property
    def name(self) -> str:
        vocab = f"-vocab{self.vocab}" if self.vocab != VOCAB else ""
        return f"{self.base.name}-opt_{self.optimizer}-param_{self.params}{vocab}"

    def to_dict(self) -> dict:
        return asdict(self)

    def zero_config(self, nvme_dir: str, offload: bool = True) -> dict:
        cfg = self.offload.zero_config(nvme_dir, offload)
        zero = cfg["zero_optimization"]
        if self.mics > 0:
            zero["mics_shard_size"] = self.mics
        if self.hpz > 1:
            zero["zero_hpz_partition_size"] = self.hpz
        return cfg

    def make_model(self, seed: int = 0):
        model = tiny_model(self.model, seed=seed)
        if self.vocab != VOCAB:
            torch.manual_seed(seed + 100)
            model.resize_token_embeddings(self.vocab, mean_resizing=False)
        return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def run_case(case: HierOffloadCase, nvme_dir: str, offload: bool = True) -> dict:
    import hf_zero

    model = case.make_model()
    engine = hf_zero.initialize(model, case.zero_config(nvme_dir, offload))
    world = engine.env.world_size
    data = make_data(case.steps, case.gas, world, case.base.micro, case.base.seq)
    seen: dict = {}

    def on_step(step: int) -> None:
        if step == case.steps - 1:  # gradients on the host, before the last step
            seen["memory"] = engine.memory_report()
            seen["files"] = sorted(engine.offload.swap_files()) if engine.offload else []
            seen["files_exist"] = all(os.path.exists(f) for f in seen["files"])

    if case.params == "nvme":
        # NVMe reads of parameter units during backward: with hpZ the backward gathers from the
        # copies the forward left on the device, so none is needed.
        seen["backward_reads"] = 0
        space, real_read, real_backward = engine.offload.params.space, engine.offload.params.space.read, engine.backward
        in_backward = {"on": False}

        def read(*args, **kwargs):
            seen["backward_reads"] += in_backward["on"]
            return real_read(*args, **kwargs)

        def backward(*args, **kwargs):
            in_backward["on"] = True
            try:
                return real_backward(*args, **kwargs)
            finally:
                in_backward["on"] = False

        space.read, engine.backward = read, backward
        seen["units"] = len(engine.offload.params.units)
    losses, norms = train(engine, case.offload, 0, case.steps, data, on_step)
    params = list(engine.module.parameters())
    seen["local_param_numel"] = sum(_local(p).numel() for p in params)
    seen["full_param_numel"] = sum(p.numel() for p in params)
    seen["param_devices"] = sorted({str(_local(p).device) for p in params})
    opt = engine.offload.optimizer if engine.offload is not None else None
    # The fp32 masters this rank steps: its shard of every trainable parameter, nothing more.
    seen["master_numel"] = sum(s.numel for s in opt.slots) if opt is not None else None
    seen["global_steps"] = engine.global_steps
    final = full_state(engine)
    dirs = engine.offload.swap_dirs() if engine.offload else []
    engine.close()
    dist.barrier()
    seen["dirs_after_close"] = [d for d in dirs if os.path.exists(d)]
    seen["run_dirs_after_close"] = sorted(glob.glob(os.path.join(nvme_dir, "hf_zero-*")))
    per_rank = [None] * world
    dist.all_gather_object(per_rank, seen)
    return {"losses": losses, "grad_norms": norms, "final_state": final if dist.get_rank() == 0 else None,
            "ranks": per_rank}


def _full(t: torch.Tensor) -> torch.Tensor:
    from hf_zero.distributed.collectives import on_mesh_device

    # Host shards (offload_param) are gathered from the mesh's device, as a GPU run must.
    return (on_mesh_device(t).full_tensor() if hasattr(t, "full_tensor") else t).detach().float().cpu().clone()


def run_frozen(case: HierOffloadCase, nvme_dir: str) -> dict:
    """A policy engine of ``case``'s config and a frozen reference model prepared with it
    (``hf_zero.prepare_frozen_model``, as TRL's DPO does through the Trainer): the reference's
    logits, the bytes each rank holds of it, and TRL's TR-DPO sync mixing the two models."""
    import hf_zero

    rank = dist.get_rank()
    cfg = case.zero_config(nvme_dir)
    engine = hf_zero.initialize(tiny_model(case.model, seed=1), cfg)
    if rank % 2:  # the second rank of each node builds on the meta device (low-memory loading)
        with torch.device("meta"):
            ref = tiny_model(case.model, seed=2)
    else:
        ref = tiny_model(case.model, seed=2 if rank == 0 else 5)  # other weights than rank 0's
    ref = hf_zero.prepare_frozen_model(ref, cfg)
    ids, logits = logits_then_a_policy_step(engine, ref, rank)
    with torch.no_grad():
        ref(input_ids=ids)  # a second forward: the parameters must be the shards again after it
    policy = engine.module
    placements = sorted({(str(p.device_mesh.mesh.tolist()), str(p.placements)) for p in ref.parameters()})
    with engine.params_resident():
        before = {"ref": [_full(p) for p in ref.parameters()], "policy": [_full(p) for p in policy.parameters()]}
        for target, source in zip(ref.parameters(), policy.parameters(), strict=True):  # TRL's sync, as written
            target.data.mul_(1.0 - ALPHA).add_(source.data, alpha=ALPHA)
    after = [_full(p) for p in ref.parameters()]
    with torch.no_grad():
        synced = ref(input_ids=ids).logits.float()
    engine.close()
    return {
        "ids": ids, "logits": logits, "synced_logits": synced, "before": before, "after": after,
        "bytes": sum(_local(p).untyped_storage().nbytes() for p in ref.parameters()),
        "devices": sorted({str(_local(p).device) for p in ref.parameters()}),
        "requires_grad": any(p.requires_grad for p in ref.parameters()), "training": ref.training,
        "placements": placements,
    }


def main() -> None:
    from tests.strict_collectives import install_from_env

    install_from_env()
    cases_path, out_path, nvme_dir = sys.argv[1:4]
    from hf_zero.distributed.env import init_distributed

    init_distributed()
    with open(cases_path) as f:
        spec = json.load(f)
    results: dict = {}
    for c in spec["cases"]:
        case = HierOffloadCase(**c)
        results[case.name] = run_case(case, nvme_dir)
        if case.baseline:
            results[case.name]["baseline"] = run_case(case, nvme_dir, offload=False)
    for c in spec["frozen"]:
        case = HierOffloadCase(**c)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, run_frozen(case, nvme_dir))
        results[f"frozen-{case.name}"] = everyone
    save_results_and_exit(results, out_path)


if __name__ == "__main__":
    main()
