"""Load DeepSpeed's pickled checkpoint files without running code from them.

DeepSpeed's files are ``torch.save`` pickles, and DeepSpeed's own ``zero_to_fp32.py`` loads them with
``weights_only=False``: a tampered checkpoint runs code there. hf_zero loads them with torch's
restricted unpickler (``torch.load(weights_only=True)``) and registers, for that load only, the
few DeepSpeed names the files hold (:data:`DEEPSPEED_GLOBALS`) as plain stand-ins defined here:
classes with no behaviour, whose instances only carry the values the pickle gives them. Any other
global (``os.system``, a class of the training script, ...) is refused by torch's unpickler before
it is looked up, and the file is refused with an error naming it and the global.

DeepSpeed itself is never imported: the stand-ins are how a checkpoint's objects look to hf_zero.
"""

from __future__ import annotations

import enum
import os
import re
from typing import Any

import torch

from hf_zero.checkpoint.errors import CheckpointError

__all__ = ["DEEPSPEED_GLOBALS", "DynamicLossScalerState", "FragmentAddress", "LossScalerState", "ZeroStage",
           "load_deepspeed_file"]


class ZeroStage(enum.IntEnum):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum`` (pickled as ``ZeroStageEnum(value)``)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class FragmentAddress:
    """Stand-in for ``deepspeed.utils.tensor_fragment.fragment_address`` (ZeRO-1/2 ``param_slice_mappings``):
    ``numel`` and ``start`` of a parameter's piece in the rank's flat partition."""

    numel: int
    start: int

    def __repr__(self) -> str:
        return f"FragmentAddress(numel={self.__dict__.get('numel')!r}, start={self.__dict__.get('start')!r})"


class LossScalerState:
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.LossScaler``: its attributes (``cur_scale``,
    ``dynamic``, ...) as the pickle gives them."""

    def __repr__(self) -> str:
        return f"LossScalerState({self.__dict__!r})"


class DynamicLossScalerState(LossScalerState):
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler`` (fp16 with dynamic loss
    scaling): ``cur_scale``, ``cur_iter``, ``last_overflow_iter``, ``scale_window``, ... as pickled."""

    def __repr__(self) -> str:
        return f"DynamicLossScalerState({self.__dict__!r})"


DEEPSPEED_GLOBALS: dict[str, type] = {
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStage,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScalerState,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": DynamicLossScalerState,
}
"""The DeepSpeed names DeepSpeed 0.19.8's ZeRO checkpoint files pickle, and what each becomes here.
(``collections.OrderedDict``, ``torch.Size`` and ``torch._tensor._rebuild_from_type_v2`` are in
torch's own ``weights_only`` allowlist.)"""


def load_deepspeed_file(path: str | os.PathLike, *, mmap: bool = True) -> Any:
    """The content of one DeepSpeed checkpoint file, read with ``torch.load(weights_only=True)``.

    Args:
        path: a ``*_model_states.pt`` or ``*_optim_states.pt`` file.
        mmap: map the tensors' bytes instead of reading them (only the bytes a caller touches are
            read: a 16-bit model file or the Adam moments cost nothing until used).

    Raises:
        CheckpointError: the file holds a global that is not one of :data:`DEEPSPEED_GLOBALS` nor in
            torch's allowlist (the message names the file and the global; nothing from it ran), or it
            is not a ``torch.save`` file.
        OSError: it cannot be read.
    """
    path = os.fspath(path)
    stand_ins = [(cls, name) for name, cls in DEEPSPEED_GLOBALS.items()]
    try:
        with torch.serialization.safe_globals(stand_ins):
            # Explicit weights_only=True also wins over TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD.
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except (OSError, MemoryError):
        raise
    except Exception as exc:  # UnpicklingError from weights_only, a garbled zip, ...
        raise CheckpointError(
            f"{path}: refusing to load it as a DeepSpeed checkpoint file ({_reason(exc)}). hf_zero reads "
            "DeepSpeed's files with torch.load(weights_only=True) and admits only the DeepSpeed names "
            f"{', '.join(DEEPSPEED_GLOBALS)}; a file that needs anything else was not written by DeepSpeed's "
            "ZeRO checkpointing (or was altered): get the checkpoint again from where it was saved"
        ) from exc


def _reason(exc: BaseException) -> str:
    """The useful line of torch's error (its weights_only message is a page of advice around it)."""
    text = str(exc)
    found = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) (\S+)", text)
    if found:
        return f"it asks for the global {found.group(1)}"
    found = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\.\s|\n|$)", text)
    if found:
        return f"torch.load(weights_only=True) refuses its pickle: {found.group(1).strip()}"
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(exc).__name__}: {first}"[:300]
