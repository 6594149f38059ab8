"""Run under a 2-node launch (2 x 2 gloo ranks): the parity cases with hierarchical sharding, and
the bytes every collective moves, per process group, counted where torch.distributed is called.

    hf-zero run --nnodes 2 --node_rank R --master_addr 127.0.0.1 --master_port P --nproc_per_node 2 \\
        tests/distributed/hier_worker.py CASES.json OUT.pt

Writes (rank 0) what parity_worker writes per case, plus ``"traffic"``: every rank's
``{"op|r0,r1,...": bytes}`` over the case's training steps (engine setup excluded).
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import threading

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from _cases import Case  # noqa: E402
import parity_worker  # noqa: E402
from _worker_io import save_results_and_exit  # noqa: E402

# The data-moving calls FSDP2 and hf_zero make (the *_single ones are torch >= 2.12's names; the
# deprecated ones may call them, so only the outermost call of a thread counts), and the
# functional collectives DTensor's full_tensor() makes (the gradient norm's reduction).
_OPS = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor", "all_reduce",
        "broadcast")
_FUNCOL_OPS = ("all_gather_single", "all_gather_tensor", "reduce_scatter_single", "reduce_scatter_tensor", "all_reduce")
_OWN = ("parity_worker.py", "hier_worker.py")
"""The test's own reductions (the mean loss it reports) are not the engine's traffic."""
_depth = threading.local()
traffic: dict[str, int] = {}
calls: dict[str, int] = {}
recording = {"on": False}


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def _funcol_ranks(group, tag: str = "") -> list[int]:
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _ranks(_resolve_process_group(funcol._resolve_group_name(group, tag)))


def _record(op: str, ranks: list[int], nbytes: int) -> None:
    key = f"{op}|{','.join(str(r) for r in sorted(ranks))}"
    traffic[key] = traffic.get(key, 0) + nbytes
    calls[key] = calls.get(key, 0) + 1


def _recorded(name, fn, functional: bool = False):
    params = list(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        outer = getattr(_depth, "n", 0) == 0
        _depth.n = getattr(_depth, "n", 0) + 1
        try:
            caller = os.path.basename(sys._getframe(1).f_code.co_filename)
            if outer and recording["on"] and caller not in _OWN:
                bound = dict(zip(params, args), **kwargs)
                first = bound[params[0]]
                if functional:  # (input, ..., group): an all-gather's output is the input times the group
                    ranks = _funcol_ranks(bound["group"], bound.get("tag", ""))
                    op = name.split("_single")[0].replace("_tensor", "")
                    scale = len(ranks) if op == "all_gather" else 1
                    _record(op, ranks, first.numel() * first.element_size() * scale)
                else:
                    ranks = _ranks(bound.get("group"))
                    if name in ("all_reduce", "broadcast"):
                        op, big = name, first
                    elif name.startswith("all_gather"):  # (output, input): the gathered output
                        op, big = "all_gather", first
                    else:  # (output, input): the input being reduced, the whole unit's gradients
                        op, big = "reduce_scatter", bound[params[1]]
                    _record(op, ranks, big.numel() * big.element_size())
            return fn(*args, **kwargs)
        finally:
            _depth.n -= 1

    return wrapper


def install() -> None:
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed import distributed_c10d

    for name in _OPS:
        fn = getattr(dist, name, None)
        if fn is not None:
            wrapped = _recorded(name, fn)
            setattr(dist, name, wrapped)
            if getattr(distributed_c10d, name, None) is fn:
                setattr(distributed_c10d, name, wrapped)
    for name in _FUNCOL_OPS:
        fn = getattr(funcol, name, None)
        if fn is not None:
            setattr(funcol, name, _recorded(name, fn, functional=True))


def count_ddp(engine) -> None:
    """Stages 0/1: DDP reduces its gradient buckets in C++; torch's own all-reduce comm hook (what
    DDP does, divide by the world and sum) sends them through ``dist.all_reduce``, where they count."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = getattr(engine.stage, "ddp", None)
    if ddp is not None:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)


def _train(engine, data, steps) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        loss = engine(input_ids=data[step, 0, rank], labels=data[step, 0, rank]).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().reshape(1)
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def _full_fp32(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.float().clone() for k, v in full.items()}


def checkpoints_across_layouts(workdir: str) -> dict:
    """Save on one layout, resume on the other (MiCS 2x2 <-> flat 4), export 16-bit weights from the
    2-D mesh, and consolidate its checkpoint: what a user moving between layouts does."""
    import hf_zero
    from hf_zero.checkpoint.consolidate import consolidate_checkpoint
    from hf_zero.checkpoint.export16 import save_16bit_model
    from hf_zero.checkpoint.sharded import load_checkpoint, save_checkpoint
    from _models import make_data, tiny_model

    data = make_data(4, 1, dist.get_world_size(), 2, 16)
    out: dict = {}
    for name, saver, loader in (("mics_to_flat", 2, -1), ("flat_to_mics", -1, 2)):
        ckpt = os.path.join(workdir, f"ckpt-{name}")
        first = hf_zero.initialize(tiny_model("llama"), Case(stage=3, dtype="fp32", gas=1, model="llama",
                                                              mics=saver, scheduler=False).zero_config())
        _train(first, data, range(2))
        save_checkpoint(first, ckpt)
        saved = _full_fp32(first.module)
        if name == "mics_to_flat":
            export = os.path.join(workdir, "export16")
            save_16bit_model(first, export, dtype="fp32")
            out["export"] = export
        cont = _train(first, data, range(2, 4))
        first.close() if hasattr(first, "close") else None
        second = hf_zero.initialize(tiny_model("llama", seed=7), Case(stage=3, dtype="fp32", gas=1, model="llama",
                                                                      mics=loader, scheduler=False).zero_config())
        load_checkpoint(second, ckpt)
        loaded = _full_fp32(second.module)
        resumed = _train(second, data, range(2, 4))
        out[name] = {"saved": saved, "loaded": loaded, "continued": cont, "resumed": resumed, "ckpt": ckpt}
    if dist.get_rank() == 0:
        consolidated = os.path.join(workdir, "consolidated")
        consolidate_checkpoint(out["mics_to_flat"]["ckpt"], consolidated, progress=False)
        out["consolidated"] = consolidated
    dist.barrier()
    return out


