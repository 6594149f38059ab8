"""Pinned host memory for the offload backends: planned with the allocator's rounding, checked
against the container's headroom before anything is pinned, and taken in a few large blocks.

Review F9. torch's host caching allocator (``ATen/core/CachingHostAllocator.h``) rounds every
pinned allocation up to a power of two and never returns freed blocks to the system, so one
pinned buffer per parameter costs up to twice the bytes the estimator counts. Pinned memory is
charged to the cgroup: a container pushed over ``memory.max`` by it is OOM-killed (SIGKILL; one
rank dies and torchrun tears the rest down) instead of getting an error. So:

* :func:`plan_layout` packs the buffers of one kind (gradients, fp32 masters), largest first,
  into blocks whose sizes are powers of two: the rounding then wastes only the unused tails of
  the blocks, and :func:`planned_pinned_bytes` is exactly what the allocator will reserve;
* :func:`pinning_fits` compares that total, times the ranks of this node (they pin at the same
  time), with the headroom (``MemAvailable`` and the cgroup's limit minus its usage) and says
  what it decided; on a shortfall the caller falls back to pageable memory with a warning
  (training goes on; device<->host copies are then synchronous);
* :class:`HostArena` allocates the blocks and hands out each buffer as a view.

Example::

    >>> sizes = [4 << 20, 3 << 20, 1 << 20]               # bytes of three fp32 buffers
    >>> plan_blocks(sizes, block=8 << 20)                 # one 8 MiB block holds all three
    [8388608]
    >>> sum(1 << (s - 1).bit_length() for s in sizes)   # one allocation each: 4 + 4 + 1 MiB
    9437184
"""

from __future__ import annotations

import logging
import os

import torch

from hf_zero.distributed import device as accel
from hf_zero.offload import base
from hf_zero.offload.base import OffloadError, format_bytes
from hf_zero.utils.host_memory import host_headroom

__all__ = ["BLOCK_BYTES", "HostArena", "planned_pinned_bytes", "plan_blocks", "plan_layout", "pinning_fits", "pow2_ceil",
           "rounded_per_buffer_bytes"]

logger = logging.getLogger("hf_zero")

BLOCK_BYTES = 256 << 20
"""Default block size: large enough that few blocks are needed, small enough that the unused tail
of the last one is small next to any model worth offloading."""
ALIGN = 64  # every view starts on a 64-byte boundary (vectorised CPU kernels, DMA)
SAFETY = 0.9  # pin at most this share of the headroom: the rest of the process still allocates


def pow2_ceil(n: int) -> int:
    """The smallest power of two >= ``n`` (what the host caching allocator reserves for ``n``)."""
    return 1 << max(0, int(n) - 1).bit_length() if n > 0 else 0


