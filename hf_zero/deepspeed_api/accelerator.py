"""``deepspeed.accelerator.get_accelerator()`` (also ``deepspeed.get_accelerator``): DeepSpeed's
device abstraction, answered by hf_zero's device layer (``hf_zero/distributed/device.py``) for the
device hf_zero trains on: the GPU when there is one, else the CPU with gloo (as DeepSpeed's CPU
accelerator).

The methods scripts call (device names, counts, seeds, memory figures, dtype support, pinning,
``synchronize``/``empty_cache``) are here; any other attribute raises an AttributeError naming it
and the torch API to use. Memory figures are the current device's (DeepSpeed's default), in bytes,
0 without an accelerator (the memory is the host's).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hf_zero.distributed import device as accel

__all__ = ["get_accelerator", "HfZeroAccelerator"]

_TORCH_HINT = "use torch's device API (torch.cuda, torch.accelerator)"


class HfZeroAccelerator:
    """What DeepSpeed's ``get_accelerator()`` returns, for the GPU or the CPU."""

    def __init__(self) -> None:
        self._gpu = accel.accelerator_available()
        self._name = "cuda" if self._gpu else "cpu"
        self._communication_backend_name = accel.default_backend()

    def __repr__(self) -> str:
        return f"<hf_zero's DeepSpeed API accelerator: {self._name}>"

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise AttributeError(f"get_accelerator().{attr} is not provided by hf_zero's DeepSpeed API: {_TORCH_HINT}. "
                             "See docs/deepspeed_compat.md.")

    # -- devices
    def is_available(self) -> bool:
        return self._gpu

    def device_name(self, device_index: int | None = None) -> str:
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self._name) if device_index is None else torch.device(self._name, device_index)

    def current_device(self) -> int:
        # DeepSpeed's CPU accelerator answers the local rank.
        return accel.current_device().index if self._gpu else int(os.environ.get("LOCAL_RANK", "0") or 0)

    def current_device_name(self) -> str:
        return str(accel.current_device())

    def device_count(self) -> int:
        return accel.device_count() if self._gpu else 1

    def set_device(self, device_index: int) -> None:
        if self._gpu:
            accel.select_device(device_index)

    def synchronize(self, device_index: int | None = None) -> None:
        if self._gpu:
            accel.synchronize(accel.current_device() if device_index is None else self.device(device_index))

    def empty_cache(self) -> None:
        accel.empty_cache()

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    # -- random (torch.manual_seed seeds the CPU and every GPU)
    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    # -- memory (bytes, the current device's)
    def _memory(self, key: str) -> int:
        stats = accel.memory_stats()
        return 0 if stats is None else stats[key]

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self._memory("allocated")

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return self._memory("max_allocated")

    def memory_reserved(self, device_index: int | None = None) -> int:
        return self._memory("reserved")

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return self._memory("max_reserved")

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        accel.reset_peak_memory_stats()

    def total_memory(self, device_index: int | None = None) -> int:
        if self._gpu:
            return accel.device_properties(device_index or 0).total_memory
        import psutil

        return psutil.virtual_memory().total

    # -- dtypes, tensors
    def is_bf16_supported(self) -> bool:
        return accel.bf16_supported() if self._gpu else True

    def is_fp16_supported(self) -> bool:
        return self._gpu

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float]
        if self.is_fp16_supported():
            dtypes.append(torch.half)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return accel.pin(tensor)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return self._gpu and tensor.is_pinned()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return accel.is_accelerator(tensor) if self._gpu else tensor.device.type == "cpu"


_accelerator: HfZeroAccelerator | None = None


def get_accelerator() -> HfZeroAccelerator:
    """The process's accelerator object (made on first call, as DeepSpeed's)."""
    global _accelerator
    if _accelerator is None:
        _accelerator = HfZeroAccelerator()
    return _accelerator
