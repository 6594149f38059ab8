"""Whether torch's fused optimizer kernels can step a set of tensors.

One rule for every optimizer hf_zero builds with torch's Adam, AdamW or SGD (``optimizers.py``
and the Adam half of Muon in ``muon.py``), in a module of its own so that both import it and
neither imports the other.
"""

from __future__ import annotations

import torch


def fused_supported(tensors: list[torch.Tensor]) -> bool:
    """Whether torch's fused Adam/SGD kernels can take every tensor (floating, on CPU or CUDA)."""
    return bool(tensors) and all(t.is_floating_point() and t.device.type in ("cpu", "cuda") for t in tensors)
