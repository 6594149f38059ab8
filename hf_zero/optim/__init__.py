"""Optimizers and learning-rate schedules built from a DeepSpeed config's ``optimizer`` and
``scheduler`` sections, with DeepSpeed's math and step semantics and no DeepSpeed import."""

from hf_zero.optim.lamb import Lamb
from hf_zero.optim.lion import Lion
from hf_zero.optim.muon import MuonWithAuxAdam, muon_param_groups, uses_muon
from hf_zero.optim.optimizers import SUPPORTED_OPTIMIZERS, build_optimizer, optimizer_state_bytes
from hf_zero.optim.schedulers import (
    SCHEDULER_TYPES,
    DeepSpeedLRScheduler,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

__all__ = [
    "build_optimizer",
    "optimizer_state_bytes",
    "SUPPORTED_OPTIMIZERS",
    "Lion",
    "Lamb",
    "MuonWithAuxAdam",
    "muon_param_groups",
    "uses_muon",
    "build_scheduler",
    "SCHEDULER_TYPES",
    "DeepSpeedLRScheduler",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "OneCycle",
    "LRRangeTest",
]
