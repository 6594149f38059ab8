"""Parse a DeepSpeed-style config (path, dict, JSON string, base64 JSON, or several fragments) into
hf_zero's frozen :class:`~hf_zero.config.schema.ZeroConfig`.

One pass over the raw dict collects every problem, then builds the frozen tree. The parts it reads,
each a module of its own so that a table is data a reader finds by name:

- :mod:`hf_zero.config.sources` -- files, dicts and strings to a raw dict;
- :mod:`hf_zero.config.fields` -- the keys hf_zero implements, per section, with their aliases;
- :mod:`hf_zero.config.no_effect` -- keys accepted without effect (reported once at start-up);
- :mod:`hf_zero.config.refused` -- settings refused with the reason and the alternative;
- :mod:`hf_zero.config.converters` -- values to types (``2e8``, ``"auto"``, ranges).

``"auto"`` values are kept as :data:`AUTO`; :mod:`hf_zero.config.auto` resolves them. Defaults
follow DeepSpeed's code (``deepspeed/runtime/config.py``, ``zero/config.py``,
``zero/offload_config.py``, ``lr_schedules.py``); docs/config_reference.md lists where that code
and DeepSpeed's docs disagree.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from typing import Any, Mapping

from hf_zero.config import schema as S
from hf_zero.config.converters import BAD, _bool, _number  # noqa: F401
from hf_zero.config.errors import ZeroConfigError, ZeroConfigWarning, format_problem, show_value
from hf_zero.config.fields import (  # noqa: F401 - the tables are part of this module's namespace for readers and tests
    _ACT_CKPT,
    _AIO,
    _AIO_ALIASES,
    _BF16,
    _CHECKPOINT,
    _FP16,
    _MONITORS,
    _OFFLOAD_OPTIMIZER,
    _OFFLOAD_PARAM,
    _OPTIMIZER_DISPLAY,
    _OPTIMIZER_PARAMS,
    _REQUIRED_SCHEDULER_PARAMS,
    _SCHEDULER_PARAMS,
    _TOP,
    _TOP_ALIASES,
    _TOP_SECTIONS,
    _ZERO,
    _ZERO_ALIASES,
    _ZERO_LEGACY_OFFLOAD,
    MUON_DEFAULTS,
    MUON_FIXED,
    SCHEDULER_TYPES,
    SUPPORTED_OPTIMIZERS,
    Fields,
    _children,
)
from hf_zero.config.no_effect import NO_EFFECT_KEYS, describe_no_effect, stage_no_effect_keys
from hf_zero.config.refused import UNSUPPORTED, UNSUPPORTED_OPTIMIZERS, UNSUPPORTED_WITH_OPTIMIZER, _always  # noqa: F401
from hf_zero.config.schema import AUTO, ZeroConfig  # noqa: F401
from hf_zero.config.sources import ConfigSource, deep_merge, load_raw

__all__ = [
    "NO_EFFECT_KEYS",
    "UNSUPPORTED",
    "ConfigSource",
    "describe_no_effect",
    "load_raw",
    "merge_configs",
    "parse_config",
]


# --------------------------------------------------------------------------------------------------
# The parser
# --------------------------------------------------------------------------------------------------
class _Parser:
    """One pass over a raw dict: collects every problem, then builds the frozen tree."""

    def __init__(self, source: str, strict: bool, origins: Mapping[str, str] | None = None):
        self.source = source
        self.strict = strict
        self.origins = dict(origins or {})
        self.problems: list[str] = []
        self.no_effect: list[str] = []
        self.explicit: set[str] = set()

    # -- reporting ---------------------------------------------------------------------------------
    def source_of(self, dotted: str) -> str:
        key = dotted
        while key:
            if key in self.origins:
                return self.origins[key]
            key = key.rpartition(".")[0]
        return self.source

    def problem(self, key: str, value: Any, issue: str, fix: str | None = None) -> None:
        self.problems.append(format_problem(self.source_of(key), key, value, issue, fix))

    def unknown(self, dotted: str, key: str, candidates: list[str], value: Any = None) -> None:
        close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
        if not close:
            lowered = {c.lower(): c for c in candidates}
            close = [lowered[key.lower()]] if key.lower() in lowered else []
        parent = dotted[: -len(key)]
        if close:
            hint = f'did you mean "{parent}{close[0]}"?'
        else:
            known = sorted(set(candidates))
            section = dotted[: -len(key) - 1] or "the top level"
            hint = (f"keys known here: {', '.join(known)}" if len(known) <= 12
                    else f"docs/config_reference.md lists the keys of {section}")
        shown = show_value(value)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        message = (f'{self.source_of(dotted)}: unknown key "{dotted}" (value {shown}); {hint} '
                   "(parse with strict=False to only warn)")
        if self.strict:
            self.problems.append(message)
        else:
            warnings.warn(message, ZeroConfigWarning, stacklevel=4)

    def note_no_effect(self, dotted: str) -> None:
        if dotted not in self.no_effect:
            self.no_effect.append(dotted)

    def special(self, dotted: str, value: Any) -> bool:
        """Handle keys from UNSUPPORTED / NO_EFFECT_KEYS; True when the key was consumed."""
        rule = UNSUPPORTED.get(dotted)
        if rule is not None and rule[0](value):
            self.problem(dotted, value, "is not supported by hf_zero", rule[1])
            return True
        if dotted in NO_EFFECT_KEYS:
            self.note_no_effect(dotted)
            return True
        return False

    # -- sections ----------------------------------------------------------------------------------
    def section(
        self,
        path: str,
        raw: Any,
        fields: Fields,
        *,
        field_prefix: str,
        aliases: Mapping[str, str] | None = None,
        skip: tuple[str, ...] = (),
    ) -> dict[str, Any]:
        """Convert the keys of one JSON object into dataclass keyword arguments.

        ``skip`` keys are left for the caller (sub-sections, legacy switches).
        """
        aliases = aliases or {}
        if raw is None:
            return {}
        if not isinstance(raw, dict):
            self.problem(path, raw, "is not an object", "write {...} with the section's keys")
            return {}
        out: dict[str, Any] = {}
        set_by: dict[str, tuple[str, Any]] = {}
        for key, value in raw.items():
            dotted = f"{path}.{key}" if path else key
            if key in skip:
                continue
            canonical = aliases.get(key, key)
            if canonical in fields:
                canonical_dotted = f"{path}.{canonical}" if path else canonical
                if value is None:  # JSON null = the default (DeepSpeed's get_scalar_param does the same)
                    continue
                name, convert = fields[canonical]
                converted = convert(self, dotted, value)
                if converted is BAD:
                    continue
                if name in out and out[name] != converted:
                    other_key, other_value = set_by[name]
                    self.problem(dotted, value, f"conflicts with {other_key}={show_value(other_value)}",
                                 "keep only one of the two names")
                    continue
                out[name] = converted
                set_by[name] = (dotted, value)
                self.explicit.add(f"{field_prefix}{name}")
                if canonical_dotted in NO_EFFECT_KEYS:
                    self.note_no_effect(canonical_dotted)
                continue
            if self.special(dotted, value):
                continue
            candidates = list(fields) + list(aliases) + list(skip) + _children(path, NO_EFFECT_KEYS)
            self.unknown(dotted, key, candidates, value)
        return out

    # -- whole document ----------------------------------------------------------------------------
    def build(self, raw: dict[str, Any]) -> ZeroConfig:
        for old, new in _TOP_ALIASES.items():
            if old in raw:
                if new in raw:
                    self.problem(old, raw[old], f"is the old name of {new}, which is also set", f"keep only {new}")
                else:
                    raw[new] = raw[old]
                raw = {k: v for k, v in raw.items() if k != old}
        raw = self.drop_unknown_top_level(raw)
        top = self.section("", raw, _TOP, field_prefix="", skip=_TOP_SECTIONS)

        zero = self.zero_section(raw.get("zero_optimization"))
        fp16 = self.section("fp16", raw.get("fp16"), _FP16, field_prefix="fp16.")
        bf16 = self.section("bf16", raw.get("bf16"), _BF16, field_prefix="bf16.")
        optimizer = self.optimizer_section(raw.get("optimizer"), zero)
        scheduler = self.scheduler_section(raw.get("scheduler"))
        aio = self.section("aio", raw.get("aio"), _AIO, field_prefix="aio.", aliases=_AIO_ALIASES)
        act = self.section("activation_checkpointing", raw.get("activation_checkpointing"), _ACT_CKPT,
                           field_prefix="activation_checkpointing.")
        ckpt = self.section("checkpoint", raw.get("checkpoint"), _CHECKPOINT, field_prefix="checkpoint.")
        monitors = {
            name: self.section(name, raw.get(name), fields, field_prefix=f"{name}.")
            for name, fields in _MONITORS.items()
        }
        for name in ("activation_checkpointing", *_MONITORS):
            if raw.get(name):
                self.note_no_effect(name)

        if fp16.get("enabled") is True and bf16.get("enabled") is True:
            self.problem("bf16.enabled", True, "conflicts with fp16.enabled=true (both enabled)",
                         "enable only one of fp16 and bf16 (or set both to \"auto\")")

        values = {**top, **{f"zero_optimization.{f.name}": getattr(zero, f.name) for f in dataclasses.fields(zero)}}
        written = {path: values.get(path) for path in self.explicit if path in values}
        for key in stage_no_effect_keys(zero.stage, written):
            self.note_no_effect(key)  # e.g. stage3_* keys below stage 3

        if self.problems:
            raise ZeroConfigError(self.problems)

        return ZeroConfig(
            **top,
            fp16=S.FP16Config(**fp16),
            bf16=S.BF16Config(**bf16),
            optimizer=optimizer,
            scheduler=scheduler,
            zero_optimization=zero,
            aio=S.AioConfig(**aio),
            activation_checkpointing=S.ActivationCheckpointingConfig(**act),
            checkpoint=S.CheckpointConfig(**ckpt),
            tensorboard=S.MonitorConfig(**monitors["tensorboard"]),
            wandb=S.MonitorConfig(**monitors["wandb"]),
            csv_monitor=S.MonitorConfig(**monitors["csv_monitor"]),
            source=self.source,
            no_effect_keys=tuple(self.no_effect),
            explicit_keys=tuple(sorted(self.explicit)),
        )

    def drop_unknown_top_level(self, raw: dict[str, Any]) -> dict[str, Any]:
        """DeepSpeed ignores top-level keys it does not know (real configs carry ``"_comment"``,
        ``"log"``, ``"comms_config"``); so does hf_zero, with one warning naming them all."""
        known = set(_TOP) | set(_TOP_SECTIONS) | set(_TOP_ALIASES)
        unknown = [k for k in raw if k not in known and k not in NO_EFFECT_KEYS and k not in UNSUPPORTED]
        if not unknown:
            return raw
        candidates = sorted(known | {k for k in [*NO_EFFECT_KEYS, *UNSUPPORTED] if "." not in k})
        named = []
        for key in unknown:
            # "_comment"-style keys are comments, not typos.
            close = [] if str(key).startswith("_") else difflib.get_close_matches(str(key), candidates, n=1, cutoff=0.75)
            named.append(f'"{key}"' + (f' (did you mean "{close[0]}"?)' if close else ""))
        warnings.warn(
            f"{self.source}: ignoring top-level key{'s' if len(unknown) > 1 else ''} hf_zero does not know, as "
            f"DeepSpeed does: {', '.join(named)}", ZeroConfigWarning, stacklevel=4,
        )
        return {k: v for k, v in raw.items() if k not in unknown}

    def zero_section(self, raw: Any) -> S.ZeroOptimizationConfig:
        if isinstance(raw, bool):
            # Pre-2020 format "zero_optimization": true meant stage 1 (zero/config.py
            # read_zero_config_deprecated).
            raw = {"stage": 1 if raw else 0}
        path = "zero_optimization"
        kw = self.section(path, raw, _ZERO, field_prefix=f"{path}.", aliases=_ZERO_ALIASES,
                          skip=("offload_optimizer", "offload_param", *_ZERO_LEGACY_OFFLOAD))
        raw = raw if isinstance(raw, dict) else {}
        stage = kw.get("stage", 0)
        # An invalid stage was already reported; checks that depend on it would only add noise.
        stage_known = "stage" in kw or raw.get("stage") is None

        opt = self.section(f"{path}.offload_optimizer", raw.get("offload_optimizer"), _OFFLOAD_OPTIMIZER,
                           field_prefix=f"{path}.offload_optimizer.")
        par = self.section(f"{path}.offload_param", raw.get("offload_param"), _OFFLOAD_PARAM,
                           field_prefix=f"{path}.offload_param.")
        self.legacy_offload(path, raw, opt, par)

        opt_device, par_device = opt.get("device", "none"), par.get("device", "none")
        if par_device != "none" and stage != 3 and stage_known:
            self.problem(f"{path}.offload_param.device", par_device,
                         f"needs ZeRO stage 3 (zero_optimization.stage is {stage})",
                         "set zero_optimization.stage to 3, or remove offload_param "
                         "(offload_optimizer works at stages 1-3)")
        if opt_device != "none" and stage == 0 and stage_known:
            self.problem(f"{path}.offload_optimizer.device", opt_device,
                         "needs ZeRO stage 1, 2 or 3 (zero_optimization.stage is 0)",
                         "set zero_optimization.stage to 1, 2 or 3, or set the device to \"none\"")
        for name, section in (("offload_optimizer", opt), ("offload_param", par)):
            if section.get("device") == "nvme" and not section.get("nvme_path"):
                self.problem(f"{path}.{name}.device", "nvme", "needs a folder for swap files",
                             f'add "nvme_path": "/path/on/fast/disk" to zero_optimization.{name}')
        if opt.get("ratio", 1.0) < 1.0 and stage != 3 and stage_known:
            # DeepSpeed asserts the same (zero/config.py offload_ratio_check).
            self.problem(f"{path}.offload_optimizer.ratio", opt["ratio"],
                         f"partial offload needs ZeRO stage 3 (zero_optimization.stage is {stage})",
                         "set ratio to 1.0 or use stage 3")

        if kw.get("mics_shard_size") == 1:
            self.problem(f"{path}.mics_shard_size", 1, "a shard group of one rank shards nothing",
                         "write the ranks of one shard group (such as the GPUs of a node), or -1 to shard over all ranks")
        if "overlap_comm" not in kw:
            # DeepSpeed: overlap_comm None -> stage == 3 (zero/config.py overlap_comm_valid).
            kw["overlap_comm"] = stage == 3
        return S.ZeroOptimizationConfig(
            **kw,
            offload_optimizer=S.OffloadOptimizerConfig(**opt),
            offload_param=S.OffloadParamConfig(**par),
        )

    def legacy_offload(self, path: str, raw: dict, opt: dict, par: dict) -> None:
        """``cpu_offload`` -> offload_optimizer.device=cpu; ``cpu_offload_param(s)`` ->
        offload_param.device=cpu; ``cpu_offload_use_pin_memory`` -> pin_memory of those."""
        flags: dict[str, bool] = {}
        for key in _ZERO_LEGACY_OFFLOAD:
            if key in raw and raw[key] is not None:
                value = _bool()(self, f"{path}.{key}", raw[key])
                if value is not BAD:
                    flags[key] = value
        param_flag = flags.get("cpu_offload_param", flags.get("cpu_offload_params"))
        for flag, target, section, name in (
            (flags.get("cpu_offload"), opt, "offload_optimizer", "cpu_offload"),
            (param_flag, par, "offload_param",
             "cpu_offload_param" if "cpu_offload_param" in flags else "cpu_offload_params"),
        ):
            if not flag:
                continue
            if target.get("device", "cpu") != "cpu":
                # DeepSpeed refuses a deprecated key that contradicts its replacement too.
                self.problem(f"{path}.{name}", flag,
                             f'contradicts {path}.{section}.device="{target["device"]}" (it is the old spelling '
                             f'of device "cpu")', f"remove {name} and keep {section}")
            else:
                target["device"] = "cpu"
                self.explicit.add(f"{path}.{section}.device")
        pin = flags.get("cpu_offload_use_pin_memory")
        if pin is not None:
            for target in (opt, par):
                if target.get("device") == "cpu" and "pin_memory" not in target:
                    target["pin_memory"] = pin

    def drop_foreign_params(
        self, path: str, params: Any, type_name: str, fields: Fields, every: set[str]
    ) -> Any:
        """Report parameters that belong to another optimizer/scheduler type (a clearer message
        than "unknown key") and return the params without them."""
        if not isinstance(params, dict):
            return params
        kept = {}
        for key, value in params.items():
            if key in every and key not in fields:
                self.problem(f"{path}.{key}", value, f"is not a parameter of {type_name}",
                             f"{type_name} takes {', '.join(fields)}; remove it or change the type")
            else:
                kept[key] = value
        return kept

    def optimizer_section(self, raw: Any, zero: S.ZeroOptimizationConfig | None = None) -> S.OptimizerConfig | None:
        if raw is None:
            return None
        if not isinstance(raw, dict):
            self.problem("optimizer", raw, "is not an object", 'write {"type": "AdamW", "params": {...}}')
            return None
        for key, value in raw.items():
            if key not in ("type", "params") and not self.special(f"optimizer.{key}", value):
                self.unknown(f"optimizer.{key}", key, ["type", "params", *_children("optimizer", NO_EFFECT_KEYS)],
                             value)
        type_name = raw.get("type")
        if not isinstance(type_name, str) or not type_name.strip():
            self.problem("optimizer.type", type_name, "is missing or not a string",
                         f"set it to one of {_OPTIMIZER_DISPLAY}")
            return None
        canonical = type_name.strip().lower()
        if canonical not in SUPPORTED_OPTIMIZERS:
            if canonical in UNSUPPORTED_OPTIMIZERS:
                self.problem("optimizer.type", type_name,
                             f"is not supported by hf_zero ({UNSUPPORTED_OPTIMIZERS[canonical]})",
                             f"use {_OPTIMIZER_DISPLAY}")
            else:
                close = difflib.get_close_matches(canonical, SUPPORTED_OPTIMIZERS, n=1, cutoff=0.6)
                fix = (f'did you mean "{close[0]}"? ' if close else "") + f"use {_OPTIMIZER_DISPLAY}"
                self.problem("optimizer.type", type_name, "is not an optimizer hf_zero implements", fix)
            return None
        params = raw.get("params")
        if canonical == "muon" and isinstance(params, dict):
            params = self.drop_muon_fixed(params)
        params = self.drop_foreign_params(
            "optimizer.params", params, type_name, _OPTIMIZER_PARAMS[canonical],
            set().union(*_OPTIMIZER_PARAMS.values()),
        )
        kw = self.section("optimizer.params", params, _OPTIMIZER_PARAMS[canonical], field_prefix="optimizer.")
        if canonical == "muon":
            self.muon_settings(kw, zero)
        if canonical == "adamw":
            if kw.get("adam_w_mode") is False:
                # DeepSpeed ignores it as well (engine.py: effective_adam_w_mode = name == adamw or ...).
                warnings.warn(
                    f'{self.source_of("optimizer")}: optimizer.params.adam_w_mode=false has no effect with '
                    'type "AdamW" (as in DeepSpeed); use type "Adam" with adam_w_mode false for L2-style decay',
                    ZeroConfigWarning, stacklevel=3,
                )
            kw["adam_w_mode"] = True
        return S.OptimizerConfig(type=canonical, **kw)

    def drop_muon_fixed(self, params: dict[str, Any]) -> dict[str, Any]:
        """Report the keys DeepSpeed's Muon does not read (``ns_steps``, ``nesterov``)."""
        for key in MUON_FIXED:
            if key in params:
                self.problem(f"optimizer.params.{key}", params[key], "is not a setting of DeepSpeed's Muon",
                             MUON_FIXED[key])
        return {k: v for k, v in params.items() if k not in MUON_FIXED}

    def muon_settings(self, kw: dict[str, Any], zero: S.ZeroOptimizationConfig | None) -> None:
        """DeepSpeed's Muon defaults for absent keys, and the settings refused with Muon."""
        for key, default in MUON_DEFAULTS.items():
            if key in ("muon_lr", "adam_lr") and "lr" in kw:
                continue  # an explicit (or "auto") lr is both halves' lr
            kw.setdefault(key, default)
        if kw.get("momentum", 0.0) >= 1.0:
            self.problem("optimizer.params.momentum", kw["momentum"], "must be < 1 for Muon",
                         "write a value in [0, 1) such as 0.95 (DeepSpeed's default)")
        for dotted, (refused, fix) in UNSUPPORTED_WITH_OPTIMIZER["muon"].items():
            section, _, rest = dotted.partition(".")
            value: Any = zero if section == "zero_optimization" else None
            for name in rest.split("."):
                value = getattr(value, name, None)
            if value is not None and refused(value):
                self.problem(dotted, value, 'is not supported with optimizer type "Muon"', fix)

    def scheduler_section(self, raw: Any) -> S.SchedulerConfig | None:
        if raw is None:
            return None
        if not isinstance(raw, dict):
            self.problem("scheduler", raw, "is not an object", 'write {"type": "WarmupLR", "params": {...}}')
            return None
        for key, value in raw.items():
            if key not in ("type", "params") and not self.special(f"scheduler.{key}", value):
                self.unknown(f"scheduler.{key}", key, ["type", "params"], value)
        type_name = raw.get("type")
        if type_name not in SCHEDULER_TYPES:
            names = list(SCHEDULER_TYPES)
            close = [n for n in names if isinstance(type_name, str) and n.lower() == type_name.lower()]
            close = close or difflib.get_close_matches(str(type_name), names, n=1, cutoff=0.6)
            fix = (f'did you mean "{close[0]}"? (names are case-sensitive, as in DeepSpeed) ' if close else "")
            self.problem("scheduler.type", type_name, "is not a scheduler hf_zero implements",
                         fix + "use one of " + ", ".join(names))
            return None
        params = self.drop_foreign_params(
            "scheduler.params", raw.get("params"), type_name, _SCHEDULER_PARAMS[type_name],
            set().union(*_SCHEDULER_PARAMS.values()),
        )
        kw = self.section("scheduler.params", params, _SCHEDULER_PARAMS[type_name],
                          field_prefix="scheduler.params.")
        for required in _REQUIRED_SCHEDULER_PARAMS.get(type_name, ()):
            if required not in kw and f"scheduler.params.{required}" not in self.explicit:
                self.problems.append(
                    f"{self.source_of('scheduler')}: scheduler.params.{required} is missing but required by "
                    f"{type_name} (DeepSpeed has no default for it); add it to scheduler.params"
                )
        params_cls = SCHEDULER_TYPES[type_name]
        return S.SchedulerConfig(type=type_name, params=params_cls(**kw))


