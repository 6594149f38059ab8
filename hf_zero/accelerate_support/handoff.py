"""``Accelerator.prepare`` hands the model and optimizer to hf_zero's engine; the loop runs unchanged.

accelerate has no extension point for a third-party sharding engine (its DeepSpeed and FSDP paths
are branches inside ``Accelerator``), so :func:`install` patches five ``Accelerator`` methods, each
falling through to accelerate's own code for anything the hand-off does not own:

- ``prepare``: a model (with its optimizer and scheduler) goes to :func:`hf_zero.initialize`;
  dataloaders and everything else go through accelerate's ``prepare`` as always. ``"auto"`` values
  are filled the way accelerate fills a DeepSpeed config (``_prepare_deepspeed``).
- ``backward``: ``loss / gradient_accumulation_steps`` (accelerate's rule) through the engine's
  backward (fp16 loss scaling).
- ``clip_grad_norm_``: the engine's global norm over the shards (unscaled), clipped.
- ``unwrap_model``: the user's model inside the prepared one.
- ``get_state_dict``: the full state dict gathered onto the main process (16-bit when training in
  bf16/fp16), what ``save_pretrained(state_dict=...)`` writes.

``save_state``/``load_state`` need no patch: the engine's sharded checkpoint is written and read
by hooks registered with accelerate's own ``register_save_state_pre_hook`` and
``register_load_state_pre_hook``; schedulers, samplers, RNG and registered objects are accelerate's.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_zero.accelerate_support.views import EngineModel, EngineOptimizerView, EngineSchedulerView

__all__ = ["HandOff", "active_settings", "install", "installed"]

ENGINE_DIR = "hf_zero_engine"
"""Sub-directory of a ``save_state`` directory that holds the engine's sharded checkpoint."""


@dataclass
class HandOff:
    """One accelerator's engine and what ``prepare`` returned for it."""

    engine: Any
    model: EngineModel
    optimizer: EngineOptimizerView | None
    kind: str


_SETTINGS: Any = None  # AccelerateSettings of this process (None: not installed)
_ORIGINAL: dict[str, Any] = {}


def installed() -> bool:
    """Whether the hand-off is installed in this process."""
    return bool(_ORIGINAL)


def active_settings() -> Any:
    """The :class:`~hf_zero.config.sources.accelerate_yaml.AccelerateSettings` the hand-off uses."""
    return _SETTINGS


def install(settings: Any) -> None:
    """Patch ``accelerate.Accelerator`` so that ``prepare`` hands models to hf_zero (idempotent;
    a second call replaces the settings). Also sets the process's wrap policy."""
    global _SETTINGS
    from accelerate import Accelerator

    from hf_zero.engine.wrap_policy import use_wrap_policy

    _SETTINGS = settings
    use_wrap_policy(settings.wrap)
    if _ORIGINAL:
        return
    for name, patched in (("prepare", _prepare), ("backward", _backward), ("clip_grad_norm_", _clip_grad_norm),
                          ("unwrap_model", _unwrap_model), ("get_state_dict", _get_state_dict)):
        original = getattr(Accelerator, name)
        _ORIGINAL[name] = original
        setattr(Accelerator, name, functools.wraps(original)(patched))


def _handoff(accelerator: Any) -> HandOff | None:
    return accelerator.__dict__.get("_hf_zero_handoff")


def _called_from_transformers() -> bool:
    """transformers' Trainer owns its Accelerator (ZeroTrainer has its own engine hooks)."""
    frame = sys._getframe(2)
    return str(frame.f_globals.get("__name__", "")).startswith("transformers.")


# ------------------------------------------------------------------------------------------- prepare
def _prepare(self, *args: Any, device_placement: Any = None):
    original = _ORIGINAL["prepare"]
    models = [a for a in args if isinstance(a, nn.Module) and not isinstance(a, EngineModel)]
    if not models or _SETTINGS is None or _SETTINGS.zero_config is None or _called_from_transformers():
        return original(self, *args, device_placement=device_placement)
    if len(models) > 1 or _handoff(self) is not None:
        raise ValueError("hf_zero's Accelerator hand-off trains one model per Accelerator; prepare the other "
                         "models (frozen reference models) before the trained one with a plain Accelerator, or "
                         "give each its own run")
    optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer) or _is_dummy(a, "DummyOptim")]
    schedulers = [a for a in args if _is_scheduler(a)]
    if len(optimizers) > 1 or len(schedulers) > 1:
        raise ValueError("hf_zero's Accelerator hand-off takes one optimizer and one scheduler with the model")
    engine_parts = {id(models[0])} | {id(o) for o in optimizers} | {id(s) for s in schedulers}
    others = [a for a in args if id(a) not in engine_parts]
    prepared_others = original(self, *others, device_placement=device_placement) if others else ()
    if len(others) == 1:
        prepared_others = (prepared_others,)
    prepared = dict(zip(map(id, others), prepared_others))

    model, optimizer, scheduler = models[0], (optimizers or [None])[0], (schedulers or [None])[0]
    handoff, optimizer_view, scheduler_out = _build(self, model, optimizer, scheduler, others)
    prepared[id(model)] = handoff.model
    if optimizer is not None:
        prepared[id(optimizer)] = optimizer_view
    if scheduler is not None:
        prepared[id(scheduler)] = scheduler_out
    result = tuple(prepared[id(a)] for a in args)
    return result if len(result) > 1 else result[0]


