"""First contact on a GPU box: the Qwen example through stages 0-3 x offload variants, one GPU.

Runs ``examples/finetune_qwen/finetune.py`` unchanged through ``hf-zero run --nproc_per_node 1`` for
each config of a matrix (bf16, fp16 once), 4 steps with clipping and a checkpoint at step 2, then
prints one table: exit status, the logged losses and gradient norms, and how far they are from the
run without offload of the same stage. Logs of failed runs are kept under ``--out``.

    python scripts/gpu_smoke.py --out /tmp/smoke            # on the GPU machine
    python scripts/gpu_smoke.py --out /tmp/smoke --cpu      # same matrix on CPU (gloo)

This is a developer probe that needs no test framework; ``hf-zero doctor`` is the user-facing check.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout, hf_zero not installed


def _config(stage: int, *, opt: str | None = None, param: str | None = None, nvme: str = "", fp16=False) -> dict:
    zo: dict = {"stage": stage, "reduce_bucket_size": "auto"}
    if opt:
        zo["offload_optimizer"] = {"device": opt, "pin_memory": True, **({"nvme_path": nvme} if opt == "nvme" else {})}
    if param:
        zo["offload_param"] = {"device": param, "pin_memory": True, **({"nvme_path": nvme} if param == "nvme" else {})}
        if param == "nvme":
            zo["offload_param"]["max_in_cpu"] = 1e5
            zo["offload_param"]["buffer_size"] = 1e7
    if stage == 3:
        zo["stage3_gather_16bit_weights_on_model_save"] = True
    from hf_zero.config.auto import trainer_auto_config

    return trainer_auto_config(zo)


def _matrix(nvme: str) -> list[tuple[str, dict, bool]]:
    rows = []
    for s in range(4):
        rows.append((f"s{s}", _config(s), False))
    rows += [
        ("s1-opt", _config(1, opt="cpu"), False),
        ("s2-opt", _config(2, opt="cpu"), False),
        ("s3-opt", _config(3, opt="cpu"), False),
        ("s3-param", _config(3, param="cpu"), False),
        ("s3-opt-param", _config(3, opt="cpu", param="cpu"), False),
        ("s2-opt-nvme", _config(2, opt="nvme", nvme=nvme), False),
        ("s3-opt-param-nvme", _config(3, opt="nvme", param="nvme", nvme=nvme), False),
        ("s2-fp16", _config(2), True),
        ("s3-opt-param-fp16", _config(3, opt="cpu", param="cpu"), True),
    ]
    return rows


def _model(out: Path) -> Path:
    """A mid-size random Qwen2 (about 60 M parameters) next to the tiny tokenizer: big enough for async copies to matter."""
    import transformers

    dst = out / "mid-qwen2"
    if dst.exists():
        return dst
    cfg = transformers.AutoConfig.from_pretrained(REPO / "assets/tiny-qwen2")
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 1024, 2816, 4
    cfg.num_attention_heads, cfg.num_key_value_heads = 16, 4
    cfg.layer_types = ["full_attention"] * 4
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(dst)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(REPO / "assets/tiny-qwen2" / f, dst / f)
    return dst


def _losses(run_dir: Path) -> tuple[list[float], list[float]]:
    state = json.loads((run_dir / "trainer_state.json").read_text())
    hist = state["log_history"]
    return [h["loss"] for h in hist if "loss" in h], [h["grad_norm"] for h in hist if "grad_norm" in h]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cpu", action="store_true", help="run on CPU (no --bf16 flag, gloo)")
    ap.add_argument("--only", nargs="*", help="names of matrix rows to run")
    ap.add_argument("--timeout", type=float, default=150)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = _model(args.out)
    nvme = str(args.out / "nvme")
    Path(nvme).mkdir(exist_ok=True)
    results = {}
    for name, cfg, fp16 in _matrix(nvme):
        if args.only and name not in args.only:
            continue
        run_dir = args.out / name
        cfg_path = args.out / f"{name}.json"
        cfg_path.write_text(json.dumps(cfg, indent=1))
        prec = [] if args.cpu else (["--fp16", "True"] if fp16 else ["--bf16", "True"])
        cmd = [sys.executable, "-m", "hf_zero.cli.main", "run", "--nproc_per_node", "1",
               "examples/finetune_qwen/finetune.py", "--zero_config", str(cfg_path),
               "--model_name_or_path", str(model), "--output_dir", str(run_dir), "--max_steps", "4",
               "--save_steps", "2", "--per_device_train_batch_size", "4", "--learning_rate", "1e-4",
               "--max_grad_norm", "0.5", "--logging_steps", "1", "--report_to", "none", "--seed", "1", *prec]
        t0 = time.time()
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
            rc, log = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, log = "hang", f"{e.stdout or ''}{e.stderr or ''}"
            log = log if isinstance(log, str) else log.decode(errors="replace")
        (args.out / f"{name}.log").write_text(log)
        row = {"rc": rc, "s": round(time.time() - t0, 1)}
        if rc == 0:
            try:
                row["loss"], row["gnorm"] = _losses(run_dir)
            except (OSError, KeyError, ValueError) as e:
                row["err"] = f"no trainer_state: {e}"
        else:
            tail = [ln for ln in log.splitlines() if "Error" in ln or "error" in ln]
            row["err"] = (tail[-1] if tail else log[-300:])[:300]
        results[name] = row
        print(name, json.dumps(row), flush=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    (args.out / "smoke.json").write_text(json.dumps(results, indent=1))
    print("\n| run | rc | s | losses | grad norms | max rel. loss diff vs no offload |")
    print("|---|---|---:|---|---|---:|")
    failed = 0
    for name, r in results.items():
        base = results.get(name.split("-")[0], {})
        diff = ""
        if "loss" in r and "loss" in base and base is not r:
            diff = f"{max(abs(a - b) / max(abs(b), 1e-9) for a, b in zip(r['loss'], base['loss'])):.2e}"
        fmt = lambda xs: " ".join(f"{x:.4f}" for x in xs)  # noqa: E731
        print(f"| {name} | {r['rc']} | {r['s']} | {fmt(r.get('loss', []))} | {fmt(r.get('gnorm', []))} | {diff or r.get('err', '')} |")
        failed += r["rc"] != 0
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
