"""Unit-test fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture
def one_rank_mesh():
    """A 1-rank gloo DeviceMesh: reuses a 1-rank group an earlier in-process test left (the
    engine keeps its notebook group until exit), else makes one and destroys it afterwards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    created = False
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            pytest.skip("needs a 1-rank process group")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        created = True
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        if created:
            dist.destroy_process_group()