def _aligned(n: int) -> int:
    return -(-int(n) // ALIGN) * ALIGN


def plan_layout(sizes: list[int], block: int = BLOCK_BYTES) -> tuple[list[int], list[tuple[int, int]]]:
    """Where buffers of ``sizes`` bytes go: ``(block sizes, [(block, byte offset)] per buffer)``.

    First fit, largest first, into blocks of ``max(block, pow2_ceil(largest buffer))`` bytes;
    each block is then shrunk to the power of two that holds what it got. Every offset is
    64-byte aligned."""
    if not sizes:
        return [], []
    cap = max(pow2_ceil(block), max(pow2_ceil(_aligned(s)) for s in sizes))
    used: list[int] = []
    places: list[tuple[int, int]] = [(0, 0)] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
        need = _aligned(sizes[i])
        home = next((b for b, u in enumerate(used) if u + need <= cap), None)
        if home is None:
            used.append(0)
            home = len(used) - 1
        places[i] = (home, used[home])
        used[home] += need
    return [pow2_ceil(max(u, 1)) for u in used], places


def plan_blocks(sizes: list[int], block: int = BLOCK_BYTES) -> list[int]:
    """Sizes of the pinned blocks :class:`HostArena` allocates for buffers of ``sizes`` bytes
    (each a power of two, so the allocator reserves exactly that)."""
    return plan_layout(sizes, block)[0]


def planned_pinned_bytes(sizes: list[int], block: int = BLOCK_BYTES) -> int:
    """Bytes the allocator reserves when :class:`HostArena` pins buffers of ``sizes`` bytes."""
    return sum(plan_blocks(sizes, block))


def rounded_per_buffer_bytes(sizes: list[int]) -> int:
    """Bytes reserved when each buffer is pinned on its own (one allocation each, rounded)."""
    return sum(pow2_ceil(s) for s in sizes)


def _ranks_on_this_node() -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def pinning_fits(planned: int, setting: str, *, headroom: tuple[int | None, str] | None = None,
                 ranks: int | None = None, what: str = "") -> bool:
    """Whether ``planned`` bytes of pinned memory per rank fit this node's headroom; logs a
    warning naming ``setting`` and the numbers when they do not.

    Args:
        planned: :func:`planned_pinned_bytes` of what is about to be pinned on this rank.
        setting: the config key that asked for pinning (``offload_optimizer.pin_memory``).
        headroom: ``(bytes, what bounds it)``; read from the system by default.
        ranks: the ranks of this node that pin the same amount; ``LOCAL_WORLD_SIZE`` by default.
        what: what is pinned, when ``setting`` alone does not say (a frozen model's shards).
    """
    if planned <= 0:
        return True
    bytes_left, bound = headroom if headroom is not None else host_headroom()
    if bytes_left is None:
        return True  # nothing to check against (not Linux): pin, as DeepSpeed does
    ranks = ranks if ranks is not None else _ranks_on_this_node()
    need = planned * ranks
    if need <= SAFETY * bytes_left:
        return True
    logger.warning(
        "hf_zero: %s: pinning %s of host memory%s (%d rank(s) x %s, with the allocator's power-of-two "
        "rounding) would pass %.0f%% of the %s left by %s; a container that goes over its memory limit "
        "is killed without an error, so these buffers use pageable memory instead (training goes on; "
        "device<->host copies are synchronous and slower). To pin: give the container more memory, "
        "or offload less (offload_param, ratio), or set %s=false to silence this.",
        setting, format_bytes(need), f" for {what}" if what else "", ranks, format_bytes(planned), SAFETY * 100,
        format_bytes(bytes_left), bound, setting,
    )
    return False


class HostArena:
    """Host buffers of one kind, pinned in the blocks of :func:`plan_blocks` (pageable when
    ``pin`` is false or there is no accelerator) and handed out as zero-filled 1-D views.

    >>> arena = HostArena([10, 6], torch.float32, pin=False, setting="offload_optimizer.pin_memory")
    >>> [t.numel() for t in arena.views], arena.reserved_bytes
    [10, 6]
    """

    def __init__(self, numels: list[int], dtype: torch.dtype, *, pin: bool, setting: str,
                 block: int = BLOCK_BYTES):
        itemsize = torch.empty((), dtype=dtype).element_size()
        sizes = [int(n) * itemsize for n in numels]
        self.pinned = bool(pin and accel.pin_available())
        self.blocks: list[torch.Tensor] = []
        self.views: list[torch.Tensor] = []
        if not sizes:
            return
        if self.pinned:
            blocks, places = plan_layout(sizes, block)
        else:  # pageable: one allocation, nothing to round
            offsets = [0]
            for size in sizes[:-1]:
                offsets.append(offsets[-1] + _aligned(size))
            blocks, places = [offsets[-1] + _aligned(sizes[-1])], [(0, o) for o in offsets]
        self.blocks = [self._allocate(nbytes, setting) for nbytes in blocks]
        for numel, size, (b, offset) in zip(numels, sizes, places):
            self.views.append(self.blocks[b][offset:offset + size].view(dtype)[:numel])

    @property
    def reserved_bytes(self) -> int:
        """Bytes held (each block as allocated)."""
        return sum(b.numel() for b in self.blocks)

    def _allocate(self, nbytes: int, setting: str) -> torch.Tensor:
        try:
            # Through the one host allocation function every offload buffer uses (tests wrap it).
            raw = base._allocate(nbytes, self.pinned)
        except (RuntimeError, MemoryError) as exc:
            what = "pin" if self.pinned else "allocate"
            raise OffloadError(
                f"could not {what} {format_bytes(nbytes)} of host memory ({exc}); "
                + (f"set {setting}=false, or offload less" if self.pinned else "offload less or add host memory")
            ) from exc
        return raw  # zero-filled by _allocate
