"""Which submodules become FSDP2 units: the model's transformer blocks, then the root.

The blocks are the classes a Hugging Face model lists in ``_no_split_modules`` (the same source
accelerate's FSDP auto-wrap uses). Embeddings and the LM head stay in the root unit, so tied
input/output embeddings share one sharded parameter.
"""

from __future__ import annotations

from torch import nn

__all__ = ["block_class_names", "find_wrap_units"]


def block_class_names(model: nn.Module) -> set[str]:
    """Class names listed in ``_no_split_modules`` by any submodule (works through peft wrappers)."""
    names: set[str] = set()
    for module in model.modules():
        listed = getattr(module, "_no_split_modules", None)
        if listed:
            names.update(listed)
    return names


def find_wrap_units(model: nn.Module) -> list[nn.Module]:
    """Submodules to shard one by one before the root, in post-order (innermost first).

    Falls back to the children of the model's ``nn.ModuleList`` s when it declares no blocks
    (a plain PyTorch model), and to no units at all (root only) when it has none.

    Example::

        >>> units = find_wrap_units(qwen2_model)   # the Qwen2DecoderLayer modules
    """
    names = block_class_names(model)
    units: list[nn.Module] = []
    if names:
        units = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if not units:
        for module in model.modules():
            if isinstance(module, nn.ModuleList):
                units.extend(module)
    # Nested units must be sharded before the units that contain them.
    seen: set[int] = set()
    ordered: list[nn.Module] = []
    for module in reversed(list(model.modules())):
        if any(module is u for u in units) and id(module) not in seen:
            seen.add(id(module))
            ordered.append(module)
    return ordered
