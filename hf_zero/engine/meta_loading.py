"""Low-memory loading, step 1: ranks whose ``LOCAL_RANK`` is not 0 build models on the meta device.

While :func:`low_memory_loading` is active (or after :func:`install_low_memory_loading`, which
``hf-zero run`` calls at stage 3), ``from_pretrained`` runs unchanged on such a rank (config,
dtype, weight renaming, tied weights, generation config, adapters) except that checkpoint tensors
are read as shapes only (safetensors headers), never as data. Local rank 0 loads normally. Also
here: when to do it (:func:`should_use_low_memory_loading`, the ``HF_ZERO_LOW_MEMORY_LOADING``
switch, the ZeRO config found on a script's command line). Step 2, filling the shards from rank 0,
is :mod:`hf_zero.engine.rank0_shards`; :mod:`hf_zero.engine.materialize` tells the whole story.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "ENV_SWITCH",
    "install_low_memory_loading",
    "low_memory_loading",
    "should_use_low_memory_loading",
    "skips_weight_loading",
    "uninstall_low_memory_loading",
    "zero_config_from_argv",
]

logger = logging.getLogger("hf_zero")

ENV_SWITCH = "HF_ZERO_LOW_MEMORY_LOADING"
"""Set to ``0`` to turn low-memory loading off (every rank then reads the checkpoint)."""


# --------------------------------------------------------------------------------------- policy
def _env_disabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off")


def skips_weight_loading() -> bool:
    """True on a rank that builds models on the meta device while low-memory loading is active:
    a multi-rank launch (``WORLD_SIZE`` > 1) and ``LOCAL_RANK`` != 0."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    return world > 1 and local_rank != 0 and not _env_disabled()


def should_use_low_memory_loading(zero_config: Any) -> bool:
    """Whether a run with ``zero_config`` should load models with :func:`low_memory_loading`.

    True at ZeRO stage 3 (where the engine shards parameters at start-up, as DeepSpeed's
    ``zero.Init`` does) unless ``HF_ZERO_LOW_MEMORY_LOADING=0``. ``zero_config`` is anything
    :func:`hf_zero.config.parse.parse_config` accepts (a path, dict, JSON string, ``ZeroConfig``),
    a ``ZeroOptimizationConfig``, or None (False).
    """
    if zero_config is None or _env_disabled():
        return False
    stage = getattr(zero_config, "stage", None)  # ZeroConfig and ZeroOptimizationConfig both have it
    if stage is None:
        from hf_zero.config.parse import parse_config

        stage = parse_config(zero_config).stage
    return int(stage) == 3


_CONFIG_KEYS = ("zero_config", "deepspeed")


def zero_config_from_argv(argv: list[str]) -> Any:
    """The zero config a script's arguments name, or None; what the launcher reads before the
    script parses its own arguments. In order of precedence:

    - ``--zero_config``/``--deepspeed`` (``--x v`` or ``--x=v``);
    - ``deepspeed=v``/``zero_config=v`` (the ``key=value`` overrides LLaMA-Factory and other
      OmegaConf front ends take after their YAML);
    - the ``deepspeed``/``zero_config`` key of an arguments file given as a bare argument
      (``train.py args.yaml``, ``launcher.py cfg.yaml``: LLaMA-Factory's YAML, HfArgumentParser's
      ``parse_yaml_file``/``parse_json_file`` files); the value as written there (a path is
      relative to the working directory, as the script reads it, or an inline dict).
    """
    for i, arg in enumerate(argv):
        for flag in ("--" + key for key in _CONFIG_KEYS):
            if arg == flag and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    for arg in reversed(argv):
        for key in _CONFIG_KEYS:
            if arg.startswith(key + "="):
                return arg.split("=", 1)[1] or None
    for i, arg in enumerate(argv):
        if i > 0 and argv[i - 1].startswith("--") and "=" not in argv[i - 1]:
            continue  # the value of a flag, not an arguments file
        found = _config_in_arguments_file(arg)
        if found is not None:
            return found
    return None


