"""Every key of DeepSpeed's config schema has an answer in hf_zero: implemented, accepted with no
effect, or refused with the alternative.

The key list ``data/deepspeed_config_keys.json`` was made by ``scripts/deepspeed_config_keys.py``
from DeepSpeed 0.19.8 itself (its pydantic models and the keys its config reader looks up). When a
DeepSpeed is installed in a separate venv (``HF_ZERO_DEEPSPEED_PYTHON``, default
``/tmp/ds-venv/bin/python``), the list is made again from it and must match, so a DeepSpeed release
with new keys fails here until each is classified.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import warnings
from pathlib import Path

import pytest

from hf_zero.config import ZeroConfigError, ZeroConfigWarning, load_config, parse_config
from hf_zero.config.key_status import implemented_keys, key_status
from hf_zero.config.no_effect import NO_EFFECT_KEYS
from hf_zero.config.reference import update_page
from hf_zero.config.refused import UNSUPPORTED

REPO = Path(__file__).resolve().parents[2]
KEYS_FILE = Path(__file__).parent / "data" / "deepspeed_config_keys.json"
DS_PYTHON = os.environ.get("HF_ZERO_DEEPSPEED_PYTHON", "/tmp/ds-venv/bin/python")


def _snapshot() -> dict:
    return json.loads(KEYS_FILE.read_text())


def test_every_deepspeed_key_is_classified():
    snap = _snapshot()
    assert snap["deepspeed"].startswith("0.19.")
    assert len(snap["keys"]) > 150  # the whole schema, not a sample
    unknown = [k for k in snap["keys"] if key_status(k) == "unknown"]
    assert not unknown, f"DeepSpeed {snap['deepspeed']} keys hf_zero does not classify: {unknown}"


@pytest.mark.parametrize("key", [
    "zero_optimization.zenflow", "zero_optimization.leaf_module", "zero_optimization.compute_grad_norm",
    "zero_optimization.stage3_allgather_sequential", "zero_optimization.parameter_alignment",
    "zero_optimization.enable_sanity_checks", "zero_optimization.save_muon_momentum_buffer_in_memory",
    "zero_optimization.offload_optimizer.super_offload", "zero_optimization.offload_optimizer.cpuadam_cores_perc",
    "compile", "tensor_parallel", "bf16.bf16_master_weights_and_grads", "bf16.bf16_optimizer_states",
    "checkpoint.load_universal", "data_efficiency",
])
def test_keys_the_issue_names_are_accepted_in_a_config(key):
    """Each parses with a benign value (the key is known), and is reported as no effect."""
    benign = {"zero_optimization.zenflow": {}, "zero_optimization.leaf_module": {"classes": []},
              "zero_optimization.offload_optimizer.super_offload": False, "compile": {"deepcompile": False},
              "tensor_parallel": {"autotp_size": 1}, "data_efficiency": {"enabled": False},
              "zero_optimization.offload_optimizer.cpuadam_cores_perc": 0.8}.get(key, False)
    raw: dict = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = benign
    with warnings.catch_warnings():
        warnings.simplefilter("error", ZeroConfigWarning)  # not "unknown" either
        cfg = parse_config(raw)
    assert key in cfg.no_effect_keys


@pytest.mark.skipif(not os.path.exists(DS_PYTHON), reason=f"no DeepSpeed venv at {DS_PYTHON} "
                    "(set HF_ZERO_DEEPSPEED_PYTHON to a python with deepspeed installed)")
def test_snapshot_matches_the_installed_deepspeed():
    out = subprocess.run([DS_PYTHON, str(REPO / "scripts" / "deepspeed_config_keys.py")], capture_output=True,
                         text=True, timeout=300, check=True)
    live = json.loads(out.stdout)
    snap = _snapshot()
    if live["deepspeed"] == snap["deepspeed"]:
        assert live["keys"] == snap["keys"]
    new = sorted(set(live["keys"]) - set(snap["keys"]))
    unknown = [k for k in new if key_status(k) == "unknown"]
    assert not unknown, f"DeepSpeed {live['deepspeed']} has keys hf_zero does not classify: {unknown}"


def test_every_table_key_has_one_status():
    for key in implemented_keys():
        assert key_status(key) in ("implemented", "no_effect"), key
    for key in NO_EFFECT_KEYS:
        assert key_status(key) in ("no_effect", "implemented"), key
    for key, (predicate, _) in UNSUPPORTED.items():
        assert key_status(key) in ("refused", "no_effect"), key
        assert getattr(predicate, "when", None), key  # the docs say when it is refused


def test_config_reference_tables_are_generated_from_the_tables():
    page = (REPO / "docs" / "config_reference.md").read_text()
    assert update_page(page) == page, "docs/config_reference.md is out of date: python scripts/gen_config_reference.py"
    for key in NO_EFFECT_KEYS:
        assert f"| `{key}` |" in page


@pytest.mark.parametrize("raw, fix", [
    ({"zero_optimization": {"stage": 3, "zenflow": {"topk_ratio": 0.1}}}, "remove zenflow"),
    ({"gradient_allreduce_op": "sum"}, '"gradient_allreduce_op": "mean"'),
    ({"managed_gradient_accumulation": False}, "set_gradient_accumulation_boundary(True)"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, "fp32 master weights"),
    ({"bf16": {"enabled": True, "bf16_optimizer_states": True}}, "optimizer states in fp32"),
])
def test_refused_values_name_the_alternative(raw, fix):
    with pytest.raises(ZeroConfigError) as err:
        parse_config(raw)
    assert "is not supported by hf_zero" in str(err.value) and fix in str(err.value)


@pytest.mark.parametrize("key", ["overlap_comm", "allgather_bucket_size", "stage3_max_reuse_distance"])
def test_knobs_fsdp2_has_no_equivalent_for_are_reported(key):
    value = True if key == "overlap_comm" else 1000
    cfg = parse_config({"zero_optimization": {"stage": 3, key: value}})
    assert f"zero_optimization.{key}" in cfg.no_effect_keys


@pytest.mark.parametrize("key", ["stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                                 "stage3_max_live_parameters"])
def test_stage3_knobs_are_fsdp2_settings_at_stage_3_only(key):
    # tests/unit/test_fsdp_knobs.py checks what they become on the FSDP2 modules.
    assert parse_config({"zero_optimization": {"stage": 3, key: 1000}}).no_effect_keys == ()
    assert f"zero_optimization.{key}" in parse_config({"zero_optimization": {"stage": 2, key: 1000}}).no_effect_keys


def test_reduction_knobs_are_reported():
    cfg = parse_config({"prescale_gradients": True, "gradient_predivide_factor": 2.0})
    assert {"prescale_gradients", "gradient_predivide_factor"} <= set(cfg.no_effect_keys)


def test_gather_16bit_auto_as_accelerate_templates_write_it(monkeypatch):
    raw = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": "auto"}}
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", raising=False)
    assert parse_config(raw).unresolved() == ["zero_optimization.gather_16bit_weights_on_model_save"]
    assert load_config(raw).zero_optimization.gather_16bit_weights_on_model_save is True
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "false")  # accelerate launch's choice
    assert load_config(raw).zero_optimization.gather_16bit_weights_on_model_save is False


def test_unknown_key_lists_known_keys_only_when_short_and_without_duplicates():
    with pytest.raises(ZeroConfigError) as err:
        parse_config({"zero_optimization": {"stage": 2, "xyzzy": 1}})
    assert "docs/config_reference.md lists the keys of zero_optimization" in str(err.value)
    with pytest.raises(ZeroConfigError) as err:
        parse_config({"bf16": {"xyzzy": 1}})
    message = str(err.value)
    known = message.split("keys known here: ")[1].split(" (parse")[0].split(", ")
    assert len(known) == len(set(known)) and "enabled" in known


# Each key table of the parser (hf_zero/config/fields.py) -> the section of docs/config_reference.md
# that must have a line for each of its keys, and the prefix the page may write before a key.
# test_config_parse.py checks that each key appears somewhere on the page; this checks that it
# appears, in backticks, in its own section, so that a key added to a table without a line in the
# reference (or documented under the wrong section) fails.
def _reference_tables():
    from hf_zero.config import fields as F

    return {
        "## Top level": [("", F._TOP), ("", F._TOP_ALIASES)],
        "## `fp16` and `bf16`": [("fp16.", F._FP16), ("bf16.", F._BF16)],
        "## `optimizer`": [("", params) for params in F._OPTIMIZER_PARAMS.values()],
        "## `scheduler`": [("", params) for params in F._SCHEDULER_PARAMS.values()],
        "## `zero_optimization`": [("", F._ZERO), ("", F._ZERO_ALIASES), ("", dict.fromkeys(F._ZERO_LEGACY_OFFLOAD))],
        "### `offload_optimizer`": [("", F._OFFLOAD_OPTIMIZER)],
        "### `offload_param`": [("", F._OFFLOAD_PARAM)],
        "## `aio` (NVMe offload)": [("", F._AIO), ("", F._AIO_ALIASES)],
        "## `checkpoint`, `activation_checkpointing`, monitors": [
            ("checkpoint.", F._CHECKPOINT), ("activation_checkpointing.", F._ACT_CKPT),
            *((f"{name}.", keys) for name, keys in F._MONITORS.items())],
    }


def _section(page: str, heading: str) -> str:
    """``heading``'s section of ``page``: up to the next heading of the same or a higher level."""
    start = page.index(heading + "\n")
    level = len(heading.split(" ", 1)[0])
    following = re.compile(r"^#{1,%d} " % level, re.M).search(page, start + len(heading) + 1)
    return page[start:following.start() if following else len(page)]


