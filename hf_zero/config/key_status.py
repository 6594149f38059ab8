"""What hf_zero does with a DeepSpeed key: one answer per dotted key, from the tables.

``implemented`` (a field of :mod:`hf_zero.config.fields`, or one of its aliases), ``no_effect``
(:mod:`hf_zero.config.no_effect`), ``refused`` (:mod:`hf_zero.config.refused`, always refused),
or ``unknown``. A key under a section that is accepted or refused as a whole (``flops_profiler``,
``data_efficiency``) takes the section's status. Used by ``hf-zero config keys`` and by the test
that classifies every key of DeepSpeed's schema.

Example::

    >>> key_status("zero_optimization.stage3_prefetch_bucket_size")
    'implemented'
    >>> key_status("zero_optimization.round_robin_gradients")
    'no_effect'
    >>> key_status("optimizer.params.muon_lr")
    'implemented'
"""

from __future__ import annotations

from typing import Literal

from hf_zero.config import fields as F
from hf_zero.config.no_effect import NO_EFFECT_KEYS
from hf_zero.config.refused import UNSUPPORTED, _always

__all__ = ["KeyStatus", "key_status", "implemented_keys"]

KeyStatus = Literal["implemented", "no_effect", "refused", "unknown"]

# Sections parsed key by key: a key below them must be listed itself.
_SECTIONS: dict[str, list[dict]] = {
    "": [F._TOP, F._TOP_ALIASES, dict.fromkeys(F._TOP_SECTIONS)],
    "fp16": [F._FP16],
    "bf16": [F._BF16],
    "zero_optimization": [F._ZERO, F._ZERO_ALIASES, dict.fromkeys(F._ZERO_LEGACY_OFFLOAD),
                          dict.fromkeys(("offload_optimizer", "offload_param"))],
    "zero_optimization.offload_optimizer": [F._OFFLOAD_OPTIMIZER],
    "zero_optimization.offload_param": [F._OFFLOAD_PARAM],
    "aio": [F._AIO, F._AIO_ALIASES],
    "activation_checkpointing": [F._ACT_CKPT],
    "checkpoint": [F._CHECKPOINT],
    **{name: [fields] for name, fields in F._MONITORS.items()},
    "optimizer": [dict.fromkeys(("type", "params"))],
    # Every optimizer type's params (adam, sgd, lion, lamb, muon); which type takes which key is
    # the parser's check (a key of another type is an error naming the type).
    "optimizer.params": list(F._OPTIMIZER_PARAMS.values()),
    "scheduler": [dict.fromkeys(("type", "params"))],
}


def implemented_keys() -> list[str]:
    """Every dotted key hf_zero parses into a field (aliases included), sections excluded."""
    out = []
    for section, tables in _SECTIONS.items():
        for table in tables:
            for key in table:
                dotted = f"{section}.{key}" if section else key
                if dotted not in _SECTIONS:
                    out.append(dotted)
    return sorted(set(out))


def key_status(dotted: str) -> KeyStatus:
    """How hf_zero treats the DeepSpeed key ``dotted`` (``"zero_optimization.overlap_comm"``)."""
    rule = UNSUPPORTED.get(dotted)
    if rule is not None and rule[0] is _always:
        return "refused"
    if dotted in NO_EFFECT_KEYS:
        return "no_effect"
    section, _, key = dotted.rpartition(".")
    if dotted in _SECTIONS:
        return "implemented"
    if section in _SECTIONS:
        if any(key in table for table in _SECTIONS[section]):
            return "implemented"
        return "refused" if dotted in UNSUPPORTED else "unknown"
    if dotted in UNSUPPORTED:
        return "refused"
    # Below a section handled as a whole (no-effect or refused): the section decides.
    parent = section
    while parent:
        if parent in NO_EFFECT_KEYS or parent in UNSUPPORTED:
            return key_status(parent)
        if parent in _SECTIONS:
            return "unknown"
        parent = parent.rpartition(".")[0]
    return "unknown"
