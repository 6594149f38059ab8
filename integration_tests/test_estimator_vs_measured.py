"""The memory estimator against the measured peak memory of real hf_zero training runs (CPU).

Each case trains a 42M-parameter Qwen2-shaped model (hidden 512, 8 layers, vocabulary 32000,
tied head; micro batch 1, sequence 32, bf16, AdamW) for 3 steps with ``hf_zero.initialize`` in a
fresh process (1 process, or 2 gloo ranks under torchrun), and compares what the process(es) held
at their peak with ``hf_zero.estimator.estimate(...)`` for the same configuration.

What is measured, per rank: ``VmHWM`` (peak RSS) minus the RSS just before the model is built, after
importing torch/transformers/hf_zero, creating the process group and training two steps of the
same configuration on a 0.1M-parameter model (so that kernel libraries, thread pools and the
lazily built state of gloo, FSDP2, autocast and oneDNN are in the baseline). The node's figure is
the sum over its ranks. The processes run with ``MALLOC_MMAP_THRESHOLD_=65536``: glibc then serves
every tensor-sized block with ``mmap`` and returns it on free, so the peak RSS follows the peak of
live bytes (the CPU analogue of ``torch.cuda.max_memory_allocated``) instead of heap
fragmentation, which otherwise adds up to ~40% that varies from run to run.

What it is compared with: on a machine without a GPU the estimator's "GPU" is the host itself
(the engine computes on the CPU), so a rank's RSS holds its estimated GPU bytes *and* its share of
the host tier: expected node bytes = ``num_gpus x gpu_bytes + cpu_bytes`` of the row (model states,
activations, working buffers, offloaded state, NVMe host buffers). The NVMe tier is files, not RSS.

Result (docs/benchmarks.md has the table): the estimator's own default row (model states +
activations + working buffers + hf_zero's layout terms, see
``hf_zero.estimator.memory.implementation_terms``) is within TOLERANCE of every measurement, with
no correction on the test's side. A separate check asserts that the paper-only numbers
(``include_activations=False``) are exactly the ZeRO paper's formulas for the same model.

Runs in about 40 s on 2 CPUs (single-process cases two at a time, 2-rank cases alone).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MODEL = dict(
    model_type="qwen2",
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    intermediate_size=1408,
    vocab_size=32000,
    tie_word_embeddings=True,
    use_cache=False,
)
SEQ_LEN = 32
MICRO_BATCH = 1
STEPS = 3
SUB_GROUP_SIZE = 2_000_000
"""NVMe case: optimizer sub-groups of 2M elements (the default 1e9 makes the host buffer pool hold
whole shards)."""

TOLERANCE = 0.10
"""|estimate / measured - 1| allowed for the estimator's own default row (reached on the reference
machine: +0.6%..+7.8%, see docs/benchmarks.md)."""


@dataclass(frozen=True)
class Case:
    name: str
    nproc: int
    stage: int
    offload_optimizer: str = "none"
    offload_param: str = "none"

    @property
    def sub_group_size(self) -> int | None:
        return SUB_GROUP_SIZE if "nvme" in (self.offload_optimizer, self.offload_param) else None


CASES = [
    Case("s0", 1, 0),
    Case("s2_opt_cpu", 1, 2, "cpu"),
    Case("s3_opt_cpu_param_cpu", 1, 3, "cpu", "cpu"),
    Case("s3_opt_nvme", 1, 3, "nvme"),
    Case("s1_2rank", 2, 1),
    Case("s3_2rank", 2, 3),
]
BY_NAME = {c.name: c for c in CASES}
# ------------------------------------------------------------------------------------------ worker
def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _config(spec: dict) -> dict:
    zero: dict = {"stage": spec["stage"]}
    for key in ("offload_optimizer", "offload_param"):
        if spec[key] != "none":
            zero[key] = {"device": spec[key], "pin_memory": False}
            if spec[key] == "nvme":
                zero[key]["nvme_path"] = spec["nvme_path"]
    if spec["sub_group_size"]:
        zero["sub_group_size"] = spec["sub_group_size"]
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": zero,
    }


def _train(engine, vocab: int, steps: int, rank: int) -> float:
    import torch

    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (MICRO_BATCH, SEQ_LEN), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    return float(loss)


def worker(spec_path: str) -> None:
    """One rank of one case: warm up, take the baseline, build, train STEPS steps, write the peak."""
    import gc

    spec = json.loads(Path(spec_path).read_text())
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    import hf_zero
    from hf_zero.distributed.env import init_distributed

    env = init_distributed()
    config = _config(spec)
    shape = {k: v for k, v in MODEL.items() if k != "model_type"}
    # Warm-up: two steps of the same configuration on a 0.1M-parameter model load the kernels,
    # thread pools and lazily built state (gloo, FSDP2, autocast, oneDNN) into the baseline.
    torch.manual_seed(0)
    tiny = dict(shape, hidden_size=64, num_hidden_layers=2, intermediate_size=128, vocab_size=512)
    warm = hf_zero.initialize(AutoModelForCausalLM.from_config(Qwen2Config(**tiny), dtype=torch.float32), config)
    _train(warm, 512, 2, env.rank)
    warm.close()
    del warm
    gc.collect()
    baseline = _rss_kib("VmRSS") * 1024

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**shape), dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    engine = hf_zero.initialize(model, config)
    loss = _train(engine, MODEL["vocab_size"], STEPS, env.rank)
    record = {
        "rank": env.rank,
        "baseline_bytes": baseline,
        "peak_bytes": _rss_kib("VmHWM") * 1024,
        "end_bytes": _rss_kib("VmRSS") * 1024,
        "params": params,
        "loss": loss,
        "memory_report": engine.memory_report(),
    }
    Path(spec["out"], f"rank{env.rank}.json").write_text(json.dumps(record))
    engine.close()


if __name__ == "__main__":
    worker(sys.argv[1])
    sys.exit(0)


# ------------------------------------------------------------------------------------------ tests
import pytest  # noqa: E402

pytestmark = pytest.mark.slow


def _launch(case: Case, root: Path) -> tuple[subprocess.Popen, Path]:
    out = root / case.name
    out.mkdir()
    spec = {
        "stage": case.stage,
        "offload_optimizer": case.offload_optimizer,
        "offload_param": case.offload_param,
        "sub_group_size": case.sub_group_size,
        "nvme_path": str(root / "nvme"),
        "out": str(out),
    }
    (out / "spec.json").write_text(json.dumps(spec))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    script = str(Path(__file__).resolve())
    if case.nproc == 1:
        cmd = [sys.executable, script, str(out / "spec.json")]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(case.nproc), script, str(out / "spec.json")]
    log = open(out / "log.txt", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO), out


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Run every case (two single-process cases at a time, 2-rank cases alone); name -> records."""
    root = tmp_path_factory.mktemp("est_vs_measured")
    (root / "nvme").mkdir()
    singles = [c for c in CASES if c.nproc == 1]
    batches = [singles[i : i + 2] for i in range(0, len(singles), 2)] + [[c] for c in CASES if c.nproc > 1]
    results = {}
    for batch in batches:
        running = [(case, *_launch(case, root)) for case in batch]
        for case, proc, out in running:
            rc = proc.wait(timeout=300)
            if rc != 0:
                raise AssertionError(f"{case.name} exited {rc}:\n{(out / 'log.txt').read_text()[-4000:]}")
            results[case.name] = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
            assert len(results[case.name]) == case.nproc
    return results


