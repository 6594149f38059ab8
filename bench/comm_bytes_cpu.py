"""Measured bytes per process group (4 gloo ranks as 2 "nodes" x 2) next to ``hf-zero estimate --plan``'s.

Starts two ``hf-zero run --nnodes 2`` launches on localhost (ranks 0-1 node 0, 2-3 node 1) of
tests/distributed/hier_worker.py's counting hook, trains the tiny models of the tests for 4 steps
per case, and prints a markdown table: per case and process group of rank 0, the bytes every
collective moved over the 4 steps (counted where torch.distributed is called) and the plan's count
from the model's shapes (``hf_zero/estimator/comm_plan.py``), and what rank 0 sends inside and
across "nodes" by the plan's two-level model.

    python bench/comm_bytes_cpu.py [--out bench/results/comm-bytes-cpu-4rank.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "distributed"))

WORLD, PER_NODE, STEPS = 4, 2, 4

_WORKER = '''
import json, sys
sys.path.insert(0, {tests!r})
import hier_worker as hw
import parity_worker
import torch.distributed as dist
from _cases import Case

def main():
    hw.install()
    cases = [Case(**c) for c in json.load(open(sys.argv[1]))]
    import hf_zero
    real, current = hf_zero.initialize, {{}}
    def initialize(*a, **k):
        engine = real(*a, **k)
        real_step = engine.step
        def step(*x, **y):
            out = real_step(*x, **y)
            if engine.global_steps >= current["case"].steps:
                hw.recording["on"] = False
            return out
        engine.step = step
        hw.count_ddp(engine)
        hw.traffic.clear()
        hw.recording["on"] = True
        return engine
    hf_zero.initialize = initialize
    out = {{}}
    for case in cases:
        current["case"] = case
        parity_worker.run_case(case)
        hw.recording["on"] = False
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, dict(hw.traffic))
        out[case.name] = everyone
    if dist.get_rank() == 0:
        json.dump(out, open(sys.argv[2], "w"))

main()
'''


def _cases():
    from _cases import Case

    return [
        Case(stage=1, dtype="fp32", gas=2, model="llama"),
        Case(stage=2, dtype="fp32", gas=2, model="qwen2_tied", mics=2),
        Case(stage=3, dtype="bf16", gas=1, model="llama"),
        Case(stage=3, dtype="fp32", gas=1, model="llama", mics=2),
        Case(stage=3, dtype="bf16", gas=2, model="llama_odd", mics=2),
        Case(stage=3, dtype="fp32", gas=1, model="qwen2_tied", hpz=2),
    ]


def _measure(cases, workdir: Path) -> dict:
    (workdir / "cases.json").write_text(json.dumps([c.to_dict() for c in cases]))
    (workdir / "worker.py").write_text(_WORKER.format(tests=str(REPO / "tests" / "distributed")))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    nodes = [subprocess.Popen([sys.executable, "-m", "hf_zero.cli.main", "run", "--nnodes", "2", "--node_rank", str(n),
                               "--master_addr", "127.0.0.1", "--master_port", port, "--nproc_per_node", str(PER_NODE),
                               str(workdir / "worker.py"), str(workdir / "cases.json"), str(workdir / "out.json")],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in (0, 1)]
    for node in nodes:
        out, _ = node.communicate(timeout=900)
        if node.returncode:
            sys.exit(f"a node failed ({node.returncode}):\n{out[-4000:]}")
    return json.loads((workdir / "out.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="also write the measured and planned bytes as JSON here")
    args = parser.parse_args()

    from _models import tiny_model
    from hf_zero.estimator.comm_plan import bytes_sent, fsdp_units_of, group_ranks, group_shape, step_collectives

    cases = _cases()
    with tempfile.TemporaryDirectory() as tmp:
        measured = _measure(cases, Path(tmp))
    rows, record = [], {}
    for case in cases:
        shard = case.mics if case.mics > 0 else WORLD
        plan = step_collectives(fsdp_units_of(tiny_model(case.model)), stage=case.stage, world=WORLD, gas=case.gas,
                                param_bytes=2 if case.dtype in ("bf16", "fp16") else 4, shard=shard, hpz=case.hpz)
        def planned_for(rank: int) -> dict[str, int]:
            out: dict[str, int] = {}
            for c in plan:
                key = f"{c.op}|{','.join(map(str, group_ranks(c.group, rank, WORLD, shard, case.hpz)))}"
                out[key] = out.get(key, 0) + c.nbytes * case.steps
            return out

        intra = inter = 0
        for c in plan:
            sent = bytes_sent(c.op, c.nbytes * case.steps, group_shape(group_ranks(c.group, 0, WORLD, shard, case.hpz),
                                                                      PER_NODE))
            intra, inter = intra + sent.intra, inter + sent.inter
        planned, got = planned_for(0), measured[case.name][0]
        record[case.name] = {"measured": measured[case.name], "planned": [planned_for(r) for r in range(WORLD)],
                             "equal_on_every_rank": all(measured[case.name][r] == planned_for(r) for r in range(WORLD))}
        for key in sorted(set(got) | set(planned)):
            op, group = key.split("|")
            rows.append(f"| {case.name} | {op} | {group} | {got.get(key, 0):,} | {planned.get(key, 0):,} | "
                        f"{'yes' if got.get(key) == planned.get(key) else 'NO'} |")
        rows.append(f"| {case.name} | rank 0 sends (plan, two-level) | | | inside node {float(intra):,.0f}, "
                    f"across {float(inter):,.0f} | all 4 ranks: {'yes' if record[case.name]['equal_on_every_rank'] else 'NO'} |")
    print("| case (4 steps) | collective | group (ranks) | measured bytes | plan bytes | equal |")
    print("|---|---|---|---:|---:|---|")
    print("\n".join(rows))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
