"""The key and layout changes ``save_pretrained`` applies to a model's weights before writing them.

transformers 5 loads some checkpoints into another layout than the files have (the experts of
Mixtral and the Qwen-MoE family are fused into one tensor per layer) and ``save_pretrained``
writes them back in the original layout (``revert_weight_conversion``), so older transformers and
other tools still read the files. hf_zero writes the weights while it gathers them, so it reverts
them the same way, in the smallest groups that allow it: one tensor at a time when the conversion
maps each tensor on its own (the expert fusions do), else a whole output shard at once, which is
what ``save_pretrained`` itself does for offloaded models. The shapes and names are worked out up
front on meta tensors, so the files' headers can be written before any weight is gathered.

transformers 4 has no such conversions; every tensor is then written as it is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["SaveKeyMap", "save_key_map"]

Entry = tuple[tuple[int, ...], torch.dtype]


class SaveKeyMap:
    """How a model's state-dict tensors become the tensors of its files.

    Args:
        entries: ``{state-dict key: (shape, dtype)}`` of the tensors to write.
        revert: transformers' ``revert_weight_conversion`` bound to the model, or None when the
            model has nothing to revert.
    """

    def __init__(self, entries: dict[str, Entry], revert: Callable[[dict], dict] | None):
        self._entries = entries
        self._revert = revert
        self._per_key: dict[str, dict[str, Entry]] | None = None
        if revert is not None:
            self._per_key = self._split_per_key()

    @property
    def converts(self) -> bool:
        """True when some tensor is renamed or re-laid out on save."""
        return self._revert is not None

    def _meta(self, keys: list[str]) -> dict[str, torch.Tensor]:
        return {k: torch.empty(self._entries[k][0], dtype=self._entries[k][1], device="meta") for k in keys}

    def _outputs_of(self, keys: list[str]) -> dict[str, Entry]:
        assert self._revert is not None
        return {k: (tuple(v.shape), v.dtype) for k, v in self._revert(self._meta(keys)).items()}

    def _split_per_key(self) -> dict[str, dict[str, Entry]] | None:
        """Each key's outputs when reverting key by key gives what reverting everything gives."""
        whole = self._outputs_of(list(self._entries))
        per_key: dict[str, dict[str, Entry]] = {}
        union: dict[str, Entry] = {}
        for key in self._entries:
            try:
                outputs = self._outputs_of([key])
            except Exception:  # a conversion that needs its partner tensors
                return None
            if set(outputs) & set(union):
                return None
            per_key[key] = outputs
            union.update(outputs)
        return per_key if union == whole else None

    def groups(self, keys: list[str]) -> list[list[str]]:
        """``keys`` (one output shard's, in order) split into groups that are reverted together."""
        if self._revert is None or self._per_key is not None:
            return [[k] for k in keys]
        return [list(keys)]

    def outputs(self, group: list[str]) -> dict[str, Entry]:
        """``{file key: (shape, dtype)}`` that ``group`` is written as, in writing order."""
        if self._revert is None:
            return {k: self._entries[k] for k in group}
        if self._per_key is not None and len(group) == 1:
            return self._per_key[group[0]]
        return self._outputs_of(group)

    def convert(self, group: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors of ``group`` as they are written (renamed, split or merged)."""
        if self._revert is None:
            return group
        return self._revert(group)


def save_key_map(module: nn.Module, entries: dict[str, Entry], *, enabled: bool = True) -> SaveKeyMap:
    """The :class:`SaveKeyMap` of ``module`` for the tensors ``entries``.

    ``enabled=False`` (an adapter, which keeps its own keys) or a transformers without
    ``revert_weight_conversion`` gives the identity.
    """
    if not enabled:
        return SaveKeyMap(entries, None)
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: nothing to revert
        return SaveKeyMap(entries, None)
    if not isinstance(module, PreTrainedModel):
        return SaveKeyMap(entries, None)

    def revert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(revert_weight_conversion(module, tensors))

    probe = {k: torch.empty(shape, dtype=dtype, device="meta") for k, (shape, dtype) in entries.items()}
    reverted = revert(dict(probe))
    unchanged = list(reverted) == list(probe) and all(reverted[k].shape == probe[k].shape for k in probe)
    return SaveKeyMap(entries, None if unchanged else revert)