# --------------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------------
def parse_config(source: ConfigSource, *, strict: bool = True) -> ZeroConfig:
    """Parse a DeepSpeed-style config into a frozen :class:`ZeroConfig` (``"auto"`` values kept).

    Args:
        source: A path to a ``.json``/``.yaml``/``.yml`` file, a dict (deep-copied, never mutated),
            a JSON object string, base64-encoded JSON, or a list/tuple of those (fragments merged
            with :func:`merge_configs`).
        strict: When True (default) an unknown key is an error; when False it is a
            :class:`~hf_zero.config.errors.ZeroConfigWarning`.

    Returns:
        The parsed config. ``cfg.unresolved()`` lists the keys still ``"auto"``;
        ``cfg.no_effect_keys`` the accepted keys that change nothing; ``cfg.explicit_keys`` the
        field paths the user wrote.

    Raises:
        ZeroConfigError: Every problem found (unknown keys, wrong types, values out of range,
            unsupported settings, inconsistent sections), one line each, naming the source, the
            dotted key, the value and what to write instead.
    """
    if isinstance(source, ZeroConfig):
        return source
    if isinstance(source, (list, tuple)):
        return merge_configs(*source, strict=strict)
    raw, where = load_raw(source)
    return _Parser(where, strict).build(raw)


def merge_configs(*sources: ConfigSource, strict: bool = True) -> ZeroConfig:
    """Deep-merge config fragments in order (later wins) and parse the result.

    Lets a section kept in its own file (``optimizer.json``, ``scheduler.json``) join a
    ``zero_optimization`` file. Nested objects merge key by key; any other value replaces.

    Args:
        *sources: Config sources as accepted by :func:`load_raw` (at least one).
        strict: As in :func:`parse_config`.

    Returns:
        The parsed merged config; its ``source`` is the sources joined with ``" + "``. Problem
        messages name the fragment that set the offending key.

    Raises:
        ZeroConfigError: As :func:`parse_config`, or when no source is given.
    """
    if not sources:
        raise ZeroConfigError("merge_configs: no config given; pass at least one path, dict or JSON string")
    merged: dict[str, Any] = {}
    origins: dict[str, str] = {}
    names: list[str] = []
    for src in sources:
        raw, where = load_raw(src)
        names.append(where)
        deep_merge(merged, raw, where, origins)
    return _Parser(" + ".join(names), strict, origins if len(sources) > 1 else None).build(merged)
