"""Low-memory model loading for ZeRO-3: one full copy per node, not one per rank.

Without this, every rank of ``torchrun --nproc_per_node N`` runs ``from_pretrained`` and holds the
whole model until ``fully_shard`` keeps 1/N of it. transformers 5 memory-maps safetensors, so
ranks that use the weights as stored share the page cache; but each rank that converts them (a
bf16 checkpoint becoming the fp32 master copy at ZeRO-3, a ``dtype=`` differing from the file's,
a file system where transformers turns mmap off) makes its own full private copy: N per node.
With this module (DeepSpeed's ``zero.Init`` loading, on FSDP2) only local rank 0 ever holds the
model. Measured (``bench/README_loading.md``): bf16 checkpoint, 4 ranks, node peak (summed PSS)
3,721 -> 1,919 MiB; where the weights are used as stored, the ranks shared the page cache already
and the node's total does not drop (rank 0 reads the whole file instead of each rank its 1/N).

1. **Load**: while :func:`low_memory_loading` is active (or after :func:`install_low_memory_loading`,
   which ``hf-zero run`` calls at stage 3), a rank whose ``LOCAL_RANK`` is not 0 builds the model
   on the meta device: ``from_pretrained`` runs unchanged (config, dtype, weight renaming, tied
   weights, generation config, adapters) except that checkpoint tensors are read as shapes only
   (safetensors headers) and never as data. Local rank 0 loads normally.
2. **Shard**: :class:`FullyShardedStage` wraps the sharding in :func:`sharded_from_rank0`: before
   ``fully_shard``, rank 0 keeps references to its full parameters (no copy); after it, the ranks
   holding meta tensors allocate their shards (``to_empty``) and every rank receives its shard of
   each parameter from rank 0, one tensor at a time (a scatter, so no rank but rank 0 ever holds a
   full tensor); buffers (rotary ``inv_freq`` and other non-persistent ones included) are broadcast
   whole. The engine does this also when every rank holds real weights (one scatter of the model):
   ranks that built different weights then still start from rank 0's, as with DDP.

Multi-node: each node's local rank 0 loads its own copy (one per node, as the requirement says);
the 1-D mesh spans every rank, so global rank 0 is the single source and the other nodes' copies
serve only until ``fully_shard`` frees them.

Limits: a meta model cannot run or be moved (``model.cuda()``, ``model.to("cuda")``,
``model.generate()``) before the ZeRO-3 engine shards it, exactly as with DeepSpeed's ``zero.Init``;
every ``from_pretrained`` while loading is active is affected (a second, frozen reference model
too), so such scripts opt out with ``HF_ZERO_LOW_MEMORY_LOADING=0`` or
``with low_memory_loading(enabled=False):``. Quantized loads, explicit ``state_dict=``, GGUF files
and multi-device/disk ``device_map``\\s load normally on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hf_zero.distributed import device as accel

__all__ = [
    "low_memory_loading",
    "install_low_memory_loading",
    "uninstall_low_memory_loading",
    "should_use_low_memory_loading",
    "zero_config_from_argv",
    "skips_weight_loading",
    "has_meta_params",
    "capture_full_state",
    "fill_sharded_from_rank0",
    "sharded_from_rank0",
]

logger = logging.getLogger("hf_zero")

ENV_SWITCH = "HF_ZERO_LOW_MEMORY_LOADING"
"""Set to ``0`` to turn low-memory loading off (every rank then reads the checkpoint)."""

_SOURCE = 0  # rank of the mesh's process group that holds the real weights


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


# --------------------------------------------------------------------------------------- sharding
def has_meta_params(model: nn.Module) -> bool:
    """True when some parameter of ``model`` is on the meta device (a DTensor's shard included)."""
    return any(_is_meta(p) for p in model.parameters())


def _is_meta(t: torch.Tensor) -> bool:
    return t.is_meta or (hasattr(t, "_local_tensor") and t._local_tensor.is_meta)


def _has_meta_tensors(model: nn.Module) -> bool:
    return has_meta_params(model) or any(_is_meta(b) for b in model.buffers())


def _group_and_device(mesh) -> tuple[Any, torch.device]:
    """The process group (None: the default one) and the device collectives run on."""
    if mesh is None:
        if dist.get_backend() == "nccl":
            return None, accel.current_device()
        return None, torch.device("cpu")
    if mesh.ndim != 1:
        raise ValueError(f"hf_zero fills shards on a 1-D mesh, got a {mesh.ndim}-D one")
    if mesh.device_type == "cpu":
        device = torch.device("cpu")
    else:
        module = getattr(torch, mesh.device_type)
        device = torch.device(mesh.device_type, module.current_device())
    if mesh.mesh.flatten().tolist() == list(range(dist.get_world_size())):
        # The same ranks in the same order: use the default group. (A gloo group that
        # init_device_mesh created and that ran collectives often aborts the process at exit,
        # "terminate called without an active exception", even after destroy_process_group().)
        return None, device
    return mesh.get_group(), device


def _group_rank(group) -> int:
    return dist.get_rank(group)


def _group_size(group) -> int:
    return dist.get_world_size(group)


def _flags(model: nn.Module, group, device: torch.device) -> tuple[bool, bool]:
    """(some rank has meta tensors, the source rank has meta tensors), agreed by all ranks."""
    mine = _has_meta_tensors(model)
    flags = torch.tensor([int(mine), int(mine and _group_rank(group) == _SOURCE)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return bool(flags[0]), bool(flags[1])


def capture_full_state(model: nn.Module, mesh=None, *, sync_all: bool = True) -> dict[str, torch.Tensor] | None:
    """Collective; call before ``fully_shard``. On the source rank (rank 0 of the mesh) returns
    ``{name: tensor}`` aliasing its full parameters (no copy), ``{}`` on the other ranks; None in a
    single process, and None when ``sync_all`` is False and no rank has meta tensors (then
    :func:`fill_sharded_from_rank0` does nothing).

    Args:
        sync_all: True (the engine's choice): every rank's shards come from rank 0 even when all
            ranks hold real weights, so ranks that built different weights (a LoRA made before
            the Trainer seeds, per-process random seeds) start from one point, as DDP and
            DeepSpeed do. False: fill only ranks that hold meta tensors.

    Raises:
        RuntimeError: the source rank itself has meta tensors (nothing to fill the others from).
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        if _has_meta_tensors(model):
            raise RuntimeError(
                "the model has parameters on the meta device and there is no other rank to load them from"
            )
        return None
    group, device = _group_and_device(mesh)
    any_meta, source_meta = _flags(model, group, device)
    if source_meta:
        raise RuntimeError(
            "rank 0 holds parameters on the meta device, so there are no weights to shard from: load the "
            "model with from_pretrained (inside hf_zero.engine.materialize.low_memory_loading() at most), "
            "not on the meta device"
        )
    if not any_meta and not sync_all:
        return None
    if _group_rank(group) != _SOURCE:
        return {}
    return {name: p.detach() for name, p in model.named_parameters()}


def _release_parameters(model: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Replace every parameter by a meta tensor of its shape and dtype, keeping ties and the
    parameter's attributes; returns ``(module, name, original)`` for :func:`_restore_parameters`.
    New Parameter objects are fine here: ``fully_shard`` replaces them with DTensor parameters
    right after anyway. Subclasses (quantized weights) are left alone; :func:`_allocate_meta` and
    the fill treat a partly meta model as before."""
    originals: list[tuple[nn.Module, str, nn.Parameter]] = []
    replacement: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is None or type(param) is not nn.Parameter or param.is_meta:
                continue
            new = replacement.get(id(param))
            if new is None:
                new = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
                new.__dict__.update(param.__dict__)
                replacement[id(param)] = new
            originals.append((module, key, param))
            module._parameters[key] = new
    return originals


def _restore_parameters(originals: list[tuple[nn.Module, str, nn.Parameter]]) -> None:
    for module, key, param in originals:
        module._parameters[key] = param


def fill_sharded_from_rank0(
    model: nn.Module,
    full_state: dict[str, torch.Tensor] | None,
    mesh=None,
    *,
    param_device: torch.device | str | None = None,
    method: str = "scatter",
) -> None:
    """Collective; call after ``fully_shard`` with what :func:`capture_full_state` returned. Ranks
    with meta tensors allocate them; every rank then receives its shard of each parameter from
    the source rank, one parameter at a time, and every buffer whole. The source's entries are
    dropped from ``full_state`` as they are sent, so its full copy is freed progressively.

    Args:
        param_device: where to allocate the shards of meta parameters; by default the mesh's
            device, or the CPU for FSDP units with ``CPUOffloadPolicy``.
        method: ``"scatter"`` (each rank receives only its shard) or ``"broadcast"`` (each rank
            receives the full tensor and keeps its slice; more traffic and memory, any placement).
    """
    if full_state is None:
        return
    if method not in ("scatter", "broadcast"):
        raise ValueError(f"method must be 'scatter' or 'broadcast', got {method!r}")
    group, device = _group_and_device(mesh)
    rank = _group_rank(group)
    is_source = rank == _SOURCE
    params = list(model.named_parameters())
    buffers = list(model.named_buffers())
    _check_same_structure(params, buffers, group, device)
    if is_source:
        missing = [name for name, _ in params if name not in full_state]
        if missing:
            raise RuntimeError(f"no captured full tensor for parameters {missing[:5]} (captured before fully_shard?)")
    _allocate_meta(model, device, param_device)
    params = list(model.named_parameters())  # to_empty may swap tensors
    buffers = list(model.named_buffers())
    with torch.no_grad():
        for name, param in params:
            full = full_state.pop(name) if is_source else None
            _fill_param(param, full, group, device, method)
            del full
        for _, buf in buffers:
            _broadcast_into(buf, group, device)
    full_state.clear()


@contextlib.contextmanager
def sharded_from_rank0(
    model: nn.Module, mesh=None, *, sync_all: bool = True, release_parameters: bool = False, **fill_kwargs: Any
) -> Iterator[None]:
    """Wrap the ``fully_shard`` calls: captures rank 0's full parameters on entry and fills every
    rank's shards on exit (see the module docstring). With ``sync_all=False``, a no-op beyond one
    tiny all-reduce when no rank holds meta tensors. With ``release_parameters``, every rank's
    parameters are meta tensors inside the block, so a dtype change there allocates nothing; if
    the block raises, rank 0's parameters are put back.

    Example (what ``FullyShardedStage.wrap`` does)::

        with sharded_from_rank0(model, mesh):
            for block in blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
    """
    full_state = capture_full_state(model, mesh, sync_all=sync_all)
    # release_parameters: every rank's parameters go to the meta device (rank 0's weights live on
    # in full_state, which the fill empties tensor by tensor), so that a dtype change made inside
    # the block (the fp32 master cast) allocates nothing. Rank 0 keeps its originals until the
    # block has run (they alias full_state: no extra memory), to give the model back if it fails;
    # on the other ranks they would be replaced by rank 0's weights anyway, and are dropped.
    keep: list[tuple[nn.Module, str, nn.Parameter]] = []
    if release_parameters and full_state is not None:
        originals = _release_parameters(model)
        keep = originals if full_state else []
        del originals
    try:
        yield
    except BaseException:
        _restore_parameters(keep)  # rank 0's model as it was (the other ranks' are on the meta device)
        if full_state is not None:
            full_state.clear()
        raise
    keep.clear()  # the fill frees rank 0's tensors one by one: nothing else may hold them
    fill_sharded_from_rank0(model, full_state, mesh, **fill_kwargs)


def _check_same_structure(params, buffers, group, device) -> None:
    """Every rank must list the same parameters and buffers in the same order (the fill sends
    one collective per tensor); a mismatch is an error rather than a hang or wrong weights."""
    desc = "|".join(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in [*params, *buffers])
    digest = zlib.crc32(desc.encode())
    t = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if int(t[0]) != digest or int(t[1]) != -digest:
        raise RuntimeError(
            "ranks hold differently structured models (parameter/buffer names, shapes or dtypes differ), so "
            "rank 0's weights cannot be sharded onto them: build the model the same way on every rank"
        )


def _offloaded_params(model: nn.Module) -> set[int]:
    """ids of parameters in FSDP units with a CPU offload policy (their shards live on the CPU)."""
    from hf_zero.distributed.fsdp_internals import param_groups

    ids: set[int] = set()
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    except ImportError:  # pragma: no cover
        return ids
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        try:
            groups = param_groups(module)
        except Exception:  # noqa: BLE001 - torch-private; without it the caller passes param_device
            continue
        for group in groups:
            if isinstance(group.offload_policy, CPUOffloadPolicy):
                ids.update(id(fp.sharded_param) for fp in group.fsdp_params)
    return ids


def _allocate_meta(model: nn.Module, device: torch.device, param_device) -> None:
    """Give meta parameters and buffers storage (uninitialised; filled next). Buffers that hold
    data keep it: on the source rank they are what the fill broadcasts."""
    if not _has_meta_tensors(model):
        return
    kept = [(m, k, b) for m in model.modules() for k, b in m._buffers.items() if b is not None and not b.is_meta]
    _allocate(model, device, param_device)  # to_empty: every tensor gets new, uninitialised storage
    for module, key, buf in kept:
        module._buffers[key] = buf.to(module._buffers[key].device)


def _allocate(model: nn.Module, device: torch.device, param_device) -> None:
    offloaded = _offloaded_params(model)
    target = torch.device(param_device) if param_device is not None else device
    if offloaded and param_device is None:
        # CPU-offloaded FSDP units keep their shards on the CPU, their buffers on the device.
        model.to_empty(device="cpu")
        for module in model.modules():
            for key, buf in list(module._buffers.items()):
                if buf is not None and buf.device != device:
                    module._buffers[key] = buf.to(device)
        for name, p in model.named_parameters():
            if id(p) not in offloaded and p.device != device:
                raise RuntimeError(f"{name}: mixed CPU-offloaded and on-device FSDP units; pass param_device")
        return
    model.to_empty(device=target)
    for module in model.modules():
        for key, buf in list(module._buffers.items()):
            if buf is not None and buf.device != device:
                module._buffers[key] = buf.to(device)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


def _fill_param(param: torch.Tensor, full: torch.Tensor | None, group, device, method: str) -> None:
    placements = getattr(param, "placements", None)
    local = _local(param)
    if placements is None or all(p.is_replicate() for p in placements):
        _broadcast_into(local, group, device, src_tensor=full)
        return
    if len(placements) != 1 or not placements[0].is_shard():
        raise NotImplementedError(f"filling a DTensor with placements {placements} from rank 0")
    dim = placements[0].dim
    if method == "broadcast":
        _broadcast_and_slice(param, local, full, group, device)
        return
    world = _group_size(group)
    shape = list(param.shape)
    shape[dim] = -(-shape[dim] // world)  # every rank's chunk, padded to the first one's size
    direct = list(local.shape) == shape and local.is_contiguous() and local.device == device
    out = local if direct else torch.empty(shape, dtype=local.dtype, device=device)
    chunks = None
    if full is not None:
        src = full.to(device=device, dtype=local.dtype)
        pieces = torch.chunk(src, world, dim=dim) if src.shape[dim] else ()
        chunks = []
        for r in range(world):
            piece = pieces[r] if r < len(pieces) else None
            if piece is not None and list(piece.shape) == shape and piece.is_contiguous():
                chunks.append(piece)  # a view of the full tensor: no copy
                continue
            padded = torch.zeros(shape, dtype=local.dtype, device=device)
            if piece is not None:
                padded.narrow(dim, 0, piece.shape[dim]).copy_(piece)
            chunks.append(padded)
        del src, pieces
    dist.scatter(out, chunks, group=group, group_src=_SOURCE)
    del chunks
    if not direct:
        local.copy_(out.narrow(dim, 0, local.shape[dim]))


def _broadcast_and_slice(param, local, full, group, device) -> None:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    buf = full.to(device=device, dtype=local.dtype) if full is not None else torch.empty(
        param.shape, dtype=local.dtype, device=device
    )
    dist.broadcast(buf, group=group, group_src=_SOURCE)
    local_shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    index = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
    local.copy_(buf[index])


def _broadcast_into(target: torch.Tensor, group, device, src_tensor: torch.Tensor | None = None) -> None:
    """Broadcast the source rank's tensor (``src_tensor`` there, else ``target`` itself) into
    ``target`` on every rank."""
    is_source = _group_rank(group) == _SOURCE
    source = src_tensor if (is_source and src_tensor is not None) else target
    if target.device == device and target.is_contiguous() and (source is target):
        dist.broadcast(target, group=group, group_src=_SOURCE)
        return
    buf = source.to(device=device, dtype=target.dtype).contiguous() if is_source else torch.empty(
        target.shape, dtype=target.dtype, device=device
    )
    dist.broadcast(buf, group=group, group_src=_SOURCE)
    target.copy_(buf)
