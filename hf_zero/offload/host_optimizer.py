"""``OffloadedOptimizer``: this rank's fp32 master weights and optimizer state off the accelerator.

ZeRO-Offload (``offload_optimizer.device = "cpu"``) and its NVMe variant (``"nvme"``) as torch
optimizers on host tensors, in pure Python:

* The accelerator keeps the parameters the model computes with (16-bit shards at stages 2/3; the
  fp32 replicated parameters at stage 1, whose forward runs under autocast, see
  ``engine/stages.py``). The fp32 master copy of the parameters this rank updates, and the
  optimizer's state, live in host memory (``cpu``) or in files under ``nvme_path`` (``nvme``).
* Gradients go to host fp32 buffers **as backward produces them**: at stages 2/3 a
  post-accumulate-grad hook on each sharded parameter runs right after FSDP2's reduce-scatter of
  its unit, so the copy of one unit overlaps the backward of the next; at stage 1 a DDP comm hook
  copies each all-reduced bucket. The device gradient is dropped right away, so no gradient shard
  stays on the accelerator. Accumulation over micro-steps happens in fp32 on the host.
* ``step()`` runs a torch optimizer (the one the config or the caller asked for, built by the
  engine's recipe: ``torch.optim.AdamW(fused=True)`` for ``AdamW``) over host tensors in chunks
  of at most ``sub_group_size`` elements, one inner optimizer per chunk. On a GPU a worker
  thread copies chunk *i*'s updated values into the device parameters (cast to their dtype, an
  asynchronous DMA from pinned memory) while chunk *i+1* is stepped. With NVMe, chunk *i+1* is read into a pool buffer while chunk *i* is stepped and
  chunk *i* is written back behind it (``nvme.py``); the first chunks are already read while the
  backward that precedes the step is running.

The object is a ``torch.optim.Optimizer`` whose ``param_groups`` hold the engine's (device)
parameters, so LR schedulers and the Trainer set the learning rate on it as on any optimizer; it
copies the hyper-parameters into its inner optimizers before each step.

Numerics: the gradients are the exact fp32 reduce-scatter outputs (FSDP2 casts them to the 16-bit
parameter dtype afterwards; the all-reduce hook keeps the fp32 buffer, see :class:`~hf_zero.offload.grad_feeds.FsdpGradFeed`),
the master weights start from the fp32 weights and the update is the same torch kernel, so an
offloaded run reproduces the losses and weights of a non-offloaded run of the same config.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hf_zero.distributed import device as accel
from hf_zero.offload.base import (
    OffloadError,
    TierReport,
    agree_on_error,
    alloc_host,
    empty_report,
    nbytes,
)
from hf_zero.offload.host_layout import (
    _FUSED_CPU_CLASSES,
    _IMPL_KEYS,
    _SETTING,
    _SPLIT_ALIGN,
    HostOffloadConfig,
    ParamPlan,
    _Chunk,
    _elementwise_classes,
    _InlineExecutor,
    _local,
    _Piece,
    _probe_state,
    _Slot,
    _wait_futures,
)
from hf_zero.offload.nvme_chunks import _NvmeChunks
from hf_zero.offload.optimizer_checkpoint import _OptimizerCheckpoint
from hf_zero.offload.owner_broadcast import _OwnerBroadcast
from hf_zero.offload.grad_accumulation import StagedAccumulation
from hf_zero.offload.grad_norm import sharded_total_norm
from hf_zero.offload.pinned import HostArena, planned_pinned_bytes, pinning_fits
from hf_zero.offload.step_threads import step_threads_for_this_rank

__all__ = ["OffloadedOptimizer"]

COPY_BACK_BLOCK = 1 << 25
"""Elements per host->accelerator copy of updated fp32 masters into 16-bit parameters. The copy
converts on the accelerator through an fp32 temporary as large as the copy: whole parameters made
it 0.87 GiB for a 1.5B model's embedding (the step's peak rose from 2.94 to 3.81 GiB on an H100)
and 2 GiB for a 7B one's. Blocks bound it to 128 MiB."""


