"""Run under torchrun: train offloaded and non-offloaded engines and save what the tests compare.

    torchrun --standalone --nproc_per_node 2 tests/distributed/offload_worker.py MODE CASES.json OUT.pt NVME_DIR

MODE ``parity``: each case (an :class:`OffloadCase`) trains offloaded, and its non-offloaded
baseline (same stage/dtype/accumulation/model) trains once; rank 0 writes ``{name: {"losses",
"grad_norms", "final_state", "ranks": [per-rank memory report, swap files seen during the run,
swap folder after close]}}``.

MODE ``resume``: for each case, train 2 steps, save a sharded checkpoint, train 2 more; then resume
that checkpoint into the *other* kind of engine (offloaded <-> not) and train the same 2 steps.
Writes ``{name: {"uninterrupted": [...], "resumed": [...]}}`` for both directions.

MODE ``faults``: the fault scenarios of :data:`FAULTS`, one after the other in the same processes;
each injects a fault on one rank (or both) and records, per rank, the error the rank got. Writes
``{scenario: [per-rank {"error", "type", ...}]}``.

MODE ``strict`` (run with ``HF_ZERO_STRICT_COLLECTIVES=1``, tests/strict_collectives.py): each case
trains, exports its 16-bit weights and saves a sharded checkpoint; a strict-collective error in a
phase is recorded, not raised. ``HF_ZERO_STRICT_CONTROL=bypass`` replaces ``on_mesh_device`` by the
identity first. Writes ``{name: {"norms", "exported", "errors": {phase: message}, "stats"}}``.
"""

from __future__ import annotations

import glob
import json
import os
import sys
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from _cases import Case
from _models import make_data, tiny_model


PIN = False
"""pin_memory of every offload section (set under the fake accelerator)."""
FAKE = None

@dataclass(frozen=True)
class OffloadCase:
    stage: int
    dtype: str
    gas: int
    model: str
    optimizer: str = "cpu"  # none | cpu | nvme
    params: str = "none"  # none | cpu | nvme
    ratio: float = 1.0
    sub_group_size: int = 20_000
    buffer_count: int = 3
    max_in_cpu: int = 1_000_000_000
    steps: int = 4
    load_dtype: str = "fp32"  # the dtype the model is loaded in (bf16: a `dtype="auto"` bf16 checkpoint)
    optimizer_type: str = "AdamW"  # the config's optimizer.type (offloaded or not)
    extra: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def base(self) -> Case:
        return Case(stage=self.stage, dtype=self.dtype, gas=self.gas, model=self.model, steps=self.steps)

    @property
    def name(self) -> str:
        tail = f"-ratio{self.ratio}" if self.ratio < 1 else ""
        tail += f"-load_{self.load_dtype}" if self.load_dtype != "fp32" else ""
        tail += f"-{self.optimizer_type}" if self.optimizer_type != "AdamW" else ""
        return f"{self.base.name}-opt_{self.optimizer}-param_{self.params}{tail}"

    @property
    def full_name(self) -> str:
        tag = "-" + "-".join(f"{k}_{v}" for k, v in sorted(self.extra.items())) if self.extra else ""
        return self.name + tag

    def to_dict(self) -> dict:
        return asdict(self)

    def zero_config(self, nvme_dir: str, offload: bool = True) -> dict:
        cfg = self.base.zero_config()
        cfg["optimizer"]["type"] = self.optimizer_type
        if not offload:
            return cfg
        zero = cfg["zero_optimization"]
        zero["sub_group_size"] = self.sub_group_size
        if self.optimizer != "none":
            zero["offload_optimizer"] = {"device": self.optimizer, "nvme_path": nvme_dir,
                                         "buffer_count": self.buffer_count, "ratio": self.ratio, "pin_memory": PIN}
        if self.params != "none":
            zero["offload_param"] = {"device": self.params, "nvme_path": nvme_dir, "max_in_cpu": self.max_in_cpu,
                                     "pin_memory": PIN}
        cfg["aio"] = {"block_size": 8192, "queue_depth": 4, "thread_count": 2}
        for key, value in self.extra.items():
            cfg["aio"][key] = value
        return cfg