def _is_dummy(obj: Any, name: str) -> bool:
    return type(obj).__name__ == name and type(obj).__module__.startswith("accelerate.")


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or _is_dummy(obj, "DummyScheduler") or \
        type(obj).__name__ == "ReduceLROnPlateau"


def _build(accelerator: Any, model: nn.Module, optimizer: Any, scheduler: Any, others: list[Any]):
    """Fill the config's "auto" values, build the engine, and make the views."""
    from hf_zero.engine.engine import _rebind_scheduler
    from hf_zero.engine.initialize import initialize

    settings = _SETTINGS
    config = fill_auto(copy.deepcopy(settings.zero_config), accelerator, model, optimizer, scheduler, others)
    if settings.activation_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
        # FSDP's activation checkpointing of each wrapped block = transformers' gradient checkpointing.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    user_optimizer = None if optimizer is None or _is_dummy(optimizer, "DummyOptim") else optimizer
    config_scheduler = "scheduler" in config
    if config_scheduler and scheduler is not None and not _is_dummy(scheduler, "DummyScheduler"):
        raise ValueError(f"{settings.source}: the DeepSpeed config has a scheduler section and the script prepared a "
                         "scheduler too (accelerate refuses this too); drop one, or prepare accelerate.utils.DummyScheduler")
    engine = initialize(model, config, optimizer=user_optimizer, lr_scheduler=None)
    if engine.config.stage >= 2 and hasattr(model, "generate"):
        _shard_aware_generate(model)
    handoff = HandOff(engine=engine, model=EngineModel(engine, accelerator), optimizer=None, kind=settings.distributed_type)
    optimizer_view = EngineOptimizerView(engine, accelerator) if engine.optimizer is not None else None
    handoff.optimizer = optimizer_view
    accelerator.__dict__["_hf_zero_handoff"] = handoff
    _register_checkpoint_hooks(accelerator, engine)

    scheduler_out = None
    if scheduler is not None:
        if config_scheduler or _is_dummy(scheduler, "DummyScheduler"):
            if not config_scheduler:
                callable_ = getattr(scheduler, "lr_scheduler_callable", None)
                if callable_ is None:
                    raise ValueError("DummyScheduler without a scheduler section in the config: pass "
                                     "lr_scheduler_callable= or add a scheduler section")
                real = callable_(engine.optimizer)
            else:
                real = None
            scheduler_out = EngineSchedulerView(engine) if real is None else _accelerated_scheduler(
                accelerator, real, optimizer_view)
        else:
            real = _rebind_scheduler(scheduler, engine.optimizer)
            _track_step_called(engine.optimizer)
            scheduler_out = _accelerated_scheduler(accelerator, real, optimizer_view)
    return handoff, optimizer_view, scheduler_out