class OffloadedOptimizer(_NvmeChunks, _OptimizerCheckpoint, _OwnerBroadcast, torch.optim.Optimizer):
    """A torch optimizer that steps fp32 master weights held in host memory or NVMe files.

    Build it through :class:`hf_zero.offload.manager.OffloadManager` (the engine does); the
    arguments mirror what the stage knows.

    Args:
        probe: the optimizer the recipe builds over the device parameters (never stepped): its
            class and param groups (hyper-parameters) are the ones the host optimizers use.
        build: the recipe's ``build(param_groups) -> optimizer``.
        names: ``id(param) -> FQN`` for state dicts.
        cfg: offload settings.
        plan: which parameters are stepped on the host / the device by this rank.
        comm_device: device for the small collectives (the accelerator with NCCL, CPU with gloo).
        param_writer: writes updated values into a parameter shard whose storage another
            backend manages (``offload_param`` NVMe); None writes into the parameter directly.
        swap_dir: makes this rank's swap folder (``nvme`` only; shared with parameter swapping).
        norm_group: stages 2/3, the process group the gradient norm is reduced over: the shard
            group of a replicate x shard mesh (``mics_shard_size``), None on a flat mesh (all
            ranks). ``rank``/``world_size`` stay the global ones (swap folders, stage 1).
        copy_back_thread: copy updated values to the device on a worker thread, overlapping the
            next chunk's step. None (default): when the parameters are on a GPU, where the copy
            is a DMA transfer; when the "device" is the CPU itself, the copy and the step are both
            memory-bound work on the same cores (and a second thread starts a second OpenMP
            team), so the copy runs inline.

    Raises:
        OffloadError: host memory cannot be (pinned and) allocated, or the NVMe folder cannot be
            used; raised on every rank.
    """

    def __init__(
        self,
        probe: torch.optim.Optimizer,
        build: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
        names: dict[int, str],
        cfg: HostOffloadConfig,
        plan: ParamPlan,
        *,
        rank: int = 0,
        world_size: int = 1,
        comm_device: torch.device | None = None,
        param_writer: Callable[[nn.Parameter, int, torch.Tensor], None] | None = None,
        swap_dir: Callable[[], Any] | None = None,
        copy_back_thread: bool | None = None,
        norm_group: dist.ProcessGroup | None = None,
    ):
        groups = [dict(g) for g in probe.param_groups]
        super().__init__(groups, dict(probe.defaults))
        self.cfg = cfg
        self._build = build
        self._inner_cls = type(probe)
        self._names = names
        self._rank = rank
        self._world = world_size
        self._comm_device = comm_device or torch.device("cpu")
        self._norm_group = norm_group
        self._owner = plan.owner
        self._param_writer = param_writer
        self._swap_dir_factory = swap_dir
        self.pre_step_checks: list[Callable[[], None]] = []
        """Called at the start of :meth:`step`, inside its error agreement (parameter swap faults)."""
        self.post_step_actions: list[Callable[[], None]] = []
        """Called after the host step, inside the agreement (starts parameter write-behind)."""
        self._nvme = cfg.device == "nvme"
        self._pin = bool(cfg.pin_memory)
        self._closed = False
        self._space = None
        self._pool = None
        self._prefetched: dict[int, tuple[torch.Tensor, Any]] = {}
        # Device->host gradient copies in flight (F2: every read of host gradients waits first).
        self._grad_copies = accel.PendingCopies()
        if copy_back_thread is None:
            copy_back_thread = any(accel.is_accelerator(p) for p in plan.host)
        self._copier: Any = (
            cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_zero-copyback",
                                  initializer=accel.thread_initializer())  # on the rank's device (N4)
            if copy_back_thread else _InlineExecutor()
        )
        self._feeds: list[Any] = []
        self._device_opt: torch.optim.Optimizer | None = None
        self._device_group_ids: list[int] = []
        self.slots: list[_Slot] = []
        self.chunks: list[_Chunk] = []
        self._slot_of: dict[int, _Slot] = {}
        self.host_steps = 0
        self._arenas: list[HostArena] = []  # gradient and master buffers (pinned when configured)
        self.pinned = False
        self._staged: StagedAccumulation | None = None  # micro-steps after the first (set up in _setup)
        self._threads = step_threads_for_this_rank()  # torchrun's 1 thread per rank: the step takes its share
        if rank == 0:
            self._threads.announce()

        error: BaseException | None = None
        try:
            self._setup(plan)
        except BaseException as exc:  # noqa: BLE001 -- every rank must reach the agreement below
            error = exc
        try:
            agree_on_error(error, "setting up the offloaded optimizer")
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------ setup
    def _setup(self, plan: ParamPlan) -> None:
        host_ids = {id(p) for p in plan.host}
        device_ids = {id(p) for p in plan.device}
        self._state_keys, self._state_other = _probe_state(self._build, self._host_hyper(0), self._inner_cls)
        splittable = issubclass(self._inner_cls, _elementwise_classes())

        setting = f"{_SETTING}.pin_memory"
        owned = [(gi, p, _local(p)) for gi, group in enumerate(self.param_groups)
                 for p in group["params"] if id(p) in host_ids]
        # One arena per kind instead of one pinned buffer per parameter (review F9): the host
        # caching allocator rounds each allocation to a power of two and never gives it back.
        numels = [local.numel() for _, _, local in owned]
        pin = self._pin and accel.pin_available()
        if pin:
            planned = planned_pinned_bytes([4 * n for n in numels]) * (1 if self._nvme else 2)
            pin = pinning_fits(planned, setting)
        self.pinned = pin
        grads = HostArena(numels, torch.float32, pin=pin, setting=setting)
        masters = None if self._nvme else HostArena(numels, torch.float32, pin=pin, setting=setting)
        self._arenas = [a for a in (grads, masters) if a is not None]
        self._staged = StagedAccumulation(max(numels, default=0), pin=pin, setting=setting,
                                          before_add=self._grad_copies.wait)
        for i, (gi, p, local) in enumerate(owned):
            slot = _Slot(
                name=self._names.get(id(p), f"param{len(self.slots)}"),
                param=p,
                group=gi,
                local_shape=local.shape,
                numel=local.numel(),
                like=p,
                grad=grads.views[i],
            )
            master = plan.masters.get(id(p))
            if master is None:
                master = local.detach()
            master = master.reshape(-1)
            if master.numel() != slot.numel:
                raise OffloadError(
                    f"{slot.name}: captured master has {master.numel()} elements, the shard {slot.numel}"
                )
            if masters is None:
                slot.master = master.to("cpu", torch.float32)  # written to NVMe below, then dropped
            else:
                slot.master = masters.views[i]
                slot.master.copy_(master)
            self.slots.append(slot)
            self._slot_of[id(p)] = slot
        self._plan_chunks(splittable)

        device_groups = []
        for gi, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if id(p) in device_ids]
            if params:
                device_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
                self._device_group_ids.append(gi)
        if device_groups:
            self._device_opt = self._build(device_groups)
        if self._nvme:
            self._setup_nvme()

    def _host_hyper(self, gi: int) -> dict[str, Any]:
        """Group hyper-parameters for a host optimizer. torch's Adam/AdamW/SGD/Adagrad are told to
        use their fused CPU kernel: an optimizer rebuilt from the caller's instance (the Trainer's
        ``AdamW`` with ``fused=None``) would otherwise take the per-tensor loop on CPU, several
        times slower (bench/README.md)."""
        hyper = {k: v for k, v in self.param_groups[gi].items() if k not in _IMPL_KEYS}
        if self._inner_cls in _FUSED_CPU_CLASSES:
            hyper.update(fused=True, foreach=False)
        return hyper

    def _plan_chunks(self, splittable: bool) -> None:
        """Cut the slots into chunks of at most ``sub_group_size`` elements.

        Element-wise optimizers (Adam, AdamW, SGD, Lion) may split a parameter between chunks
        (at multiples of 256 elements), which keeps every chunk -- and so every NVMe buffer --
        within ``sub_group_size``. Others
        (LAMB's trust ratio needs the whole tensor) keep each parameter whole, as DeepSpeed's
        sub-groups do; a parameter larger than ``sub_group_size`` then forms a chunk of its own.
        """
        limit = max(1, int(self.cfg.sub_group_size))
        if limit < _SPLIT_ALIGN:
            splittable = False
        chunks: list[list[tuple[_Slot, int, int]]] = [[]]
        fill = 0
        for slot in self.slots:
            if slot.numel == 0:
                chunks[-1].append((slot, 0, 0))
                continue
            if splittable:
                start = 0
                while start < slot.numel:
                    room = limit - fill
                    rest = slot.numel - start
                    # Cut only at multiples of _SPLIT_ALIGN elements, so every element sits at the
                    # same position in the fused kernel's vector loop as in an unsplit step.
                    take = rest if rest <= room else room // _SPLIT_ALIGN * _SPLIT_ALIGN
                    if take == 0:
                        chunks.append([])
                        fill = 0
                        continue
                    chunks[-1].append((slot, start, start + take))
                    start += take
                    fill += take
            else:
                if fill and fill + slot.numel > limit:
                    chunks.append([])
                    fill = 0
                chunks[-1].append((slot, 0, slot.numel))
                fill += slot.numel
        for index, parts in enumerate(c for c in chunks if c):
            pieces = []
            offset = 0
            for slot, start, end in parts:
                tensor = slot.master[start:end] if not self._nvme else torch.empty(0)
                piece = _Piece(slot=slot, start=start, end=end, tensor=tensor, offset=offset)
                offset += end - start
                slot.pieces.append(piece)
                pieces.append(piece)
            groups = sorted({p.slot.group for p in pieces})
            inner_groups = [
                {**self._host_hyper(g), "params": [p.tensor for p in pieces if p.slot.group == g]} for g in groups
            ]
            inner = self._build(inner_groups)
            self.chunks.append(_Chunk(index=index, pieces=pieces, groups=groups, optimizer=inner, numel=offset))
    # ------------------------------------------------------------------------------------ grads
    def accumulate_grad(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """Add ``grad`` (this rank's fp32 shard, any device) to the parameter's host gradient."""
        slot = self._slot_of[id(param)]
        flat = grad.reshape(-1)
        if slot.fresh:
            self._grad_copies.copy(slot.grad, flat)
            slot.fresh = False
        elif accel.is_accelerator(flat) and self._staged is not None and self._staged.usable():
            # 2nd micro-step on: a copy to a pinned staging block, added on a worker once landed
            # (grad_accumulation.py), so the backward does not wait for it (review F11).
            self._staged.add(slot.grad, flat)
        else:
            # Host-resident gradient, or pageable host memory (the copy is synchronous anyway).
            self._grad_copies.wait()
            slot.grad.add_(flat.to("cpu", torch.float32))
        if self._nvme and not self._prefetched:
            self.prefetch()

    def managed_params(self) -> list[nn.Parameter]:
        return [s.param for s in self.slots]

    def _wait_for_grads(self) -> None:
        """Every device->host gradient copy and staged add issued so far has landed."""
        if self._staged is not None:
            self._staged.drain()
        self._grad_copies.wait()

    def _host_grads(self) -> list[torch.Tensor]:
        # Every reader of host gradients comes through here or _ordered_grads: the copies from
        # the device must have landed (with pinned memory they run asynchronously on a stream).
        self._wait_for_grads()
        return [s.grad for s in self.slots if not s.fresh]

    def _device_grads(self) -> list[torch.Tensor]:
        if self._device_opt is None:
            return []
        return [_local(p.grad) for g in self._device_opt.param_groups for p in g["params"] if p.grad is not None]

    def _all_grads(self) -> list[torch.Tensor]:
        return self._host_grads() + self._device_grads()

    def unscale_grads_(self, inv_scale: float) -> None:
        if inv_scale == 1.0:
            return
        grads = self._all_grads()
        if self._owner is not None:
            # Stage 1: the gradient norm is taken from the full device gradients (see
            # total_grad_norm), so they are unscaled too.
            grads += [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, inv_scale)

    def grads_have_inf_or_nan(self, held_in: torch.dtype | None = None) -> bool:
        """Whether this rank's accumulated gradients overflowed (``held_in``: see the engine's
        check; the staged adds of every micro-step have landed before this reads them)."""
        from hf_zero.precision.loss_scaler import grads_have_inf_or_nan

        return bool(grads_have_inf_or_nan(self._all_grads(), held_in=held_in))

    def total_grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """Norm over every rank's gradients, with the arithmetic of the engine's non-offloaded path
        (so clipping scales the gradients by the very same factor):

        * stage 1: DDP left the full, averaged gradients on the parameters; their norm is what the
          non-offloaded stage 1 computes, so compute exactly that.
        * stages 2/3: per-tensor norms of the local shards, one all-reduce of their p-th powers
          (over the shard group: replicas hold the same shards), then the norm of the per-tensor
          norms -- what ``get_total_norm`` does with DTensors.
        """
        norm_type = float(norm_type)
        if self._owner is not None:
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            if not grads:
                return torch.zeros(())
            return torch.nn.utils.get_total_norm(grads, norm_type=norm_type, foreach=True).to("cpu")
        distributed = self._world > 1 and dist.is_initialized()
        return sharded_total_norm(self._ordered_grads(), norm_type, self._comm_device if distributed else None,
                                  group=self._norm_group)

    def _ordered_grads(self) -> list[torch.Tensor]:
        """This rank's gradient of every parameter that has one, in param-group order (the same
        list on every rank at stages 2/3: each holds a shard of every parameter)."""
        self._wait_for_grads()
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                slot = self._slot_of.get(id(p))
                if slot is not None:
                    if not slot.fresh:
                        out.append(slot.grad)
                elif p.grad is not None:
                    out.append(_local(p.grad))
        return out

    def clip_grads_with_norm_(self, max_norm: float, total_norm: torch.Tensor) -> None:
        """Same formula as ``torch.nn.utils.clip_grads_with_norm_``."""
        clip_coef = max_norm / (total_norm.to("cpu", torch.float32) + 1e-6)
        clamped = torch.clamp(clip_coef, max=1.0)
        host = self._host_grads()
        if host:
            torch._foreach_mul_(host, clamped)
        dev = self._device_grads()
        if dev:
            torch._foreach_mul_(dev, clamped.to(dev[0].device))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a new accumulation window: host gradients are overwritten by the next copy."""
        self._wait_for_grads()  # no add of the last window may land in the next one
        for slot in self.slots:
            slot.fresh = True
            slot.param.grad = None
        if self._device_opt is not None:
            self._device_opt.zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Update the parameters; every rank must call it (it ends with a collective).

        Raises:
            OffloadError: a swap or copy failed on any rank (raised on every rank).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        error: BaseException | None = None
        try:
            if self._closed:
                raise OffloadError("the offloaded optimizer is closed (its engine was closed)")
            self._wait_for_grads()  # asynchronous gradient copies and adds have landed
            for feed in self._feeds:  # no device gradient buffer is kept through the step
                release = getattr(feed, "release", None)
                if release is not None:
                    release()
            for check in self.pre_step_checks:
                check()
            self._sync_hyper()
            if self._device_opt is not None:
                self._device_opt.step()
            with self._threads.applied():
                if self._nvme:
                    self._step_nvme()
                else:
                    self._step_cpu()
            self.host_steps += 1
            for action in self.post_step_actions:
                action()
        except BaseException as exc:  # noqa: BLE001 -- agreed on below, then re-raised
            error = exc
        agree_on_error(error, "the offloaded optimizer step")
        if self._owner is not None:
            self._broadcast_updates()
        return loss

    def _sync_hyper(self) -> None:
        for chunk in self.chunks:
            for inner_group, gi in zip(chunk.optimizer.param_groups, chunk.groups):
                for key, value in self.param_groups[gi].items():
                    if key not in _IMPL_KEYS:
                        inner_group[key] = value
        if self._device_opt is not None:
            for inner_group, gi in zip(self._device_opt.param_groups, self._device_group_ids):
                for key, value in self.param_groups[gi].items():
                    if key != "params":
                        inner_group[key] = value

    def _bind_grads(self, chunk: _Chunk) -> bool:
        active = False
        for piece in chunk.pieces:
            if piece.slot.fresh:
                piece.tensor.grad = None
            else:
                piece.tensor.grad = piece.slot.grad[piece.start : piece.end]
                active = True
        return active

    def _step_cpu(self) -> None:
        pending = []
        for chunk in self.chunks:
            if not self._bind_grads(chunk):
                continue
            chunk.optimizer.step()
            self._adopt_state(chunk)
            # Copy this chunk back to the device on the worker thread while the next one steps.
            pending.append(self._copier.submit(self._copy_back, chunk, None))
        _wait_futures(pending)

    def _adopt_state(self, chunk: _Chunk) -> None:
        """Move state the inner optimizer created lazily into each slot's flat host storage, so a
        parameter split over chunks has one tensor per state key (for state dicts and reports)."""
        state = chunk.optimizer.state
        for piece in chunk.pieces:
            if piece.adopted:
                continue
            st = state.get(piece.tensor)
            if not st:
                continue
            for key in self._state_keys:
                value = st.get(key)
                if not torch.is_tensor(value) or value.shape != piece.tensor.shape:
                    continue
                flat = piece.slot.state.get(key)
                if flat is None:
                    flat = alloc_host(piece.slot.numel, value.dtype, pin=False, setting=f"{_SETTING}")
                    piece.slot.state[key] = flat
                view = flat[piece.start : piece.end]
                view.copy_(value)
                st[key] = view
            piece.adopted = True

    def _copy_back(self, chunk: _Chunk, source: Callable[[_Piece], torch.Tensor] | None) -> None:
        copies = accel.PendingCopies()
        for piece in chunk.pieces:
            if piece.numel == 0:
                continue
            values = piece.tensor if source is None else source(piece)
            self._write_param(piece.slot, piece.start, values, copies)
        # The host values may be overwritten as soon as this returns (an NVMe buffer goes back to
        # the pool): wait for these host-to-device copies, on the parameters' own device (F3: not
        # this worker thread's current device).
        copies.wait()

    def _write_param(self, slot: _Slot, start: int, values: torch.Tensor, copies: accel.PendingCopies) -> None:
        if self._param_writer is not None:
            self._param_writer(slot.param, start, values)
            return
        target = _local(slot.param.data).view(-1)[start : start + values.numel()]
        if target.dtype == values.dtype or not accel.is_accelerator(target):
            copies.copy(target, values)
            return
        for offset in range(0, values.numel(), COPY_BACK_BLOCK):  # see COPY_BACK_BLOCK
            end = offset + COPY_BACK_BLOCK
            copies.copy(target[offset:end], values[offset:end])

    # ------------------------------------------------------------------------------------ report
    def memory_report(self) -> TierReport:
        """Host gradient buffers (grads/host); masters and state on host or NVMe; NVMe swap
        buffers count as host optimizer state; the partial-offload device part on the accelerator."""
        report = empty_report()
        report["grads"]["host"] += sum(nbytes(s.grad) for s in self.slots)
        if self._nvme:
            report["optimizer_state"]["nvme"] += self._space.total_bytes if self._space else 0
            report["optimizer_state"]["host"] += self._pool.total_bytes if self._pool else 0
        else:
            for slot in self.slots:
                report["optimizer_state"]["host"] += nbytes(slot.master)
                report["optimizer_state"]["host"] += sum(nbytes(v) for v in slot.state.values())
        for chunk in self.chunks:  # scalar state (Adam's step counters)
            for st in chunk.optimizer.state.values():
                for key, value in st.items():
                    if key not in self._state_keys and torch.is_tensor(value):
                        report["optimizer_state"]["host"] += nbytes(value)
        if self._device_opt is not None:
            for st in self._device_opt.state.values():
                for value in st.values():
                    if torch.is_tensor(value) and value.dim() > 0:
                        report["optimizer_state"]["accelerator"] += nbytes(value)
        return report

    def claimed_params(self) -> set[int]:
        return set()

    def swap_files(self) -> list[str]:
        """Paths of this rank's optimizer swap files (empty unless NVMe)."""
        if self._space is None:
            return []
        return [self._space.path(n) for n in self._space.names()]

    @property
    def swap_dir(self) -> str | None:
        return self._space.dir.path if self._space is not None else None

    def add_feed(self, feed: Any) -> None:
        self._feeds.append(feed)

    def close(self) -> None:
        """Stop threads, remove hooks and swap files (idempotent; also run at exit)."""
        if self._closed:
            return
        self._closed = True
        for feed in self._feeds:
            feed.remove()
        self._feeds = []
        try:
            if self._pool is not None:
                for buf, handle in self._prefetched.values():
                    try:
                        handle.wait()
                    except OffloadError:
                        pass
                self._prefetched = {}
        finally:
            self._copier.shutdown(wait=True)
            if self._staged is not None:
                self._staged.close()
            if self._space is not None:
                self._space.close()