def _undocumented(page: str) -> list[str]:
    from hf_zero.config import fields as F
    from hf_zero.config.refused import UNSUPPORTED_OPTIMIZERS

    missing = []
    for heading, tables in _reference_tables().items():
        text = _section(page, heading)
        for prefix, keys in tables:
            missing += [f"{heading}: {prefix}{key}" for key in keys
                        if f"`{key}`" not in text and f"`{prefix}{key}`" not in text]
    optimizer = _section(page, "## `optimizer`").lower()  # types are case-insensitive
    missing += [f"optimizer type {t}" for t in [*F._OPTIMIZER_PARAMS, *UNSUPPORTED_OPTIMIZERS] if f"`{t}`" not in optimizer]
    scheduler = _section(page, "## `scheduler`")  # types are case-sensitive
    missing += [f"scheduler type {t}" for t in F._SCHEDULER_PARAMS if f"`{t}`" not in scheduler]
    return missing


def test_every_parser_key_has_a_line_in_its_section_of_the_reference():
    assert _undocumented((REPO / "docs" / "config_reference.md").read_text()) == []


def test_a_key_added_to_a_table_without_a_reference_line_is_caught(monkeypatch):
    from hf_zero.config import fields as F

    page = (REPO / "docs" / "config_reference.md").read_text()
    monkeypatch.setitem(F._ZERO, "stage3_new_knob", F._ZERO["sub_group_size"])
    monkeypatch.setitem(F._OPTIMIZER_PARAMS, "adafactor", F._OPTIMIZER_PARAMS["sgd"])
    # `enabled` is documented under fp16/bf16, not in the aio section: the section is what counts.
    monkeypatch.setitem(F._AIO, "enabled", F._AIO["block_size"])
    assert _undocumented(page) == ["## `zero_optimization`: stage3_new_knob", "## `aio` (NVMe offload): enabled",
                                   "optimizer type adafactor"]
