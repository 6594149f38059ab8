"""Which submodules become FSDP2 units: the model's transformer blocks, then the root.

The blocks are the classes a Hugging Face model lists in ``_no_split_modules`` (the same source
accelerate's FSDP auto-wrap uses). Embeddings and the LM head stay in the root unit, so tied
input/output embeddings share one sharded parameter.

An accelerate FSDP config may name its own policy (``fsdp_auto_wrap_policy``): hf_zero's launch
sets it for the process with :func:`use_wrap_policy` (TRANSFORMER_BASED_WRAP with class names,
SIZE_BASED_WRAP with a minimum parameter count, or NO_WRAP: the root unit only).
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["block_class_names", "find_wrap_units", "use_wrap_policy"]

_POLICY: Any = None  # a hf_zero.config.sources.accelerate_yaml.WrapSpec, or None (the default above)


def use_wrap_policy(policy: Any) -> None:
    """Make every engine built in this process from now on wrap by ``policy`` (a ``WrapSpec``:
    ``policy``, ``transformer_classes``, ``min_num_params``); None restores the default."""
    global _POLICY
    _POLICY = policy


def _size_based_units(model: nn.Module, min_num_params: int) -> list[nn.Module]:
    """torch's ``size_based_auto_wrap_policy``: bottom-up, a submodule whose parameters not already
    in a unit number at least ``min_num_params`` becomes one (ModuleList/ModuleDict never do)."""
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> int:
        left = sum(visit(child) for child in module.children())
        left += sum(p.numel() for p in module.parameters(recurse=False))
        if module is not model and left >= min_num_params and not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            units.append(module)
            return 0
        return left

    visit(model)
    return units


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
    policy = _POLICY
    if policy is not None and policy.policy == "NO_WRAP":
        return []
    if policy is not None and policy.policy == "SIZE_BASED_WRAP":
        return _size_based_units(model, int(policy.min_num_params or 0))
    names = block_class_names(model)
    if policy is not None and policy.transformer_classes:
        names = set(policy.transformer_classes)
        present = {type(m).__name__ for m in model.modules()}
        missing = sorted(names - present)
        if missing:
            raise ValueError(f"fsdp_transformer_layer_cls_to_wrap names {', '.join(missing)}, which this model does "
                             f"not have (accelerate refuses this too); its blocks are {sorted(block_class_names(model))}")
    units: list[nn.Module] = []
    if names:
        units = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if not units:
        from torch.nn.utils.parametrize import ParametrizationList

        for module in model.modules():
            # a parametrization's list (a lifted 0-dim parameter) holds functions, not blocks
            if isinstance(module, nn.ModuleList) and not isinstance(module, ParametrizationList):
                units.extend(module)
    # Nested units must be sharded before the units that contain them.
    seen: set[int] = set()
    ordered: list[nn.Module] = []
    for module in reversed(list(model.modules())):
        if any(module is u for u in units) and id(module) not in seen:
            seen.add(id(module))
            ordered.append(module)
    return ordered