def gathered_parameters_on_the_2d_mesh() -> dict:
    """DeepSpeed's GatheredParameters on a MiCS 2 x 2 engine: every rank reads the whole weight
    inside the block, and rank 2's edit (another node's rank) is what every rank holds after it."""
    import hf_zero
    from hf_zero.deepspeed_api.zero import GatheredParameters
    from _models import tiny_model

    model = tiny_model("llama")
    want = model.lm_head.weight.detach().clone()
    engine = hf_zero.initialize(model, Case(stage=3, dtype="fp32", gas=1, model="llama", mics=2,
                                            scheduler=False).zero_config())
    rank = dist.get_rank()
    weight = engine.module.lm_head.weight
    with GatheredParameters(weight, modifier_rank=2):
        read = torch.equal(weight.detach().cpu(), want)
        if rank == 2:
            weight.data.mul_(2.0)
    after = engine.module.lm_head.weight.detach().full_tensor().cpu()
    return {"read_whole": read, "edited": torch.equal(after, want * 2.0)}


def boundary_outside_the_engine() -> dict:
    """MiCS defers the all-reduce across the replicas to the accumulation boundary, which the
    engine's forward tells FSDP2. A window whose last micro-step skipped the engine's forward
    (calling the sharded module itself) would leave the replicas apart: the step refuses it. The
    same window through the engine steps, and the replicas then hold equal weights."""
    import hf_zero
    from _models import make_data, tiny_model

    rank = dist.get_rank()
    data = make_data(1, 2, dist.get_world_size(), 2, 16)
    out = {}
    for how in ("module", "engine"):
        engine = hf_zero.initialize(tiny_model("llama"), Case(stage=3, dtype="fp32", gas=2, model="llama", mics=2,
                                                              scheduler=False).zero_config())
        first = data[0, 0, rank]
        engine.backward(engine(input_ids=first, labels=first).loss)
        engine.step()
        last = data[0, 1, rank]
        call = engine.module if how == "module" else engine
        engine.backward(call(input_ids=last, labels=last).loss)
        try:
            engine.step()
            out[how] = "stepped"
        except RuntimeError as exc:
            out[how] = str(exc)
        if how == "engine":
            weight = engine.module.model.layers[0].mlp.down_proj.weight.to_local().detach().clone()
            other = [None] * dist.get_world_size()
            dist.all_gather_object(other, weight)
            out["replicas_equal"] = torch.equal(other[rank], other[(rank + 2) % 4])
    return out


def load_elsewhere(ckpt: str, out_path: str) -> None:
    """On another world size (a flat mesh): load a checkpoint the 2 x 2 MiCS run saved."""
    import hf_zero
    from hf_zero.checkpoint.sharded import load_checkpoint
    from _models import tiny_model

    engine = hf_zero.initialize(tiny_model("llama", seed=11),
                                Case(stage=3, dtype="fp32", gas=1, model="llama", scheduler=False).zero_config())
    load_checkpoint(engine, ckpt)
    save_results_and_exit({"loaded": _full_fp32(engine.module), "world": dist.get_world_size()}, out_path)


def main() -> None:
    from tests.strict_collectives import install_from_env

    install_from_env()
    if sys.argv[1] == "--load":
        load_elsewhere(sys.argv[2], sys.argv[3])
        return
    install()
    cases_path, out_path = sys.argv[1], sys.argv[2]
    with open(cases_path) as f:
        cases = [Case(**c) for c in json.load(f)]
    import hf_zero

    current: dict = {}

    real_initialize = hf_zero.initialize

    def initialize(*args, **kwargs):  # count the training steps only: not the setup, not the final gather
        engine = real_initialize(*args, **kwargs)
        steps = current["case"].steps
        real_step = engine.step

        def step(*a, **k):
            out = real_step(*a, **k)
            if engine.global_steps >= steps:
                recording["on"] = False
            return out

        engine.step = step
        count_ddp(engine)
        traffic.clear()
        calls.clear()
        recording["on"] = True
        return engine

    hf_zero.initialize = initialize
    results = {}
    for case in cases:
        current["case"] = case
        results[case.name] = parity_worker.run_case(case)
        recording["on"] = False
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, dict(traffic))
        results[case.name]["traffic"] = everyone
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, dict(calls))
        results[case.name]["calls"] = everyone
    results["checkpoints"] = checkpoints_across_layouts(os.path.dirname(out_path))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, gathered_parameters_on_the_2d_mesh())
    results["gathered"] = everyone
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, boundary_outside_the_engine())
    results["boundary"] = everyone
    save_results_and_exit(results, out_path)


if __name__ == "__main__":
    main()
