"""``deepspeed.accelerator.get_accelerator()`` (also ``deepspeed.get_accelerator``): DeepSpeed's
device abstraction, answered by torch for the device hf_zero trains on (CUDA when available, else
the CPU with gloo, as DeepSpeed's CPU accelerator).

The methods scripts call (device names, counts, seeds, memory figures, dtype support, pinning,
``synchronize``/``empty_cache``) are here; any other attribute raises an AttributeError naming it
and the torch API to use.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["get_accelerator", "HfZeroAccelerator"]

_GIB_HINT = "use torch's device API (torch.cuda, torch.accelerator)"


class HfZeroAccelerator:
    """What DeepSpeed's ``get_accelerator()`` returns, for CUDA or the CPU."""

    def __init__(self) -> None:
        self._cuda = torch.cuda.is_available()
        self._name = "cuda" if self._cuda else "cpu"
        self._communication_backend_name = "nccl" if self._cuda else "gloo"

    def __repr__(self) -> str:
        return f"<hf_zero's DeepSpeed API accelerator: {self._name}>"

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise AttributeError(f"get_accelerator().{attr} is not provided by hf_zero's DeepSpeed API: {_GIB_HINT}. "
                             "See docs/deepspeed_compat.md.")

    # -- devices
    def is_available(self) -> bool:
        return self._cuda

    def device_name(self, device_index: int | None = None) -> str:
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self._name) if device_index is None else torch.device(self._name, device_index)

    def current_device(self) -> int:
        # DeepSpeed's CPU accelerator answers the local rank.
        return torch.cuda.current_device() if self._cuda else int(os.environ.get("LOCAL_RANK", "0") or 0)

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else 1

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    # -- random
    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed) if self._cuda else torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed) if self._cuda else torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    # -- memory (bytes; 0 without an accelerator, whose memory is the host's)
    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else 0

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else 0

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._cuda else 0

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        import psutil

        return psutil.virtual_memory().total

    # -- dtypes, tensors
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return self._cuda

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float]
        if self.is_fp16_supported():
            dtypes.append(torch.half)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._cuda else False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name


_accelerator: HfZeroAccelerator | None = None


def get_accelerator() -> HfZeroAccelerator:
    """The process's accelerator object (made on first call, as DeepSpeed's)."""
    global _accelerator
    if _accelerator is None:
        _accelerator = HfZeroAccelerator()
    return _accelerator