def estimate_row(case: Case):
    from hf_zero.estimator import estimate

    est = estimate(
        dict(MODEL),
        num_gpus=case.nproc,
        dtype="bf16",
        micro_batch_size=MICRO_BATCH,
        seq_len=SEQ_LEN,
        **({"sub_group_size": case.sub_group_size} if case.sub_group_size else {}),
    )
    (row,) = [r for r in est.rows if (r.stage, r.offload_optimizer, r.offload_param) == (case.stage, case.offload_optimizer, case.offload_param)]
    return est, row


def compare(case: Case, records: list[dict]) -> dict:
    """Estimate (node: num_gpus x gpu_bytes + cpu_bytes) and measurement of one case."""
    est, row = estimate_row(case)
    measured = sum(r["peak_bytes"] - r["baseline_bytes"] for r in records)
    estimated = case.nproc * row.gpu_bytes + row.cpu_bytes
    return {
        "measured": measured,
        "estimated": estimated,
        "ratio": estimated / measured,
        "params": est.total_params,
        "layout": dict(row.layout_terms),
    }


def test_summary(measured):
    """The table docs/benchmarks.md quotes (pytest -s shows it); checks the model is the one meant."""
    lines = ["case | estimate MiB | measured MiB | estimate/measured | of which hf_zero layout terms MiB"]
    for case in CASES:
        c = compare(case, measured[case.name])
        assert c["params"] == measured[case.name][0]["params"]  # the estimator counts this model exactly
        lines.append(
            f"{case.name} | {c['estimated'] / 2**20:.0f} | {c['measured'] / 2**20:.0f} | {c['ratio']:.3f} | "
            f"{case.nproc * sum(c['layout'].values()) / 2**20:.0f}"
        )
    print("\n" + "\n".join(lines))


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_estimate_is_within_tolerance_of_measured(name, measured):
    """The estimator's own default row, nothing added, is within TOLERANCE of the measured peak."""
    c = compare(BY_NAME[name], measured[name])
    detail = ", ".join(f"{k}: {v / 2**20:.0f} MiB" for k, v in c["layout"].items()) or "none"
    assert abs(c["ratio"] - 1) <= TOLERANCE, (
        f"{name}: estimate {c['estimated'] / 2**20:.0f} MiB (hf_zero layout terms per rank: {detail}) vs measured "
        f"{c['measured'] / 2**20:.0f} MiB = {c['ratio']:.3f}, outside +-{TOLERANCE:.0%}"
    )


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_paper_only_numbers_are_the_papers(name):
    """With ``include_activations=False`` the GPU bytes are the ZeRO paper's model states for Ψ
    parameters on N ranks, K = 12: (2+2+K)Ψ, 2Ψ+2Ψ+KΨ/N, 2Ψ+(2+K)Ψ/N, (2+2+K)Ψ/N; offload moves
    the optimizer terms (and the fp32 gradient copy) to the host."""
    from hf_zero.estimator import estimate

    case = BY_NAME[name]
    est = estimate(dict(MODEL), num_gpus=case.nproc, dtype="bf16", include_activations=False,
                   **({"sub_group_size": case.sub_group_size} if case.sub_group_size else {}))
    rows = {(r.stage, r.offload_optimizer, r.offload_param): r for r in est.rows}
    psi, n = est.total_params, case.nproc
    sh = -(-psi // n)
    paper = {0: 16 * psi, 1: 4 * psi + 12 * sh, 2: 2 * psi + 14 * sh, 3: 16 * sh}
    assert rows[(case.stage, "none", "none")].gpu_bytes == paper[case.stage]
    row = rows[(case.stage, case.offload_optimizer, case.offload_param)]
    assert row.gpu.activations == row.gpu.buffers == row.gpu.layout == 0 and row.layout_terms == ()
    if case.offload_optimizer == "cpu":
        assert row.cpu.optimizer == n * 12 * sh and row.cpu.gradients == n * 4 * sh
