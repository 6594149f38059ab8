"""Stage 1 with an offloaded optimizer: each rank steps the parameters it owns, then broadcasts
them to the other ranks. A mixin of :class:`hf_zero.offload.host_optimizer.OffloadedOptimizer`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__: list[str] = []

_BROADCAST_BUCKET = 1 << 26
"""Elements per broadcast at stage 1 (256 MiB of fp32): bounds the temporary flat buffer."""


class _OwnerBroadcast:
    """The stage-1 broadcast of updated parameters from their owners."""

    def _broadcast_updates(self) -> None:
        """Stage 1: each rank's updated parameters to every other rank, in bounded buckets."""
        if self._world == 1:
            return
        by_owner: dict[int, list[nn.Parameter]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                by_owner.setdefault(self._owner[id(p)], []).append(p)
        for owner in range(self._world):
            params = by_owner.get(owner, [])
            bucket: list[nn.Parameter] = []
            size = 0
            for p in params + [None]:
                if p is not None and (size + p.numel() <= _BROADCAST_BUCKET or not bucket):
                    bucket.append(p)
                    size += p.numel()
                    continue
                if bucket:
                    flat = torch.cat([b.data.reshape(-1) for b in bucket])
                    dist.broadcast(flat, src=owner)
                    if owner != self._rank:
                        offset = 0
                        for b in bucket:
                            b.data.view(-1).copy_(flat[offset : offset + b.numel()])
                            offset += b.numel()
                if p is not None:
                    bucket, size = [p], p.numel()
