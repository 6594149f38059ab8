"""Low-memory model loading for ZeRO-3: one full copy per node, not one per rank.

The two steps live in :mod:`hf_zero.engine.meta_loading` (load) and
:mod:`hf_zero.engine.rank0_shards` (shard); this module is their overview and imports both, for
the callers that import from here.

Without this, every rank of ``torchrun --nproc_per_node N`` runs ``from_pretrained`` and holds the
whole model until ``fully_shard`` keeps 1/N of it. transformers 5 memory-maps safetensors, so
ranks that use the weights as stored share the page cache; but each rank that converts them (a
bf16 checkpoint becoming the fp32 master copy at ZeRO-3, a ``dtype=`` differing from the file's,
a file system where transformers turns mmap off) makes its own full private copy: N per node.
With this module (DeepSpeed's ``zero.Init`` loading, on FSDP2) only local rank 0 ever holds the
model. Measured (``bench/README_loading.md``): bf16 checkpoint, 4 ranks, node peak (summed PSS)
3,721 -> 1,919 MiB; where the weights are used as stored, the ranks shared the page cache already
and the node's total does not drop (rank 0 reads the whole file instead of each rank its 1/N).

1. **Load**: while :func:`low_memory_loading` is active (or after :func:`install_low_memory_loading`,
   which ``hf-zero run`` calls at stage 3), a rank whose ``LOCAL_RANK`` is not 0 builds the model
   on the meta device: ``from_pretrained`` runs unchanged (config, dtype, weight renaming, tied
   weights, generation config, adapters) except that checkpoint tensors are read as shapes only
   (safetensors headers) and never as data. Local rank 0 loads normally.
2. **Shard**: :class:`FullyShardedStage` wraps the sharding in :func:`sharded_from_rank0`: before
   ``fully_shard``, rank 0 keeps references to its full parameters (no copy); after it, the ranks
   holding meta tensors allocate their shards (``to_empty``) and every rank receives its shard of
   each parameter from rank 0, one tensor at a time (a scatter, so no rank but rank 0 ever holds a
   full tensor); buffers (rotary ``inv_freq`` and other non-persistent ones included) are broadcast
   whole. The engine does this also when every rank holds real weights (one scatter of the model):
   ranks that built different weights then still start from rank 0's, as with DDP.

Multi-node: each node's local rank 0 loads its own copy (one per node, as the requirement says);
the 1-D mesh spans every rank, so global rank 0 is the single source and the other nodes' copies
serve only until ``fully_shard`` frees them.

Limits: a meta model cannot run or be moved (``model.cuda()``, ``model.to("cuda")``,
``model.generate()``) before the ZeRO-3 engine shards it, exactly as with DeepSpeed's ``zero.Init``;
every ``from_pretrained`` while loading is active is affected (a second, frozen reference model
too), so such scripts opt out with ``HF_ZERO_LOW_MEMORY_LOADING=0`` or
``with low_memory_loading(enabled=False):``. Quantized loads, explicit ``state_dict=``, GGUF files
and multi-device/disk ``device_map``\\s load normally on every rank.
"""

from __future__ import annotations

from hf_zero.engine.meta_loading import (
    ENV_SWITCH,
    install_low_memory_loading,
    low_memory_loading,
    should_use_low_memory_loading,
    skips_weight_loading,
    uninstall_low_memory_loading,
    zero_config_from_argv,
)
from hf_zero.engine.rank0_shards import capture_full_state, fill_sharded_from_rank0, has_meta_params, sharded_from_rank0

__all__ = [
    "ENV_SWITCH",
    "low_memory_loading",
    "install_low_memory_loading",
    "uninstall_low_memory_loading",
    "should_use_low_memory_loading",
    "zero_config_from_argv",
    "skips_weight_loading",
    "has_meta_params",
    "capture_full_state",
    "fill_sharded_from_rank0",
    "sharded_from_rank0",
]