def _config_in_arguments_file(arg: str) -> Any:
    """``deepspeed``/``zero_config`` of a YAML or JSON arguments file, or None (not such a file,
    unreadable, or without the key: the script's own parsing reports a broken file)."""
    if not arg.lower().endswith((".yaml", ".yml", ".json")) or not os.path.isfile(arg):
        return None
    try:
        with open(arg, encoding="utf-8") as f:
            if arg.lower().endswith(".json"):
                import json

                data = json.load(f)
            else:
                import yaml

                data = yaml.safe_load(f)
    except Exception:
        return None
    if not isinstance(data, dict):
        return None
    for key in _CONFIG_KEYS:
        if data.get(key):
            return data[key]
    return None


# --------------------------------------------------------------------------------------- loading
class _State:
    installed = False  # PreTrainedModel.from_pretrained is wrapped
    global_on = False  # install_low_memory_loading() was called
    depth = 0  # nesting of low_memory_loading(enabled=True)
    off_depth = 0  # nesting of low_memory_loading(enabled=False)


_ORIGINAL: dict[str, Any] = {}  # "from_pretrained": transformers' classmethod object, while patched


def _active() -> bool:
    return _State.off_depth == 0 and (_State.global_on or _State.depth > 0) and skips_weight_loading()


def _meta_loader(original):
    """A stand-in for ``PreTrainedModel._load_pretrained_model`` that reads checkpoint tensors as
    meta tensors (safetensors headers only) and loads them with a meta ``device_map``: the key
    renaming, conversions, missing/unexpected keys and tying logic are transformers' own."""
    from transformers.modeling_utils import load_state_dict

    @functools.wraps(original)
    def load(model, state_dict, checkpoint_files, load_config, *args, **kwargs):
        device_map = load_config.device_map
        devices = set(device_map.values()) if isinstance(device_map, dict) else set()
        if (
            state_dict is not None  # the caller's own tensors (or a GGUF file's): nothing to save
            or not checkpoint_files
            or load_config.hf_quantizer is not None
            or load_config.device_mesh is not None
            or len(devices) > 1
            or "disk" in devices
        ):
            return original(model, state_dict, checkpoint_files, load_config, *args, **kwargs)
        shapes: dict[str, torch.Tensor] = {}
        for file in checkpoint_files:
            shapes.update(load_state_dict(file, map_location="meta", weights_only=load_config.weights_only))
        meta_config = dataclasses.replace(load_config, device_map={"": torch.device("meta")})
        return original(model, shapes, checkpoint_files, meta_config, *args, **kwargs)

    return load


@contextlib.contextmanager
def _weights_on_meta() -> Iterator[None]:
    from transformers import PreTrainedModel

    original = PreTrainedModel.__dict__["_load_pretrained_model"]
    PreTrainedModel._load_pretrained_model = staticmethod(_meta_loader(original.__func__))
    try:
        yield
    finally:
        PreTrainedModel._load_pretrained_model = original


