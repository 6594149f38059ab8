"""Offload backends: optimizer state and master weights on the host or NVMe, parameters on the
host or NVMe (stage 3). ``docs/offload.md`` describes the user-facing behaviour.

==========================  ===============================================================
module                      what
==========================  ===============================================================
``base``                    tier report, host allocation (pinning), cross-rank error agreement
``cpu_optimizer``           :class:`OffloadedOptimizer` (host or NVMe master + state, chunked step),
                            re-exported from ``host_optimizer`` (the step), ``host_layout``
                            (slots, chunks), ``nvme_chunks`` (NVMe tier), ``optimizer_checkpoint``
                            (state dicts) and ``owner_broadcast`` (stage-1 broadcast)
``nvme``                    swap folder, buffer pool, threaded file I/O honouring ``aio``
``param_offload``           stage 3 ``offload_param`` (FSDP2 CPU policy; NVMe unit swapping)
``manager``                 :class:`OffloadManager`: builds the above, plugs into stage and engine
==========================  ===============================================================

``nvme`` is only imported when a config asks for NVMe.
"""

from hf_zero.offload.base import OffloadError, TierReport
from hf_zero.offload.cpu_optimizer import OffloadedOptimizer
from hf_zero.offload.manager import (
    OffloadManager,
    check_offload_config,
    make_offload_manager,
)

__all__ = [
    "OffloadError",
    "OffloadManager",
    "OffloadedOptimizer",
    "TierReport",
    "check_offload_config",
    "make_offload_manager",
]
