"""``OffloadedOptimizer``: this rank's fp32 master weights and optimizer state off the accelerator.

The implementation is split by job (see each module's docstring):

==========================  ===============================================================
module                      what
==========================  ===============================================================
``host_optimizer``          :class:`OffloadedOptimizer`: host gradients, norm/clip, chunked step
``host_layout``             config, plan, per-parameter slots, chunks, :func:`host_dtensor`
``nvme_chunks``             the NVMe tier: chunk records in swap files, read-ahead, write-behind
``optimizer_checkpoint``    name-keyed checkpoint state and ``state_dict``/``load_state_dict``
``owner_broadcast``         stage 1: updated parameters broadcast from the rank that owns them
==========================  ===============================================================

This module keeps the public names importable from where they always were.
"""

from hf_zero.offload.host_layout import HostOffloadConfig, ParamPlan, host_dtensor
from hf_zero.offload.host_optimizer import OffloadedOptimizer

__all__ = ["HostOffloadConfig", "OffloadedOptimizer", "ParamPlan", "host_dtensor"]