@contextlib.contextmanager
def _buffers_kept() -> Iterator[Callable[[nn.Module], None]]:
    """Record the real buffers of the model ``_load_pretrained_model`` (transformers < 5.3, a
    classmethod) receives, i.e. as built, before ``from_pretrained``'s dispatch moves them; yields
    ``restore(model)``, which puts them back where they are meta afterwards."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.__dict__["_load_pretrained_model"]
    kept: dict[int, dict[str, torch.Tensor]] = {}

    def record(cls, model, *args, **kwargs):
        for module in model.modules():
            real = {k: b for k, b in module._buffers.items() if b is not None and not b.is_meta}
            if real:
                kept[id(module)] = real
        return original.__func__(cls, model, *args, **kwargs)

    def restore(model: nn.Module) -> None:
        for module in model.modules():
            for key, buf in kept.get(id(module), {}).items():
                current = module._buffers.get(key)
                if current is not None and current.is_meta and current.shape == buf.shape:
                    module._buffers[key] = buf.to(current.dtype)

    PreTrainedModel._load_pretrained_model = classmethod(functools.wraps(original.__func__)(record))
    try:
        yield restore
    finally:
        PreTrainedModel._load_pretrained_model = original


def _patched_from_pretrained(cls, *args, **kwargs):
    original = _ORIGINAL["from_pretrained"].__func__
    if not _active():
        return original(cls, *args, **kwargs)
    from transformers import PreTrainedModel

    if isinstance(PreTrainedModel.__dict__.get("_load_pretrained_model"), staticmethod):
        with _weights_on_meta():
            model = original(cls, *args, **kwargs)
    else:
        # transformers < 5.3 (a classmethod hook with another signature): the public, slower way,
        # device_map="meta" (reads, then drops, the data one file at a time). Its final dispatch
        # also moves the buffers to meta; those transformers computed at construction (rotary
        # inv_freq) are put back, as the newer path leaves them.
        with _buffers_kept() as restore:
            model = original(cls, *args, **{**kwargs, "device_map": "meta"})
        restore(model)
    logger.info(
        "hf_zero: LOCAL_RANK %s built %s on the meta device; the ZeRO-3 engine fills its shards from rank 0",
        os.environ.get("LOCAL_RANK"), type(model).__name__,
    )
    return model


# ``resize_token_embeddings`` initialises added rows from the old rows' mean and covariance, which
# reads values (``.item()``) and so fails on a meta model. On a meta rank those rows are overwritten
# by rank 0's anyway: skip the initialisation when the embeddings are on the meta device.
_VALUE_INITS = (
    "_init_added_embeddings_weights_with_mean",
    "_init_added_lm_head_weights_with_mean",
    "_init_added_lm_head_bias_with_mean",
)


def _skip_on_meta(method):
    @functools.wraps(method)
    def init(self, *args, **kwargs):
        modules = [a for a in (*args, *kwargs.values()) if isinstance(a, nn.Module)]
        if any(p.is_meta for m in modules for p in m.parameters()):
            return None
        return method(self, *args, **kwargs)

    return init


def _install() -> None:
    if _State.installed:
        return
    from transformers import PreTrainedModel

    _ORIGINAL["from_pretrained"] = PreTrainedModel.__dict__["from_pretrained"]
    wrapped = functools.wraps(_ORIGINAL["from_pretrained"].__func__)(_patched_from_pretrained)
    PreTrainedModel.from_pretrained = classmethod(wrapped)
    for name in _VALUE_INITS:
        method = PreTrainedModel.__dict__.get(name)
        if callable(method):
            _ORIGINAL[name] = method
            setattr(PreTrainedModel, name, _skip_on_meta(method))
    _State.installed = True


def install_low_memory_loading() -> None:
    """Turn low-memory loading on for the rest of the process (idempotent): on a rank with
    ``LOCAL_RANK`` != 0 every ``from_pretrained`` of a transformers model builds it on the meta
    device. For launchers (``hf-zero run`` at stage 3); scripts use :func:`low_memory_loading`."""
    _install()
    _State.global_on = True


def uninstall_low_memory_loading() -> None:
    """Undo :func:`install_low_memory_loading` and restore ``from_pretrained``."""
    _State.global_on = False
    if _State.installed and _State.depth == 0 and _State.off_depth == 0:
        from transformers import PreTrainedModel

        for name, original in list(_ORIGINAL.items()):
            setattr(PreTrainedModel, name, original)
        _ORIGINAL.clear()
        _State.installed = False


@contextlib.contextmanager
def low_memory_loading(enabled: bool = True) -> Iterator[None]:
    """Within the block, ``from_pretrained`` (all ``Auto*`` classes go through it) builds the model
    on the meta device on every rank but each node's local rank 0, which loads it normally.
    ``enabled=False`` turns it off within the block (e.g. for a frozen reference model after
    :func:`install_low_memory_loading`).

    Example::

        >>> with low_memory_loading():
        ...     model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        >>> engine = hf_zero.initialize(model, "ds_zero3.json")   # fills every rank's shards
    """
    _install()
    if enabled:
        _State.depth += 1
    else:
        _State.off_depth += 1
    try:
        yield
    finally:
        if enabled:
            _State.depth -= 1
        else:
            _State.off_depth -= 1
