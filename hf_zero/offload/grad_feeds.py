"""The gradient feeds of an offloaded optimizer: how each reduced gradient reaches its host buffer.

:class:`FsdpGradFeed` (stages 2/3) takes FSDP2's reduce-scatter output per parameter in a
post-accumulate-grad hook (checking once that the output is laid out as the shards are);
:class:`DdpGradFeed` (stage 1) copies DDP's all-reduced buckets in a comm hook. Both hand the
gradient to the :class:`OffloadedOptimizer`, which copies it to pinned host memory without waiting.
Split from ``offload/manager.py``, which builds them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hf_zero.distributed import device as accel
from hf_zero.distributed.fsdp_internals import HostGradCopies
from hf_zero.offload.base import OffloadError
from hf_zero.offload.cpu_optimizer import OffloadedOptimizer

__all__ = ["DdpGradFeed", "FsdpGradFeed", "padded_shard_numel"]


def padded_shard_numel(param: torch.Tensor, shard_size: int) -> int:
    """Elements FSDP2 gives this parameter in one rank's reduce-scatter output: dim 0 padded to a
    multiple of the ranks it is sharded over (the shard group: the world on a flat mesh,
    ``mics_shard_size`` on a replicate x shard one), divided by it (``_get_dim0_padded_size``)."""
    shape = tuple(param.shape)
    if not shape:
        return 1
    rows = -(-shape[0] // shard_size)
    rest = 1
    for d in shape[1:]:
        rest *= d
    return rows * rest


class FsdpGradFeed:
    """Stages 2/3: each sharded gradient to the host as soon as FSDP2 has reduce-scattered it.

    FSDP2 calls a parameter's post-accumulate-grad hooks right after its unit's reduce-scatter,
    with ``param.grad`` already cast to the parameter's dtype -- 16 bit when the parameters are
    16-bit shards. The exact fp32 values are in the reduce-scatter output, which FSDP2 passes to
    the unit's all-reduce hook (``FSDPModule.set_all_reduce_hook``) just before; the parameters
    follow in it in order, each padded to :func:`padded_shard_numel`. Every parameter's first
    gradient is checked against FSDP2's own cast (on the device, without a synchronization; the
    optimizer step reads the verdict once: :meth:`verify_layout`), so a torch that lays the
    buffer out differently fails with a clear error before any update instead of training on
    wrong gradients. A window the fp16 loss scaler skips proves nothing (its gradients may be all
    nan, which compare equal here), so its parameters are checked again in the next one.

    On a replicate x shard mesh (``mics_shard_size``, FSDP2's HSDP) the all-reduce across the
    replicas runs in place on that same output, before FSDP2 calls the all-reduce hook and then
    the post-accumulate-grad hooks (``foreach_reduce`` in torch 2.9 to 2.13), so what the feed
    reads is the complete gradient shard, the same on every replica.

    The reduce-scatter output (4 bytes x the unit's elements / N) is dropped as soon as its last
    parameter's gradient has been copied to the host (and, in any case, by :meth:`release`, which
    the optimizer calls before stepping), so no fp32 gradient buffer outlives its backward.
    """

    def __init__(self, optimizer: OffloadedOptimizer, fsdp_modules: list[nn.Module], params: list[nn.Parameter],
                 shard_size: int):
        self._opt = optimizer
        self._shard_size = shard_size  # ranks the reduce-scatter runs over (manager.shard_group)
        self._flat: torch.Tensor | None = None
        self._cursor = 0
        self._unchecked = {id(p) for p in params}  # until a stepped window has checked them
        self._checked_now: set[int] = set()  # checked in the window being accumulated
        self._layout_bad: torch.Tensor | None = None  # a device flag: no sync per gradient
        self._modules = fsdp_modules
        self._host_copies = HostGradCopies(fsdp_modules)  # FSDP2's own copies to host (offload_param: cpu)
        for module in fsdp_modules:
            module.set_all_reduce_hook(self._on_reduced)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def _on_reduced(self, output: torch.Tensor) -> None:
        self._flat = output
        self._cursor = 0

    def _on_grad(self, param: nn.Parameter) -> None:
        grad = param.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        if local.dtype == torch.float32:
            self._host_copies.wait(param, local)  # FSDP2's copy to host: in flight on torch 2.9-2.11 (N3)
            exact = local
        else:
            flat = self._flat
            if flat is None or flat.dtype != torch.float32:
                raise OffloadError(
                    "hf_zero's optimizer offload did not receive FSDP2's fp32 reduce-scatter output (reduce "
                    f"dtype {None if flat is None else flat.dtype}); this torch ({torch.__version__}) is not supported"
                )
            n = local.numel()
            if self._cursor + n > flat.numel():
                raise OffloadError(
                    f"FSDP2's reduce-scatter output is not laid out as hf_zero expects (torch {torch.__version__}): "
                    f"{flat.numel()} elements, gradient {n} at offset {self._cursor}; optimizer offload cannot "
                    "recover fp32 gradients"
                )
            exact = flat[self._cursor : self._cursor + n].view(local.shape)
            self._cursor += padded_shard_numel(param, self._shard_size)
            if id(param) in self._unchecked:
                self._checked_now.add(id(param))
                # (with FSDP2's CPU offload policy the 16-bit gradient is a host copy)
                self._host_copies.wait(param, local)
                # nan == nan here: an fp16 overflow casts nan to nan (and the step is skipped)
                mine = exact.to(device=local.device, dtype=local.dtype)
                bad = ((mine != local) & ~(mine.isnan() & local.isnan())).any()
                self._layout_bad = bad if self._layout_bad is None else self._layout_bad | bad
        self._opt.accumulate_grad(param, exact)
        if exact is local:
            # fp32 path: the gradient is a view of FSDP2's reduce-scatter output, which its
            # allocator may hand out again once param.grad is dropped, while the asynchronous
            # device-to-host copy still reads it (review F6).
            accel.record_stream(local)
        param.grad = None  # no gradient shard stays on the accelerator
        if self._flat is not None and self._cursor >= self._flat.numel():
            self.release()  # the unit's last gradient has been copied: drop its fp32 output

    def verify_layout(self) -> None:
        """Before the optimizer step: raise if a checked gradient differed from FSDP2's cast (one
        synchronization, on the steps whose backward checked something)."""
        bad, self._layout_bad = self._layout_bad, None
        self._unchecked -= self._checked_now  # a window that is stepped counts as checked
        self._checked_now = set()
        if bad is not None and bool(bad):
            raise OffloadError(
                f"FSDP2's reduce-scatter output is not laid out as hf_zero expects (torch {torch.__version__}); "
                "optimizer offload cannot recover fp32 gradients"
            )

    def release(self) -> None:
        """Drop the reference to the last reduce-scatter output (its gradients are on the host)."""
        flat, self._flat = self._flat, None
        self._cursor = 0
        if flat is not None:
            # The host copies of its slices may still be in flight on the current stream: the
            # caching allocator must not hand the block out before they have run.
            accel.record_stream(flat)

    def remove(self) -> None:
        self.release()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for module in self._modules:
            module.set_all_reduce_hook(_noop)


def _noop(_output: torch.Tensor) -> None:
    return None


class DdpGradFeed:
    """Stage 1: the gradients this rank owns to the host as each DDP bucket finishes its all-reduce.

    The comm hook runs the reduction DDP would run (average, or the 16-bit compression the
    precision policy asks for) and chains a copy of the owned parameters' slices of the reduced
    bucket; DDP waits for the chain before backward returns.
    """

    def __init__(self, optimizer: OffloadedOptimizer, ddp: nn.parallel.DistributedDataParallel, owned: set[int],
                 reduce_dtype: torch.dtype):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self._opt = optimizer
        self._owned = owned
        if reduce_dtype == torch.bfloat16:
            self._base = default_hooks.bf16_compress_hook
        elif reduce_dtype == torch.float16:
            self._base = default_hooks.fp16_compress_hook
        else:
            self._base = default_hooks.allreduce_hook

        def hook(state, bucket):  # DDP checks the annotations set below
            return self._hook(bucket)

        # DDP validates the hook's annotations as objects (this module's are strings).
        hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
        ddp.register_comm_hook(state=None, hook=hook)

    def _hook(self, bucket: Any) -> torch.futures.Future:
        params = list(bucket.parameters())
        fut = self._base(None, bucket)

        def copy(done: torch.futures.Future) -> torch.Tensor:
            flat = done.value()
            if isinstance(flat, (list, tuple)):
                flat = flat[0]
            total = sum(p.numel() for p in params)
            if total != flat.numel():
                raise OffloadError(f"DDP bucket holds {flat.numel()} elements, its parameters {total}")
            offset = 0
            for p in params:
                n = p.numel()
                if id(p) in self._owned:
                    self._opt.accumulate_grad(p, flat[offset : offset + n].view(p.shape))
                offset += n
            return flat

        return fut.then(copy)

    def remove(self) -> None:
        return None  # DDP has no way to unregister a comm hook; the engine is done with it anyway
