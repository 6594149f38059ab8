"""What the offloaded optimizer (``host_optimizer.py``) holds, and small helpers its modules share.

* :class:`HostOffloadConfig` and :class:`ParamPlan`: what it takes from the config and the stage.
* Its host layout: a :class:`_Slot` per parameter (local shard) stepped on the host, cut into
  :class:`_Piece` ranges that chunks (:class:`_Chunk`) of at most ``sub_group_size`` elements step, one
  inner torch optimizer per chunk.
* :func:`host_dtensor`: a DTensor over a host shard (offloaded state in DTensor checkpoints).
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hf_zero.config.schema import AioConfig

__all__ = ["HostOffloadConfig", "ParamPlan", "host_dtensor"]

_IMPL_KEYS = frozenset({"params", "fused", "foreach", "capturable", "differentiable"})
"""Group keys that choose a kernel for the *device* tensors; the host optimizers choose their own."""
_SETTING = "zero_optimization.offload_optimizer"
_SPLIT_ALIGN = 256
"""A parameter split between chunks is cut at multiples of this many elements (1 KiB of fp32):
torch's fused CPU kernels run a vectorised body and a scalar tail that may round differently in
the last bit, so aligned cuts keep the update bit-identical to an unsplit step."""


_FUSED_CPU_CLASSES = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def _elementwise_classes() -> tuple[type, ...]:
    from hf_zero.optim.lion import Lion

    return (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, Lion)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def host_dtensor(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A DTensor with ``like``'s mesh, placements and global shape whose shard is ``local``.

    ``DTensor.from_local`` would move a host shard to the mesh's device (the GPU), which is exactly
    what offloaded state must not do; FSDP2's own CPU offload builds its DTensors the same way.
    ``local`` may have another dtype than ``like`` (fp32 state of a 16-bit parameter).
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(like, DTensor):
        return local
    try:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

        spec = DTensorSpec(
            like.device_mesh,
            tuple(like.placements),
            tensor_meta=TensorMeta(like.shape, like.stride(), local.dtype),
        )
        return DTensor(local, spec, requires_grad=False)
    except (ImportError, TypeError):  # pragma: no cover - private constructor changed
        return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                                  shape=like.shape, stride=like.stride())


@dataclass(frozen=True)
class HostOffloadConfig:
    """What the offloaded optimizer takes from the config (see ``OffloadOptimizerConfig``)."""

    device: str
    """``cpu`` or ``nvme``."""
    sub_group_size: int
    pin_memory: bool = False
    buffer_count: int = 4
    nvme_path: str | None = None
    aio: AioConfig = field(default_factory=AioConfig)
    run_id: str | None = None
    """Name of this run's swap folder (shared by its ranks); required for ``nvme``."""


@dataclass
class ParamPlan:
    """Which parameters this rank steps where."""

    host: list[nn.Parameter]
    """Stepped on the host by this rank (its shards at stages 2/3; the ones it owns at stage 1)."""
    device: list[nn.Parameter] = field(default_factory=list)
    """Stepped on the accelerator by this rank (``offload_optimizer.ratio`` < 1)."""
    owner: dict[int, int] | None = None
    """Stage 1: ``id(param) -> rank`` that steps it (and broadcasts it); None when sharded."""
    masters: dict[int, torch.Tensor] = field(default_factory=dict)
    """fp32 values of host parameters' local shards, captured before they were cast to 16 bit;
    a parameter not listed starts from its own (local) values."""


@dataclass(eq=False)
class _Slot:
    """One parameter (its local shard) stepped on the host by this rank."""

    name: str
    param: nn.Parameter
    group: int
    local_shape: torch.Size
    numel: int
    like: torch.Tensor
    grad: torch.Tensor
    master: torch.Tensor | None = None
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    fresh: bool = True
    pieces: list[_Piece] = field(default_factory=list)


@dataclass(eq=False)
class _Piece:
    """A contiguous range of a slot that one chunk steps."""

    slot: _Slot
    start: int
    end: int
    tensor: torch.Tensor
    offset: int = 0  # elements before this piece in its chunk's sections (NVMe layout)
    adopted: bool = False

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(eq=False)
class _Chunk:
    """At most ``sub_group_size`` elements, stepped by one inner optimizer."""

    index: int
    pieces: list[_Piece]
    groups: list[int]
    optimizer: torch.optim.Optimizer
    numel: int
    written: bool = False  # NVMe: the state sections of the record hold data



# ---------------------------------------------------------------------------------------------- helpers
def _probe_state(
    build: Callable[[list[dict[str, Any]]], torch.optim.Optimizer], hyper: dict[str, Any], cls: type
) -> tuple[list[str], dict[str, Any]]:
    """Which state keys the optimizer keeps per element (swapped, split with the parameter) and
    which it keeps per parameter (Adam's ``step``: stays in memory). Found by stepping a throw-away
    instance on a 2x3 tensor, which is the only way that works for any optimizer class."""
    probe = torch.zeros(2, 3)
    probe.grad = torch.full((2, 3), 1e-3)
    opt = build([{**hyper, "params": [probe]}])
    opt.step()
    st = opt.state.get(probe, {})
    per_element = [k for k, v in st.items() if torch.is_tensor(v) and v.shape == probe.shape]
    other = {k: (torch.zeros_like(v) if torch.is_tensor(v) else v) for k, v in st.items() if k not in per_element}
    return per_element, other


def _wait_futures(futures: Iterable[cf.Future]) -> None:
    error = None
    for f in futures:
        try:
            f.result()
        except BaseException as exc:  # noqa: BLE001 -- first error re-raised after all finished
            error = error or exc
    if error is not None:
        raise error


class _InlineExecutor:
    """``submit`` runs the call now and returns a finished future (the executor API, no thread)."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> cf.Future:
        future: cf.Future = cf.Future()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 -- delivered through the future, like a thread's
            future.set_exception(exc)
        return future

    def shutdown(self, wait: bool = True) -> None:
        return None
