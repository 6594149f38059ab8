"""How to (re)build the optimizer once the stage has put the parameters in their final form.

FSDP2 replaces each parameter by a sharded DTensor parameter, and stage 1 needs to build its
optimizer over a subset of them, so an optimizer created before wrapping must be rebuilt. A
recipe records the optimizer class, its defaults and its param groups by parameter *name*; it is
made from the config's ``optimizer`` section, from a callable ``params -> optimizer``, or from the
caller's optimizer instance (the Trainer's).

A Muon section also splits every group into its Muon and Adam halves by parameter name and shape
(:func:`hf_zero.optim.muon.muon_param_groups`), as DeepSpeed's engine does; the names are the
model's, which FSDP2 keeps, so the split is the same at every stage.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hf_zero.config.schema import OptimizerConfig

__all__ = ["OptimizerRecipe", "constructor_defaults"]


_MISSING = object()


def constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The keyword arguments that rebuild ``optimizer``:
    ``type(optimizer)(params, **constructor_defaults(optimizer))``.

    ``optimizer.defaults`` restricted to what its class's ``__init__`` accepts (``defaults`` may
    hold internal keys such as AdamW's ``decoupled_weight_decay``), plus the constructor arguments
    an optimizer keeps outside ``defaults``: as an attribute of the same name (torchao's low-bit
    AdamW keeps ``block_size``, which transformers sets to 256 against the class's 128) or in a
    bitsandbytes-style ``args`` namespace (``min_8bit_size``, ``percentile_clipping``). Without
    them the rebuilt optimizer would silently differ from the user's.
    """
    accepted = inspect.signature(type(optimizer).__init__).parameters
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    out = {k: v for k, v in optimizer.defaults.items() if takes_kwargs or (k in accepted and k != "params")}
    namespace = getattr(optimizer, "args", None)
    for name, parameter in accepted.items():
        if name in ("self", "params") or name in out or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        value = getattr(optimizer, name, _MISSING)
        if value is _MISSING and namespace is not None and not isinstance(namespace, (dict, list, tuple)):
            value = getattr(namespace, name, _MISSING)
        if value is not _MISSING and not callable(value):
            out[name] = value
    return out


def _stepped(state: dict[str, Any]) -> bool:
    """Whether a parameter's optimizer state comes from a step. Some optimizers fill their state
    at construction (torch's Adagrad: ``step`` 0 and ``sum`` at ``initial_accumulator_value``;
    APOLLO: a per-parameter ``seed`` number); that state is rebuilt identically with the optimizer,
    so it does not count. Without a step counter, state that a step made holds tensors (SGD's
    ``momentum_buffer``)."""
    if not state:
        return False
    step = state.get("step")
    if step is None:
        return any(isinstance(value, torch.Tensor) for value in state.values())
    return float(step) > 0


@dataclass
class OptimizerRecipe:
    """A way to build the optimizer from a ``name -> parameter`` map."""

    build: Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
    """Makes the optimizer from param groups (dicts with ``params`` plus hyper-parameters)."""
    groups: list[tuple[list[str], dict[str, Any]]] = field(default_factory=list)
    """Parameter names and hyper-parameters of each group (empty: one group, all trainable params)."""
    optimizer_class: type[torch.optim.Optimizer] | None = None
    defaults: dict[str, Any] = field(default_factory=dict)
    split: Callable[[list[dict[str, Any]], dict[int, str]], list[dict[str, Any]]] | None = None
    """Rewrites the groups given ``id(param) -> name`` (Muon's halves); None keeps them."""

    @classmethod
    def from_config(cls, section: OptimizerConfig) -> OptimizerRecipe:
        from hf_zero.optim.muon import muon_param_groups
        from hf_zero.optim.optimizers import build_optimizer

        split = muon_param_groups if section.type == "muon" else None
        return cls(build=lambda groups: build_optimizer(section, groups), split=split)

    @classmethod
    def from_callable(cls, fn: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]) -> OptimizerRecipe:
        return cls(build=lambda groups: fn(groups))

    @classmethod
    def from_instance(cls, optimizer: torch.optim.Optimizer, model: nn.Module) -> OptimizerRecipe:
        """Record ``optimizer``'s class, defaults and groups so it can be rebuilt on new params.

        Raises:
            ValueError: the optimizer holds a parameter that is not in ``model``, or already has
                state (a stepped optimizer cannot be moved onto sharded parameters).
        """
        if any(_stepped(s) for s in optimizer.state.values()):
            raise ValueError(
                "the optimizer passed to hf_zero.initialize() has already been stepped; pass a fresh "
                "optimizer (its state is rebuilt on the sharded parameters) or load state afterwards"
            )
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
        groups = []
        for group in optimizer.param_groups:
            missing = [tuple(p.shape) for p in group["params"] if id(p) not in names]
            if missing:
                raise ValueError(
                    f"the optimizer holds {len(missing)} parameter(s) (shapes {missing[:3]}) that are "
                    "not parameters of the model given to hf_zero.initialize()"
                )
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append(([names[id(p)] for p in group["params"]], hyper))
        opt_cls = type(optimizer)
        defaults = constructor_defaults(optimizer)

        def build(new_groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
            return opt_cls(new_groups, **defaults)

        return cls(build=build, groups=groups, optimizer_class=opt_cls, defaults=defaults)

    def param_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        """This recipe's groups over ``model``'s current parameters (trainable ones only)."""
        from hf_zero.engine.scalar_params import lifted_keys

        params = dict(model.named_parameters(remove_duplicate=True))
        # Groups recorded before 0-dim params were lifted name them by their original names. Those
        # aliases only resolve names: the default group takes each parameter once (listed twice, the
        # optimizer would apply a lifted scalar's update twice per step).
        by_name = dict(params)
        for stored, original in lifted_keys(model).items():
            by_name.setdefault(original, params[stored])
        if not self.groups:
            groups = [{"params": [p for p in params.values() if p.requires_grad]}]
        else:
            groups = [
                {"params": [by_name[n] for n in names if by_name[n].requires_grad], **hyper}
                for names, hyper in self.groups
            ]
        if self.split is not None:
            names = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
            groups = self.split(groups, names)
        return groups
