"""ZeroEngine: one object that trains a model under a ZeRO stage with DeepSpeed's step semantics.

It composes a stage (``engine/stages.py``), a precision policy, a loss scaler, the optimizer and the
scheduler, and counts micro-steps the way DeepSpeed's engine does, so a DeepSpeed training loop::

    for batch in loader:
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()

runs unchanged. ``backward`` divides the loss by the accumulation steps and multiplies it by the
loss scale; ``step`` is called every micro-step and only updates at accumulation boundaries.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hf_zero.config.schema import ZeroConfig
from hf_zero.distributed.collectives import all_reduce_flag, dtensor_total_norm, on_mesh_device
from hf_zero.distributed.env import DistEnv
from hf_zero.distributed.teardown import close_at_exit
from hf_zero.engine.optimizer_recipe import OptimizerRecipe
from hf_zero.engine.sharded_optimizer import explain_sharded_step
from hf_zero.engine.fsdp_knobs import StageKnobs
from hf_zero.engine.stages import Stage, local_tensor, make_stage
from hf_zero.optim.schedulers import steps_on_metrics
from hf_zero.precision.policy import PrecisionPolicy

__all__ = ["ZeroEngine"]

from hf_zero.utils.logging import get_logger

logger = get_logger()

OptimizerArg = torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None
SchedulerArg = Any  # an LRScheduler, a callable ``optimizer -> scheduler``, or None


class ZeroEngine:
    """Train ``model`` under ``config``; build it with :func:`hf_zero.initialize`.

    Attributes:
        module: the user's model (sharded in place at stages 2/3).
        optimizer: the optimizer the engine steps (a ``ZeroRedundancyOptimizer`` at stage 1).
        lr_scheduler: the scheduler stepped after each successful optimizer step, or None; one
            whose ``step()`` takes a metric (``ReduceLROnPlateau``) is the caller's to step.
        config: the resolved :class:`~hf_zero.config.schema.ZeroConfig`.
        global_steps: optimizer steps taken, overflow-skipped steps included (as DeepSpeed counts).
        skipped_steps: steps skipped because fp16 gradients overflowed.
    """

    def __init__(
        self,
        model: nn.Module,
        config: ZeroConfig,
        env: DistEnv,
        optimizer: OptimizerArg = None,
        lr_scheduler: SchedulerArg = None,
    ):
        from hf_zero.precision.loss_scaler import build_loss_scaler

        _check_supported(config)
        self.config = config
        self.env = env
        self.precision = PrecisionPolicy.from_config(config)
        self.gradient_accumulation_steps = int(config.gradient_accumulation_steps)
        self.gradient_clipping = float(config.gradient_clipping)

        recipe = _optimizer_recipe(config, optimizer, model)
        self.module = model
        # Offload (hf_zero/offload): None unless the config moves state off the accelerator.
        from hf_zero.offload import make_offload_manager

        self.offload = make_offload_manager(config, env, self.precision)
        try:
            self.stage: Stage = make_stage(config.zero_optimization, env, self.precision, offload=self.offload,
                                           knobs=StageKnobs.from_config(config, env.world_size))
            self._forward_module = self.stage.wrap(model)
            self.optimizer = self.stage.build_optimizer(recipe, model) if recipe else None
        except BaseException:
            if self.offload is not None:
                self.offload.close()
            raise
        self.lr_scheduler = _build_scheduler(config, lr_scheduler, self.optimizer)
        self.loss_scaler = build_loss_scaler(config.fp16, enabled=self.precision.compute_dtype == torch.float16)

        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self._boundary_override: bool | None = None
        self._overflow: bool | None = None
        self._window_grad_norm: float | None = None  # norm of the gradients being accumulated
        self._last_grad_norm: float | None = None  # norm of the last update, for logging
        self._last_step_skipped = False
        self._last_step_lrs: list[float] | None = None  # learning rates the last update used
        # The exit teardown closes the engine (joining offload threads) before ending the group.
        close_at_exit(self)
        self._report_start()

    # ----------------------------------------------------------------------------- training loop
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model's forward (with the stage's gradient-sync and precision settings)."""
        with self.forward_context():
            return self._forward_module(*args, **kwargs)

    @property
    def forward_module(self) -> nn.Module:
        """The module to call for training forwards (DDP-wrapped at stages 0/1, the sharded model at 2/3)."""
        return self._forward_module

    @contextlib.contextmanager
    def forward_context(self):
        """Context for a forward run outside :meth:`forward` (e.g. by the Trainer's ``compute_loss``):
        sets whether this micro-step's backward reduces gradients, and autocast at stages 0/1."""
        self.stage.set_gradient_sync(self.is_gradient_accumulation_boundary())
        with self.stage.forward_context():
            yield

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate ``loss / gradient_accumulation_steps * loss_scale``; return the scaled loss.

        Gradients of successive micro-steps accumulate until :meth:`step` reaches a boundary.
        ``scale_wrt_gas=False`` skips the division, for callers whose loss is already normalised
        over the accumulation window (the Trainer's, as with DeepSpeed).
        """
        scaled = loss.float()
        if scale_wrt_gas and self.gradient_accumulation_steps > 1:
            scaled = scaled / self.gradient_accumulation_steps
        if self.loss_scaler.loss_scale != 1.0:
            scaled = scaled * self.loss_scaler.loss_scale
        scaled.backward()
        return scaled

    def step(self) -> None:
        """Call after every :meth:`backward`; updates the weights at accumulation boundaries.

        At a boundary: unscale fp16 gradients and check them for inf/nan on every rank (an
        overflow skips the optimizer and scheduler and backs the loss scale off), clip to
        ``gradient_clipping``, step the optimizer and the scheduler, zero the gradients.
        """
        if self.is_gradient_accumulation_boundary():
            self.optimizer_step()
        self.micro_steps += 1
        self._boundary_override = None

    def zero_grad(self) -> None:
        """Drop all gradients (``step`` already does this after each update)."""
        self.module.zero_grad(set_to_none=True)
        if self._grad_owner() is not None:
            self.optimizer.zero_grad(set_to_none=True)  # host gradients of an offloaded optimizer
        self._overflow = None
        self._window_grad_norm = None

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the accumulated gradients to ``max_norm`` and return their global (all-rank) norm.

        fp16 gradients are unscaled first; an overflow returns ``inf`` and clips nothing.
        """
        self._check_gradients_complete()
        if self._unscale_and_check_overflow():
            return torch.tensor(float("inf"))
        norm = self._total_grad_norm(norm_type)
        if max_norm > 0:
            self._clip_grads(max_norm, norm)
        self._window_grad_norm = float(norm)
        return norm

    # ----------------------------------------------------------------------------- accumulation
    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the current micro-step ends an accumulation window."""
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Force the current micro-step to be (or not be) a boundary, e.g. at the end of an epoch
        whose length is not a multiple of the accumulation steps. Reset by :meth:`step`."""
        self._boundary_override = bool(is_boundary)

    # ----------------------------------------------------------------------------- reporting
    @property
    def loss_scale(self) -> float:
        """Current loss scale (1.0 unless fp16)."""
        return float(self.loss_scaler.loss_scale)

    def get_lr(self) -> list[float]:
        """Learning rate of each param group."""
        if self.optimizer is None:
            return []
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_last_step_lr(self) -> list[float]:
        """Learning rate of each param group as the last update used it (before the scheduler
        stepped; the current values until the first update)."""
        return list(self._last_step_lrs) if self._last_step_lrs is not None else self.get_lr()

    def get_global_grad_norm(self) -> float | None:
        """Global gradient norm of the last update (before clipping), ``inf`` on overflow."""
        return self._last_grad_norm

    @property
    def world_size(self) -> int:
        return self.env.world_size

    def memory_report(self) -> dict[str, dict[str, int]]:
        """Bytes this rank holds for params, grads and optimizer state, per tier.

        Tiers: ``accelerator`` (the device the engine computes on: a GPU, or the CPU when there is
        none), ``host`` (CPU memory while computing on a GPU) and ``nvme``.
        """
        report = {kind: {"accelerator": 0, "host": 0, "nvme": 0} for kind in ("params", "grads", "optimizer_state")}
        # Offload backends count what they hold themselves (host buffers, swap files): on a machine
        # without a GPU a tensor's device cannot tell the accelerator tier from the host tier.
        backends = self.offload.backends() if self.offload is not None else []
        claimed = self.offload.claimed_params() if self.offload is not None else set()

        def add(kind: str, t: torch.Tensor, host: bool = False) -> None:
            t = local_tensor(t)
            tier = "host" if host or t.device != self.env.device else "accelerator"
            report[kind][tier] += t.numel() * t.element_size()

        seen: set[int] = set()
        for p in self.module.parameters():
            if id(p) in seen or id(p) in claimed:
                continue
            seen.add(id(p))
            add("params", p)
            if p.grad is not None:
                add("grads", p.grad)
        if self.optimizer is not None:
            for p, state in self.stage.local_optimizer(self.optimizer).state.items():
                for v in state.values():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        add("optimizer_state", v, host=id(p) in claimed)
        for backend in backends:
            for kind, tiers in backend.memory_report().items():
                for tier, value in tiers.items():
                    report[kind][tier] += int(value)
        return report

    # ----------------------------------------------------------------------------- state
    def state_dict(self, *, saving: bool = False) -> dict[str, Any]:
        """Sharded state for ``torch.distributed.checkpoint``: model and optimizer as DTensors at
        stages 2/3 (keyed by parameter name, so they reshard on load), plus scheduler, loss scaler
        and counters. The model entries of trained parameters are their fp32 master weights.

        ``saving=True`` is the view to write: at stages 0/1 with an offloaded optimizer a
        trainable parameter's entry is then present only on the rank holding its master. Without
        it, the state is a template to load into (every entry on every rank)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state: dict[str, Any] = {"module": get_model_state_dict(self.module)}
        if self.optimizer is not None and self._grad_owner() is None:
            state["optimizer"] = get_optimizer_state_dict(self.module, self.stage.local_optimizer(self.optimizer))
        if self.offload is not None:
            # Offloaded optimizer state (same layout), fp32 masters in place of 16-bit model
            # entries, host copies of NVMe-swapped parameters.
            self.offload.checkpoint_state(state, saving=saving)
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        state["loss_scaler"] = self.loss_scaler.state_dict()
        state["counters"] = {
            "global_steps": self.global_steps,
            "micro_steps": self.micro_steps,
            "skipped_steps": self.skipped_steps,
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict` (after ``torch.distributed.checkpoint.load`` filled it)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        with self.params_resident(write_back=True):
            set_model_state_dict(self.module, state["module"])
        if self.optimizer is not None and "optimizer" in state:
            if self._grad_owner() is not None:
                self.offload.load_checkpoint_state(state)
            else:
                local = self.stage.local_optimizer(self.optimizer)
                set_optimizer_state_dict(self.module, local, state["optimizer"])
                if local is not self.optimizer:
                    # ZeroRedundancyOptimizer copies its global groups into the local one before
                    # each step, which would undo the restored learning rates.
                    self.optimizer._sync_param_groups(local.param_groups, self.optimizer.param_groups)
        if self.lr_scheduler is not None and "lr_scheduler" in state:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if "loss_scaler" in state:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        counters = state.get("counters", {})
        self.global_steps = int(counters.get("global_steps", self.global_steps))
        self.micro_steps = int(counters.get("micro_steps", self.micro_steps))
        self.skipped_steps = int(counters.get("skipped_steps", self.skipped_steps))

    def params_resident(self, write_back: bool = False) -> contextlib.AbstractContextManager:
        """Context in which every parameter shard is in memory: needed only with
        ``offload_param.device = "nvme"``, around code that reads parameter values outside the
        forward/backward (a 16-bit export, ``full_tensor()``); a no-op otherwise. With
        ``write_back`` the block may also change them (they are written to the swap files after)."""
        if self.offload is None:
            return contextlib.nullcontext()
        return self.offload.resident(write_back=write_back)

    def close(self) -> None:
        """Release offload threads, hooks and swap files (idempotent; also done at exit)."""
        if self.offload is not None:
            self.offload.close()

    def train(self, mode: bool = True) -> ZeroEngine:
        self.module.train(mode)
        return self

    def eval(self) -> ZeroEngine:
        return self.train(False)

    # ----------------------------------------------------------------------------- internals
    def _trainable_params(self) -> list[nn.Parameter]:
        seen: set[int] = set()
        params = []
        for p in self.module.parameters():
            if p.requires_grad and p.grad is not None and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        return params

    def _grad_owner(self) -> Any:
        """The offloaded optimizer when it holds the gradients (moved to the host in backward)."""
        if self.offload is not None and self.offload.owns_optimizer:
            return self.optimizer
        return None

    def _clip_grads(self, max_norm: float, norm: torch.Tensor) -> None:
        owner = self._grad_owner()
        if owner is not None:
            owner.clip_grads_with_norm_(max_norm, norm)
        else:
            torch.nn.utils.clip_grads_with_norm_(self._trainable_params(), max_norm, norm)

    def _unscale_and_check_overflow(self) -> bool:
        """Agree on overflow across ranks, then unscale fp16 gradients (once per update).

        The check reads the accumulated gradients still scaled, as DeepSpeed's fp16 accumulator
        would hold them: an inf/nan, or a value fp16 cannot hold, skips the step. hf_zero sums the
        micro-steps in fp32, so a value past fp16's range is finite here and has to be asked for
        (``held_in``). What remains different: DeepSpeed's running fp16 sum rounds at each
        micro-step and can overflow on the way to a final sum that fits (gradients of opposite
        signs), which an fp32 sum cannot.
        """
        if self._overflow is not None:
            return self._overflow
        from hf_zero.precision.loss_scaler import grads_have_inf_or_nan

        scale = self.loss_scaler.loss_scale
        held_in = self.precision.compute_dtype
        owner = self._grad_owner()
        if owner is not None:
            found = owner.grads_have_inf_or_nan(held_in=held_in) if self.loss_scaler.dynamic else False
        else:
            found = grads_have_inf_or_nan([p.grad for p in self._trainable_params()],
                                          held_in=held_in) if self.loss_scaler.dynamic else False
        self._overflow = all_reduce_flag(found, self.env.device) if self.loss_scaler.dynamic else False
        if scale != 1.0 and not self._overflow:  # an overflowed window is dropped, not unscaled
            if owner is not None:
                owner.unscale_grads_(1.0 / scale)
            else:
                grads = [local_tensor(p.grad) for p in self._trainable_params()]
                if grads:
                    torch._foreach_mul_(grads, 1.0 / scale)
        return self._overflow

    def _check_gradients_complete(self) -> None:
        check = getattr(self.stage, "check_gradients_complete", None)  # MiCS's deferred all-reduce
        if check is not None:
            check()

    def _total_grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        owner = self._grad_owner()
        if owner is not None:
            return owner.total_grad_norm(norm_type)
        grads = [p.grad for p in self._trainable_params()]
        if not grads:
            return torch.tensor(0.0)
        norm = dtensor_total_norm(grads, norm_type)  # FSDP2's shards: one collective
        if norm is not None:
            return norm.to(grads[0].device)
        norm = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, foreach=True)
        if hasattr(norm, "full_tensor"):
            # Sharded gradients give a partial norm per rank; full_tensor() reduces it over ranks
            # (on the accelerator, where offloaded parameters keep their gradients in host memory).
            norm = on_mesh_device(norm).full_tensor().to(grads[0].device)
        return norm

    @property
    def last_step_skipped(self) -> bool:
        """True when the last update was skipped because fp16 gradients overflowed."""
        return self._last_step_skipped

    def optimizer_step(self) -> None:
        """Update the weights from the accumulated gradients now (what :meth:`step` does at a
        boundary): overflow check, clipping, optimizer and scheduler step, zero the gradients.
        For callers that count accumulation themselves, like the Trainer's loop."""
        if self.optimizer is None:
            raise RuntimeError("this engine has no optimizer: pass optimizer= or add an optimizer section")
        self._last_step_lrs = self.get_lr()
        self._check_gradients_complete()
        overflow = self._unscale_and_check_overflow()
        self.loss_scaler.update_scale(overflow)
        if overflow:
            self.skipped_steps += 1
            if self.env.is_main:
                logger.info(
                    "fp16 gradients overflowed at step %d; skipping it, loss scale now %s",
                    self.global_steps,
                    self.loss_scaler.loss_scale,
                )
        else:
            if self._window_grad_norm is None:  # not clipped by the caller this window
                norm = self._total_grad_norm()
                if self.gradient_clipping > 0:
                    self._clip_grads(self.gradient_clipping, norm)
                self._window_grad_norm = float(norm)
            with explain_sharded_step(self.optimizer, self.config.stage):
                self.optimizer.step()
            if self.lr_scheduler is not None and not steps_on_metrics(self.lr_scheduler):
                self.lr_scheduler.step()  # a plateau scheduler is stepped with a metric by the caller
        self._last_grad_norm = float("inf") if overflow else self._window_grad_norm
        self._last_step_skipped = overflow
        self.global_steps += 1
        self.zero_grad()

    def _report_start(self) -> None:
        if not self.env.is_main:
            return
        logger.info(
            "ZeRO stage %d, %s, world size %d on %s (%s)",
            self.config.stage,
            self.config.compute_dtype_name,
            self.env.world_size,
            self.env.device,
            self.env.backend,
        )
        try:
            from hf_zero.config.parse import describe_no_effect
        except ImportError:  # pragma: no cover - config layer always ships it
            return
        # Settings the user wrote that change nothing here: said once, at start-up, on rank 0.
        lines = describe_no_effect(self.config)
        if lines:
            logger.warning("%d setting%s in %s change%s nothing in hf_zero:\n  %s", len(lines),
                           "s" if len(lines) > 1 else "", self.config.source, "" if len(lines) > 1 else "s",
                           "\n  ".join(lines))


def _check_supported(config: ZeroConfig) -> None:
    from hf_zero.offload import check_offload_config

    check_offload_config(config)


def _optimizer_recipe(config: ZeroConfig, optimizer: OptimizerArg, model: nn.Module) -> OptimizerRecipe | None:
    if config.optimizer is not None and optimizer is not None:
        raise ValueError(
            f"{config.source} has an optimizer section and an optimizer was passed too; keep one "
            "(remove the section to use yours, or pass optimizer=None)"
        )
    if config.optimizer is not None:
        return OptimizerRecipe.from_config(config.optimizer)
    if isinstance(optimizer, torch.optim.Optimizer):
        return OptimizerRecipe.from_instance(optimizer, model)
    if callable(optimizer):
        return OptimizerRecipe.from_callable(optimizer)
    return None


def _build_scheduler(config: ZeroConfig, lr_scheduler: SchedulerArg, optimizer: torch.optim.Optimizer | None):
    if config.scheduler is not None and lr_scheduler is not None:
        raise ValueError(
            f"{config.source} has a scheduler section and an lr_scheduler was passed too; keep one"
        )
    if optimizer is None:
        return None
    if config.scheduler is not None:
        from hf_zero.optim.schedulers import build_scheduler

        return build_scheduler(config.scheduler, optimizer)
    if lr_scheduler is None:
        return None
    if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
        return _rebind_scheduler(lr_scheduler, optimizer)
    if callable(lr_scheduler):
        return lr_scheduler(optimizer)
    raise TypeError(f"lr_scheduler must be an LRScheduler or a callable optimizer -> scheduler, got {type(lr_scheduler)}")


def _rebind_scheduler(scheduler: torch.optim.lr_scheduler.LRScheduler, optimizer: torch.optim.Optimizer):
    """Point a scheduler made for the caller's optimizer at the engine's rebuilt optimizer."""
    old_groups = scheduler.optimizer.param_groups
    if len(old_groups) != len(optimizer.param_groups):
        raise ValueError(
            "the lr_scheduler's optimizer has a different number of param groups than the engine's; "
            "pass a callable optimizer -> scheduler instead"
        )
    for old, new in zip(old_groups, optimizer.param_groups):
        for key in ("lr", "initial_lr"):
            if key in old:
                new[key] = old[key]
    scheduler.optimizer = optimizer
    return scheduler