def train(engine, case: OffloadCase, start: int, stop: int, data: torch.Tensor, on_step=None) -> tuple[list, list]:
    rank, world = engine.env.rank, engine.env.world_size
    losses, norms = [], []
    for step in range(start, stop):
        total = torch.zeros(())
        for k in range(case.gas):
            ids = data[step, k, rank].to(engine.env.device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            total += loss.detach().float().cpu()
            if on_step is not None and k == case.gas - 1:
                on_step(step)
            engine.step()
        dist.all_reduce(total)
        losses.append(float(total) / (case.gas * world))
        norms.append(engine.get_global_grad_norm())
    return losses, norms


def full_state(engine) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    # With an offloaded optimizer the model holds 16-bit shards; the fp32 masters are in the
    # engine's state dict, which is what a checkpoint (and consolidation) saves.
    from hf_zero.distributed.collectives import on_mesh_device

    state = engine.state_dict()["module"]
    out = {}
    for key, value in state.items():
        # Offloaded masters are DTensors over host shards: gathered from the mesh's device, as a
        # GPU run must (strict collectives check it).
        out[key] = on_mesh_device(value).full_tensor() if hasattr(value, "full_tensor") else value
    del StateDictOptions, get_model_state_dict
    return {k: v.detach().float().cpu().clone() for k, v in out.items()}


def run_parity(case: OffloadCase, nvme_dir: str, offload: bool) -> dict:
    import hf_zero

    model = tiny_model(case.model)
    engine = hf_zero.initialize(model, case.zero_config(nvme_dir, offload))
    rank = engine.env.rank
    data = make_data(case.steps, case.gas, engine.env.world_size, case.base.micro, case.base.seq)
    seen: dict = {}

    def on_step(step: int) -> None:
        if step == case.steps - 1:
            seen["memory"] = engine.memory_report()
            seen["files"] = sorted(engine.offload.swap_files()) if engine.offload else []
            seen["files_exist"] = all(os.path.exists(f) for f in seen["files"])
            seen["dirs"] = engine.offload.swap_dirs() if engine.offload else []

    losses, norms = train(engine, case, 0, case.steps, data, on_step)
    final = full_state(engine)
    gathered = None
    if offload and case.params == "nvme":
        # A 16-bit export reads the parameters outside forward/backward: under params_resident().
        from hf_zero.checkpoint.export16 import gather_full_state_dict

        with engine.params_resident():
            # dtype=None: the stored 16-bit shards themselves (an fp32 export reads the optimizer's
            # masters instead: tests/distributed/test_offload_export.py).
            gathered = {k: v.float() for k, v in gather_full_state_dict(engine, dtype=None).items()}
    engine.close()
    dist.barrier()  # every rank has closed: its folder, and the run's, must be gone
    seen["dirs_after_close"] = [d for d in seen["dirs"] if os.path.exists(d)]
    seen["run_dirs_after_close"] = sorted(glob.glob(os.path.join(nvme_dir, "hf_zero-*")))
    per_rank = [None] * engine.env.world_size
    dist.all_gather_object(per_rank, seen)
    return {"losses": losses, "grad_norms": norms, "final_state": final if rank == 0 else None, "ranks": per_rank,
            "gathered": gathered if rank == 0 else None}


def loaded_model(case: OffloadCase, seed: int = 0):
    """The case's model as a user loads it: a bf16 checkpoint gives bf16 parameters."""
    return tiny_model(case.model, seed=seed).to({"fp32": torch.float32, "bf16": torch.bfloat16}[case.load_dtype])


def run_resume(case: OffloadCase, nvme_dir: str, ckpt_root: str, first_offloaded: bool,
               then_offloaded: bool | None = None) -> dict:
    """Uninterrupted ``steps`` (first kind) vs. ``steps - 2`` + checkpoint + 2 steps in the other
    kind (or in ``then_offloaded``'s)."""
    then_offloaded = (not first_offloaded) if then_offloaded is None else then_offloaded
    import hf_zero
    from hf_zero.checkpoint.sharded import load_checkpoint, save_checkpoint

    data = make_data(case.steps, case.gas, dist.get_world_size(), case.base.micro, case.base.seq)
    engine = hf_zero.initialize(loaded_model(case), case.zero_config(nvme_dir, first_offloaded))
    save_at = case.steps - 2  # the warm-up's first steps have lr 0: save after some real updates
    first, _ = train(engine, case, 0, save_at, data)
    ckpt = os.path.join(ckpt_root, f"{case.name}-{first_offloaded}-{then_offloaded}")
    save_checkpoint(engine, ckpt)
    saved_fp32 = None
    if case.load_dtype != "fp32" and dist.get_rank() == 0:
        # What the checkpoint holds, read by torch's own converter: fp32 masters keep bits a
        # 16-bit copy has lost.
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(ckpt, ckpt + ".pt")
        module = torch.load(ckpt + ".pt", weights_only=False)["module"]
        saved_fp32 = {k: (v.dtype == torch.float32 and not torch.equal(v, v.to(torch.bfloat16).float()))
                      for k, v in module.items() if k.endswith(".weight")}
    rest, _ = train(engine, case, save_at, case.steps, data)
    final = written_weights(engine) if case.load_dtype != "fp32" else None
    engine.close()
    other = hf_zero.initialize(loaded_model(case, seed=7), case.zero_config(nvme_dir, then_offloaded))
    load_checkpoint(other, ckpt)
    resumed, _ = train(other, case, save_at, case.steps, data)
    final_resumed = written_weights(other) if case.load_dtype != "fp32" else None
    other.close()
    return {"first": first, "uninterrupted": rest, "resumed": resumed, "saved_fp32": saved_fp32,
            "final": final, "final_resumed": final_resumed}


def written_weights(engine) -> dict:
    """The model entries a checkpoint of a stage 0/1 ``engine`` would write (each from the rank
    holding it: the fp32 masters with an offloaded optimizer), merged over the ranks."""
    mine = {k: v.detach().float().cpu().clone() for k, v in engine.state_dict(saving=True)["module"].items()}
    merged: list = [None] * dist.get_world_size()
    dist.all_gather_object(merged, mine)
    return {k: v for part in merged for k, v in part.items()}


# ---------------------------------------------------------------------------------------------- faults
FAULTS = ("missing_path", "unwritable_rank1", "pin_rank1", "enospc_rank1", "truncate_rank0", "delete_param_rank1")


def _fault_case(scenario: str) -> OffloadCase:
    if scenario == "delete_param_rank1":
        return OffloadCase(stage=3, dtype="fp32", gas=1, model="llama", optimizer="nvme", params="nvme",
                           max_in_cpu=20_000, steps=3)
    if scenario == "truncate_rank0":
        return OffloadCase(stage=3, dtype="bf16", gas=1, model="llama", optimizer="nvme", steps=3)
    return OffloadCase(stage=2, dtype="fp32", gas=1, model="llama", optimizer="nvme", steps=3)


def run_fault(scenario: str, nvme_dir: str, work: str) -> dict:
    import errno

    import hf_zero
    from hf_zero.checkpoint.sharded import load_checkpoint, read_marker, save_checkpoint
    from hf_zero.offload import base, nvme

    rank = dist.get_rank()
    case = _fault_case(scenario)
    cfg = case.zero_config(nvme_dir)
    out: dict = {"error": None, "type": None}
    saved = {}
    patches = []

    def patch(obj, name, value):
        patches.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    if scenario == "missing_path":
        cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = os.path.join(nvme_dir, "does-not-exist")
    elif scenario == "unwritable_rank1" and rank == 1:
        real_makedirs = os.makedirs

        def makedirs(path, *args, **kwargs):
            if str(path).startswith(nvme_dir):
                raise PermissionError(errno.EACCES, "Permission denied", path)
            return real_makedirs(path, *args, **kwargs)

        patch(nvme.os, "makedirs", makedirs)
    elif scenario == "pin_rank1":
        cfg["zero_optimization"]["offload_optimizer"]["pin_memory"] = True
        if rank == 1:
            real_allocate = base._allocate

            def allocate(nbytes, pin):
                if pin:
                    raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
                return real_allocate(nbytes, pin)

            patch(base, "_pin_available", lambda: True)
            patch(base, "_allocate", allocate)
    engine = None
    try:
        engine = hf_zero.initialize(tiny_model(case.model), cfg)
        data = make_data(case.steps, case.gas, dist.get_world_size(), case.base.micro, case.base.seq)
        train(engine, case, 0, 1, data)
        ckpt = os.path.join(work, f"fault-{scenario}")
        save_checkpoint(engine, ckpt)
        saved = {k: v.clone() for k, v in full_state(engine).items()}
        files = engine.offload.swap_files()
        if scenario == "enospc_rank1" and rank == 1:
            def pwritev(fd, buffers, offset):
                raise OSError(errno.ENOSPC, "No space left on device")

            patch(nvme, "_pwritev", pwritev)
        elif scenario == "truncate_rank0" and rank == 0:
            victim = next(f for f in files if "optimizer_chunk" in f)
            os.truncate(victim, 100)
            out["victim"] = victim
        elif scenario == "delete_param_rank1" and rank == 1:
            resident = {u.record for u in engine.offload.params.units if u.resident}
            victim = next(f for f in files if "param_unit" in f and os.path.basename(f) not in resident)
            os.remove(victim)
            out["victim"] = victim
        train(engine, case, 1, case.steps, data)
    except Exception as exc:  # noqa: BLE001 -- recorded for the test
        out["error"] = str(exc)
        out["type"] = type(exc).__name__
    finally:
        for obj, name, value in reversed(patches):
            setattr(obj, name, value)
        if engine is not None:
            engine.close()
    dist.barrier()
    out["leftover"] = sorted(glob.glob(os.path.join(nvme_dir, "hf_zero-*")))
    if saved:
        # The checkpoint saved before the fault still loads, and holds the weights it was saved with.
        ckpt = os.path.join(work, f"fault-{scenario}")
        read_marker(ckpt)
        plain = hf_zero.initialize(tiny_model(case.model, seed=3), case.zero_config(nvme_dir, offload=False))
        load_checkpoint(plain, ckpt)
        reloaded = full_state(plain)
        out["checkpoint_intact"] = all(torch.equal(reloaded[k], saved[k]) for k in saved)
        plain.close()
    return out


def run_strict(case: OffloadCase, nvme_dir: str, work: str) -> dict:
    """Train, export 16-bit weights and save a checkpoint; strict-collective errors per phase."""
    import hf_zero
    from hf_zero.checkpoint.export16 import gather_full_state_dict
    from hf_zero.checkpoint.sharded import save_checkpoint
    from tests.strict_collectives import StrictCollectiveError, stats

    before = dict(stats)
    engine = hf_zero.initialize(tiny_model(case.model), case.zero_config(nvme_dir))
    data = make_data(case.steps, case.gas, dist.get_world_size(), case.base.micro, case.base.seq)
    out: dict = {"norms": None, "exported": None, "errors": {}}
    phases = {
        "grad_norm": lambda: out.__setitem__("norms", train(engine, case, 0, case.steps, data)[1]),
        "export16": lambda: out.__setitem__("exported", {
            k: v.float() for k, v in gather_full_state_dict(engine, dtype=torch.bfloat16).items()}),
        "checkpoint": lambda: save_checkpoint(engine, os.path.join(work, f"strict-{case.full_name}")),
    }
    for phase, run in phases.items():
        try:
            run()
        except Exception as exc:  # noqa: BLE001 -- a strict error, possibly re-raised as another
            cause = exc
            while cause is not None and not isinstance(cause, StrictCollectiveError):
                cause = cause.__cause__
            if cause is None:
                raise
            out["errors"][phase] = str(cause)
    engine.close()
    out["stats"] = {key: value - before[key] for key, value in stats.items()}  # this case's own
    return out


def main() -> None:
    from hf_zero.distributed.env import init_distributed

    mode, cases_path, out_path, nvme_dir = sys.argv[1:5]
    from tests.strict_collectives import install_from_env

    install_from_env()  # HF_ZERO_STRICT_COLLECTIVES=1: test-only strict collectives, never by hf_zero
    from tests.fake_accelerator import install_from_env as install_fake

    global PIN, FAKE
    FAKE = install_fake()  # HF_ZERO_FAKE_ACCELERATOR=1: the GPU's control flow (copies land late)
    PIN = FAKE is not None  # pinned buffers, so that the device<->host copies are asynchronous
    init_distributed()
    with open(cases_path) as f:
        cases = [OffloadCase(**c) for c in json.load(f)] if mode != "faults" else []
    results: dict = {}
    if mode == "parity":
        baselines: dict = {}
        for case in cases:
            key = case.base.name
            if key not in baselines:
                baselines[key] = run_parity(case, nvme_dir, offload=False)
            results[case.full_name] = run_parity(case, nvme_dir, offload=True)
        results["baselines"] = baselines
    elif mode == "resume":
        ckpt_root = os.path.join(os.path.dirname(out_path), "ckpt")
        for case in cases:
            results[case.full_name] = {
                "offloaded_to_plain": run_resume(case, nvme_dir, ckpt_root, first_offloaded=True),
                "plain_to_offloaded": run_resume(case, nvme_dir, ckpt_root, first_offloaded=False),
            }
            if case.load_dtype != "fp32":
                # 16-bit parameters compute differently from fp32 ones under autocast, so only a
                # resume into the same kind can be compared exactly.
                results[case.full_name]["offloaded_to_offloaded"] = run_resume(
                    case, nvme_dir, ckpt_root, first_offloaded=True, then_offloaded=True)
    elif mode == "strict":
        for case in cases:
            results[case.full_name] = run_strict(case, nvme_dir, os.path.dirname(out_path))
    elif mode == "faults":
        work = os.path.dirname(out_path)
        for scenario in FAULTS:
            per_rank = [None] * dist.get_world_size()
            dist.all_gather_object(per_rank, run_fault(scenario, nvme_dir, work))
            results[scenario] = per_rank
    else:
        raise SystemExit(f"unknown mode {mode}")
    if FAKE is not None:
        FAKE.flush()
        results["fake_async_copies"] = FAKE.async_copies
    if dist.get_rank() == 0:
        torch.save(results, out_path + ".tmp")
        os.replace(out_path + ".tmp", out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
