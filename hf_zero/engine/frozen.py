"""Models that are never trained, placed beside the trained one: TRL's reference models (DPO, KTO,
RLOO, GRPO with ``beta > 0``), distillation teachers, reward models.

DeepSpeed gives such a model an engine without an optimizer: sharded at ZeRO-3 (TRL's
``prepare_deepspeed``), replicated otherwise. hf_zero does the same with FSDP2, on the trained
model's mesh (with ``mics_shard_size`` N its replicate x shard mesh: each rank holds 1/N; hpZ's
secondary partition is left out, there being no backward):

* **Stages 2 and 3**: sharded like a stage-3 model (every block gathered for its forward and freed
  after it), no optimizer, parameters stored in the compute dtype. Every rank's shards come from
  rank 0, so ranks that built the model on the meta device (low-memory loading makes every
  ``from_pretrained`` on a rank other than 0 build there at stage 3) get the weights. At stage 2
  this is also what DeepSpeed would not do (it replicates): the shards have the trained model's
  layout, so code that mixes the two models' parameters (TR-DPO's ``sync_ref_model``:
  ``ref.data.mul_(1 - a).add_(policy.data, alpha=a)``) adds shard to shard, and a 2 x 24 GB user
  can hold a policy and a reference model of 7B each.
* **Stages 0 and 1**: the whole model on each rank's device, rank 0's weights broadcast to the
  others (one starting point, as for the trained model), in the dtype it was loaded in.

``offload_param.device`` ``cpu`` keeps a frozen model's shards in host memory (FSDP2's
``CPUOffloadPolicy``); ``nvme`` does the same (a frozen model has no swap files; logged once).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["prepare_frozen_model"]

logger = logging.getLogger("hf_zero")

FROZEN_ATTR = "_hf_zero_frozen"
"""Set on a model :func:`prepare_frozen_model` prepared (a second call returns it as it is)."""


def prepare_frozen_model(model: nn.Module, config: Any, training_args: Any = None) -> nn.Module:
    """Place ``model``, which is never trained, on the ranks as ``config``'s ZeRO stage says.

    Every rank must call it (it shards or broadcasts). The model is put in evaluation mode and its
    parameters stop requiring gradients.

    Args:
        model: e.g. a reference model from ``from_pretrained`` (on the meta device on ranks other
            than 0 under hf_zero's low-memory loading at stage 3).
        config: the run's zero config (path, dict, JSON string or parsed ``ZeroConfig``).
        training_args: ``TrainingArguments`` for ``"auto"`` values (bf16/fp16).

    Returns:
        The same module object, sharded at stages 2/3, on the device at stages 0/1.

    Example::

        >>> ref = AutoModelForCausalLM.from_pretrained(path)
        >>> ref = hf_zero.prepare_frozen_model(ref, "ds_z3.json")
        >>> with torch.no_grad():
        ...     ref_logits = ref(**batch).logits
    """
    from hf_zero.config import load_config
    from hf_zero.distributed.env import init_distributed
    from hf_zero.precision.policy import PrecisionPolicy

    if getattr(model, FROZEN_ATTR, False):
        return model
    env = init_distributed()
    resolved = load_config(config, training_args=training_args, world_size=env.world_size)
    zero = resolved.zero_optimization
    model.requires_grad_(False)
    model.eval()
    if zero.stage >= 2:
        _shard(model, resolved, env, PrecisionPolicy.from_config(resolved))
        from hf_zero.engine.sharded_access import keep_class_names

        keep_class_names(model)
    else:
        _replicate(model, env)
    setattr(model, FROZEN_ATTR, True)
    return model


def _shard(model: nn.Module, config: Any, env: Any, precision: Any) -> None:
    from torch.distributed.fsdp import register_fsdp_forward_method

    from hf_zero.engine.stages import FullyShardedStage
    from hf_zero.offload.param_offload import frozen_offload_policy

    zero = config.zero_optimization
    if zero.hpz_partition_size > 1:
        # hpZ's secondary partition serves the backward's all-gathers; a frozen model has no
        # backward. With it, every unit would stay on the post-forward mesh after each forward, and
        # ``parameters()`` would be those copies instead of the shards beside the trained model's
        # (TR-DPO's sync adds shard to shard): the frozen model reshards fully after its forward.
        zero = dataclasses.replace(zero, hpz_partition_size=1)
    stage = FullyShardedStage(3, zero, env, precision)
    plan = stage.mesh_plan()  # the trained model's mesh (replicate x shard with mics_shard_size)
    offload = zero.offload_param
    if offload.device != "none":
        if offload.device == "nvme" and env.is_main:
            logger.info("hf_zero: frozen %s kept in host memory (offload_param nvme swaps trained models only)",
                        type(model).__name__)
        # Pinned only when the shards fit the host's headroom (review N5), else pageable with a warning.
        stage.fsdp_extra = {"offload_policy": frozen_offload_policy(offload, model, plan.shard,
                                                                    precision.compute_dtype)}
    stage.wrap(model)
    if hasattr(model, "generate"):
        # generate() is not a forward: FSDP2 gathers the parameters for it only once registered.
        register_fsdp_forward_method(model, "generate")
    if env.is_main:
        local = sum(_local(p).numel() for p in model.parameters())
        where = f"{plan.shard} ranks" + (f", replicated {plan.replicate} times" if plan.hierarchical else "")
        logger.info("hf_zero: frozen %s sharded over %s (%s parameter elements on this rank)",
                    type(model).__name__, where, f"{local:,}")


def _replicate(model: nn.Module, env: Any) -> None:
    from hf_zero.distributed.collectives import agree_on_error
    from hf_zero.engine.materialize import has_meta_params

    error: BaseException | None = None
    try:
        if has_meta_params(model):
            raise ValueError(
                f"the frozen {type(model).__name__} has parameters on the meta device, but this ZeRO stage keeps "
                "a full copy on every rank; load it normally (HF_ZERO_LOW_MEMORY_LOADING=0) or use stage 3"
            )
        model.to(env.device)
    except BaseException as exc:  # noqa: BLE001 -- agreed on below, then re-raised
        error = exc
    # A rank that cannot place its copy must not leave the others waiting in the broadcasts.
    agree_on_error(error, f"placing the frozen {type(model).__name__}", error_type=ValueError)
    if env.world_size > 1 and dist.is_initialized():
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p