def _track_step_called(optimizer: torch.optim.Optimizer) -> None:
    """What an ``LRScheduler`` does to the optimizer it is built on (``patch_track_step_called``):
    the script's scheduler now follows the engine's optimizer, whose ``step()`` must say it ran."""
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any):
        optimizer._opt_called = True
        return step(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True
    optimizer.step = wrapper


def _accelerated_scheduler(accelerator: Any, scheduler: Any, optimizer_view: Any):
    """accelerate's own ``AcceleratedScheduler`` (it steps once per real optimizer step, ``num_processes``
    times without ``split_batches``), registered so ``save_state`` saves it."""
    from accelerate.scheduler import AcceleratedScheduler

    wrapped = AcceleratedScheduler(scheduler, [optimizer_view], step_with_optimizer=accelerator.step_scheduler_with_optimizer,
                                   split_batches=accelerator.split_batches)
    accelerator._schedulers.append(wrapped)
    return wrapped


def _shard_aware_generate(model: nn.Module) -> None:
    """``generate`` on a stage 2/3 model: FSDP2 gathers the root's parameters around it (it is not a
    forward), and transformers keeps every rank decoding until all are done (``synced_gpus``)."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    if not getattr(model, "_hf_zero_generate", False):
        register_fsdp_forward_method(model, "generate")
        model._hf_zero_generate = True
    for module in model.modules():
        if hasattr(module, "generate"):
            module._is_fsdp_managed_module = True  # transformers' test for synced_gpus under FSDP2


def _register_checkpoint_hooks(accelerator: Any, engine: Any) -> None:
    def save(models: list, weights: list, output_dir: str) -> None:
        from hf_zero.checkpoint.sharded import save_checkpoint

        save_checkpoint(engine, os.path.join(output_dir, ENGINE_DIR))

    def load(models: list, input_dir: str) -> None:
        from hf_zero.checkpoint.sharded import load_checkpoint

        load_checkpoint(engine, os.path.join(input_dir, ENGINE_DIR))

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)


def fill_auto(config: dict, accelerator: Any, model: nn.Module, optimizer: Any, scheduler: Any,
              others: list[Any]) -> dict:
    """Fill a config's ``"auto"`` values as accelerate's ``_prepare_deepspeed`` does.

    micro batch = the dataloaders' batch size (the smallest, divided by the process count with
    ``split_batches``); accumulation = the Accelerator's (a number in the config wins and is given
    to the Accelerator); train batch = micro x accumulation x processes; clipping 1.0; 16-bit save
    false; fp16/bf16 = the Accelerator's mixed precision; optimizer/scheduler values from
    ``DummyOptim``/``DummyScheduler``. Hidden-size based values are left to hf_zero's own rule
    (the same formulas), which reads ``model.config``.
    """
    kwargs: dict[str, Any] = {"gradient_clipping": 1.0, "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
                              "fp16.enabled": accelerator.mixed_precision == "fp16",
                              "bf16.enabled": accelerator.mixed_precision == "bf16"}
    if config.get("gradient_accumulation_steps", "auto") == "auto":
        config["gradient_accumulation_steps"] = accelerator.gradient_accumulation_steps
    elif int(config["gradient_accumulation_steps"]) != accelerator.gradient_accumulation_steps:
        accelerator.gradient_accumulation_steps = int(config["gradient_accumulation_steps"])  # accelerate: config wins
    batch_sizes = [o.batch_size for o in others if isinstance(getattr(o, "batch_size", None), int)]
    if config.get("train_micro_batch_size_per_gpu") == "auto":
        if not batch_sizes:
            raise ValueError("train_micro_batch_size_per_gpu is \"auto\": prepare a dataloader with the model (as "
                             "accelerate requires), or write the number in the config")
        if accelerator.split_batches:
            batch_sizes = [b // accelerator.num_processes for b in batch_sizes]
        kwargs["train_micro_batch_size_per_gpu"] = min(batch_sizes)
    micro = kwargs.get("train_micro_batch_size_per_gpu", config.get("train_micro_batch_size_per_gpu"))
    if isinstance(micro, int):
        kwargs["train_batch_size"] = micro * int(config["gradient_accumulation_steps"]) * accelerator.num_processes
    if _is_dummy(optimizer, "DummyOptim"):
        kwargs["optimizer.params.lr"] = optimizer.lr
        kwargs["optimizer.params.weight_decay"] = optimizer.weight_decay
    if _is_dummy(scheduler, "DummyScheduler"):
        kwargs["scheduler.params.warmup_min_lr"] = 0
        kwargs["scheduler.params.warmup_max_lr"] = getattr(optimizer, "lr", None)
        kwargs["scheduler.params.warmup_num_steps"] = scheduler.warmup_num_steps
        if scheduler.total_num_steps is not None:
            kwargs["scheduler.params.total_num_steps"] = (scheduler.total_num_steps if accelerator.split_batches
                                                           else scheduler.total_num_steps // accelerator.num_processes)
    _fill(config, kwargs)
    return config


def _fill(config: dict, kwargs: Mapping[str, Any]) -> None:
    for dotted, value in kwargs.items():
        *parents, key = dotted.split(".")
        node: Any = config
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(key) == "auto" and value is not None:
            node[key] = value


# ------------------------------------------------------------------------------------------- loop
def _backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
    handoff = _handoff(self)
    if handoff is None:
        return _ORIGINAL["backward"](self, loss, **kwargs)
    handoff.engine.backward(loss / self.gradient_accumulation_steps, scale_wrt_gas=False)


def _clip_grad_norm(self, parameters: Any, max_norm: float, norm_type: float = 2):
    handoff = _handoff(self)
    if handoff is None:
        return _ORIGINAL["clip_grad_norm_"](self, parameters, max_norm, norm_type)
    return handoff.engine.clip_grad_norm(float(max_norm), float(norm_type))


def _unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
    if isinstance(model, EngineModel):
        return model.module
    return _ORIGINAL["unwrap_model"](self, model, keep_fp32_wrapper=keep_fp32_wrapper,
                                     keep_torch_compile=keep_torch_compile)


def _get_state_dict(self, model: Any, unwrap: bool = True):
    handoff = _handoff(self)
    target = model.module if isinstance(model, EngineModel) else model
    if handoff is None or target is not handoff.engine.module:
        return _ORIGINAL["get_state_dict"](self, model, unwrap)
    from hf_zero.checkpoint.export16 import gather_full_state_dict

    engine = handoff.engine
    zero = engine.config.zero_optimization
    if handoff.kind == "DEEPSPEED" and engine.config.stage == 3 and not zero.gather_16bit_weights_on_model_save:
        # accelerate refuses this case under DeepSpeed ZeRO-3 too.
        raise ValueError("get_state_dict at ZeRO-3 with stage3_gather_16bit_weights_on_model_save false: set it true "
                         "(--zero3_save_16bit_model true), or save_state() and run hf-zero consolidate on it")
    dtype = engine.precision.compute_dtype if engine.config.compute_dtype_name != "fp32" else None
    return gather_full_state_dict(engine, dtype=dtype)
