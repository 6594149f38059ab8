"""The communication plan (``hf-zero estimate --plan``): collective sizes, what a GPU sends inside and
across nodes, the step-time model and the recommendation. The byte counts themselves are checked
against what 4 gloo ranks measure in tests/distributed/test_hierarchical.py; here the formulas."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from hf_zero.cli.estimate_cmd import EXIT_BAD_INPUT, build_parser, run
from hf_zero.estimator.comm_plan import (
    GroupShape,
    UnitShapes,
    bytes_sent,
    group_ranks,
    group_shape,
    step_collectives,
)
from hf_zero.estimator.comm_report import Layout, Links, plan_row, plan_units, recommend, workload
from hf_zero.estimator.model_spec import load_model_spec

PSI = 7 * 2**30  # divisible by every group size used below: no padding


def _sent_per_gpu(stage: int, world: int, reduce_bytes: int) -> Fraction:
    cols = step_collectives([UnitShapes("", ((PSI,),))], stage=stage, world=world, gas=1, param_bytes=2,
                            reduce_bytes=reduce_bytes)
    total = Fraction(0)
    for c in cols:
        if "norm" not in c.what:
            s = bytes_sent(c.op, c.nbytes, GroupShape(nodes=1, per_node=world))
            total += s.intra + s.inter
    return total


def test_zero_paper_volumes_16bit():
    """The ZeRO paper (section 7): stage 2 moves what data parallelism's all-reduce moves, stage 3
    1.5 times that, with every collective in 16 bit."""
    dp = _sent_per_gpu(0, 8, reduce_bytes=2)
    assert dp == Fraction(2 * 7, 8) * 2 * PSI  # a ring all-reduce: 2 (n-1)/n of the 2-byte gradients
    assert _sent_per_gpu(2, 8, reduce_bytes=2) == dp
    assert _sent_per_gpu(3, 8, reduce_bytes=2) == Fraction(3, 2) * dp


def test_stage3_collectives_and_their_groups():
    unit = [UnitShapes("", ((PSI,),))]
    flat = {(c.op, c.group, c.what.split(",")[0].split(":")[0]): c.nbytes for c in
            step_collectives(unit, stage=3, world=16, gas=2, param_bytes=2)}
    assert flat[("all_gather", "shard", "parameters for the forward")] == 2 * 2 * PSI
    assert flat[("all_gather", "shard", "parameters again for the backward")] == 2 * 2 * PSI
    assert flat[("reduce_scatter", "shard", "gradients")] == 2 * 4 * PSI  # fp32 reduction, every micro-step
    assert flat[("all_reduce", "shard", "the gradient norm")] == 4
    mics = {(c.op, c.group) for c in step_collectives(unit, stage=3, world=16, gas=1, param_bytes=2, shard=8)}
    assert ("all_reduce", "replicate") in mics
    hpz = [c for c in step_collectives(unit, stage=3, world=16, gas=1, param_bytes=2, hpz=8) if c.op == "all_gather"]
    assert [c.group for c in hpz] == ["shard", "hpz"]


def test_padding_follows_fsdp2():
    """Dim 0 rounds up to a multiple of the shard group (torch's _get_dim0_padded_size); a 0-dim
    parameter is one element."""
    unit = [UnitShapes("", ((131, 64), ()))]
    gathered = step_collectives(unit, stage=2, world=4, gas=1, param_bytes=4)[0]
    assert gathered.nbytes == (132 * 64 + 4) * 4


def test_persistent_units_are_gathered_once_and_frozen_ones_not_reduced():
    units = [UnitShapes("small", ((8,), (8,))), UnitShapes("big", ((64, 64),), (False,)), UnitShapes("", ((32,),))]
    cols = step_collectives(units, stage=3, world=2, gas=1, param_bytes=2, persistence_threshold=100)
    again = next(c for c in cols if "backward" in c.what)
    assert again.nbytes == (64 * 64 + 32) * 2 and again.calls == 2  # "small" stays gathered; the root does not
    reduced = next(c for c in cols if c.op == "reduce_scatter")
    assert reduced.nbytes == (16 + 32) * 4 and reduced.calls == 2  # the frozen unit has no gradients


def test_groups_and_what_each_gpu_sends():
    assert group_ranks("shard", 9, 16, shard=8) == list(range(8, 16))
    assert group_ranks("replicate", 9, 16, shard=8) == [1, 9]
    assert group_ranks("hpz", 9, 16, hpz=4) == [8, 9, 10, 11]
    assert group_shape(range(16), 8) == GroupShape(nodes=2, per_node=8)
    assert group_shape([1, 9], 8) == GroupShape(nodes=2, per_node=1)
    s = bytes_sent("all_gather", 1600, GroupShape(nodes=2, per_node=8))
    assert (s.intra, s.inter) == (1400, 100)  # 7/8 of S inside the node, (m-1) S/n across
    r = bytes_sent("all_reduce", 1600, GroupShape(nodes=2, per_node=1))
    assert (r.intra, r.inter) == (0, 1600)
    assert bytes_sent("reduce_scatter", 1600, GroupShape(nodes=1, per_node=1)).inter == 0


def test_lora_units_reduce_only_the_adapters():
    spec = load_model_spec("7e9", hidden_size=4096, num_layers=2, vocab_size=32000, intermediate_size=11008,
                           num_kv_heads=32)
    units, _ = plan_units(spec, lora_rank=8)
    adapters = sum(a * b for u in units for i, (a, *rest) in enumerate(u.shapes) for b in rest if u.is_trainable(i))
    per_layer = 8 * (4 * (4096 + 4096) + 2 * (4096 + 11008) + (11008 + 4096))
    assert adapters == 2 * per_layer
    rs = next(c for c in step_collectives(units, stage=3, world=8, gas=1, param_bytes=2) if c.op == "reduce_scatter")
    assert rs.nbytes == 2 * per_layer * 4


def test_step_time_model_and_recommendation():
    spec = load_model_spec("8e9")
    work = workload(spec, dtype="bf16", tokens_per_gpu=4096, gas=1)
    assert work.flops_per_token == 6 * 8_000_000_000
    rows = [plan_row(work, lay, 4, 8, Links()) for lay in (Layout(3), Layout(3, hpz=8), Layout(3, shard=8))]
    flat, hpz = rows[0], rows[1]
    assert flat.compute_s == pytest.approx(6 * 8e9 * 4096 / 400e12)
    assert flat.comm_s == pytest.approx(flat.intra_bytes / 450e9 + flat.inter_bytes / 50e9)
    assert hpz.inter_bytes < flat.inter_bytes  # the backward's all-gather stays in the node
    # A compute rate between the two: only hpZ hides its communication, and is recommended.
    flops = work.flops_per_token * work.tokens_per_gpu / ((flat.comm_s + hpz.comm_s) / 2)
    links = Links(flops=flops)
    best, why = recommend([plan_row(work, lay, 4, 8, links) for lay in (Layout(3), Layout(3, hpz=8))])
    assert best.layout == Layout(3, hpz=8) and "compute-bound" in why
    slow = Links(inter=1e9)
    best, why = recommend([plan_row(work, lay, 4, 8, slow) for lay in (Layout(3), Layout(3, hpz=8))])
    assert "no stage-3 layout is compute-bound" in why and best.layout == Layout(3, hpz=8)


def test_cli_plan_json(capsys):
    code = run(build_parser().parse_args(["--model", "7e9", "--num_nodes", "4", "--gpus_per_node", "8", "--plan",
                                          "--json", "--no_activations"]))
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["communication"]
    assert {r["nodes"] for r in rows} == {1, 2, 4, 8, 16, 32, 64, 128}
    for k in (1, 4, 128):
        assert sum(r["recommended"] for r in rows if r["nodes"] == k) == 1
    one = [r for r in rows if r["nodes"] == 1]
    assert all(r["inter_node_bytes"] == 0 for r in one)
    assert out["memory"][0]["stage"] in (0, 1, 2, 3)


def test_cli_plan_text_and_bad_values(capsys, tmp_path):
    from transformers import Qwen2Config

    Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=131).save_pretrained(tmp_path)
    assert run(build_parser().parse_args(["--model", str(tmp_path), "--num_nodes", "2", "--gpus_per_node", "2"])) == 0
    text = capsys.readouterr().out
    assert "2 node(s) x 2 GPUs" in text and "recommended:" in text and "padding" not in text
    code = run(build_parser().parse_args(["--model", "7e9", "--num_nodes", "2", "--gradient_accumulation_steps", "0"]))
    assert code == EXIT_BAD_INPUT
    assert "--gradient_accumulation_steps must be at least 1, got 0" in capsys.readouterr().err
