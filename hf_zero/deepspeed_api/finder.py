"""The import hook that makes ``import deepspeed`` give hf_zero's DeepSpeed API.

A meta-path finder placed *last* on ``sys.meta_path``: it is asked only for names no other finder
found, so a DeepSpeed installed later (or a local ``deepspeed/`` folder) still wins, and it is not
installed at all when one is importable (``install.py``). Modules are created when first imported
and filled from :data:`~hf_zero.deepspeed_api.symbols.SYMBOLS`; each module's ``__getattr__``
imports the implementation on first use. A name outside the table fails with an ImportError
(``DeepSpeedApiError``) that names it and what hf_zero offers instead; ``import deepspeed.ops.adam``
names ``deepspeed.ops.adam``, not only its first missing parent.

It also serves ``transformers.deepspeed``, the module transformers removed in 4.46.0, as a view of
``transformers.integrations.deepspeed`` (so ``from transformers.deepspeed import
is_deepspeed_zero3_enabled`` gets hf_zero's answer).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
from typing import Any

from hf_zero.deepspeed_api import symbols

__all__ = ["DeepSpeedApiError", "DeepSpeedApiFinder", "TRANSFORMERS_ALIAS"]

TRANSFORMERS_ALIAS = "transformers.deepspeed"
_ROOT = "deepspeed"


class DeepSpeedApiError(ModuleNotFoundError):
    """A ``deepspeed`` module or attribute that hf_zero's DeepSpeed API does not provide.

    An ImportError (``ModuleNotFoundError``), so that ``try: import deepspeed.ops.adam except
    ImportError:`` falls back as without DeepSpeed; raised for attributes too, so that ``from
    deepspeed import initialize`` keeps its message (Python replaces an AttributeError's).
    """


def _requested_name(name: str) -> str:
    """The full dotted name being imported when the import system asks for its parent ``name``
    (``deepspeed.ops.adam`` while importing ``deepspeed.ops``), else ``name``."""
    requested = name
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_find_and_load" and code.co_filename.startswith("<frozen importlib"):
            candidate = frame.f_locals.get("name")
            if isinstance(candidate, str) and candidate.startswith(name + "."):
                requested = candidate
        frame = frame.f_back
    return requested


def _module_getattr(module_name: str, table: dict[str, str]):
    """``__getattr__`` of a namespace module: table entries, submodules, or the clear error."""

    def __getattr__(attr: str) -> Any:
        if attr in table:
            impl_module, _, impl_attr = table[attr].partition(":")
            value = getattr(importlib.import_module(impl_module), impl_attr)
            setattr(sys.modules[module_name], attr, value)  # resolved once
            return value
        child = f"{module_name}.{attr}"
        if child in symbols.modules():
            return importlib.import_module(child)
        if attr.startswith("_"):  # probes by tools (``__wrapped__``, ``_fields``): a plain AttributeError
            raise AttributeError(f"module {module_name!r} has no attribute {attr!r}")
        raise DeepSpeedApiError(symbols.advice_for(child), name=child)

    return __getattr__


def _transformers_getattr(attr: str) -> Any:
    # Read live, so that hf_zero's is_deepspeed_zero3_enabled (set on the real module) is what
    # ``transformers.deepspeed`` gives.
    return getattr(importlib.import_module("transformers.integrations.deepspeed"), attr)


class DeepSpeedApiFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``deepspeed`` and its submodules, and ``transformers.deepspeed``; loads them."""

    def __repr__(self) -> str:  # shown in module reprs: <module 'deepspeed' (hf_zero's DeepSpeed API)>
        return "hf_zero's DeepSpeed API"

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname == TRANSFORMERS_ALIAS:
            return importlib.util.spec_from_loader(fullname, self)
        if fullname == _ROOT or fullname.startswith(_ROOT + "."):
            package = fullname == _ROOT or any(m.startswith(fullname + ".") for m in symbols.modules())
            return importlib.util.spec_from_loader(fullname, self, is_package=package)
        return None

    def create_module(self, spec):
        return None  # the import system's default module object

    def exec_module(self, module: types.ModuleType) -> None:
        name = module.__name__
        if name == TRANSFORMERS_ALIAS:
            module.__doc__ = "transformers 4's module (removed in 4.46.0): a view of transformers.integrations.deepspeed."
            module.__getattr__ = _transformers_getattr
            return
        if name not in symbols.modules():
            raise DeepSpeedApiError(symbols.advice_for(_requested_name(name)), name=name)
        table = symbols.attributes(name)
        children = sorted(m.rpartition(".")[2] for m in symbols.modules() if m.rpartition(".")[0] == name)
        module.__doc__ = f"hf_zero's DeepSpeed API: {name} (see docs/deepspeed_compat.md)."
        module.__all__ = sorted(table)
        module.__getattr__ = _module_getattr(name, table)
        module.__dir__ = lambda: sorted({*table, *children, "__doc__", "__name__"})
        module.__hf_zero_deepspeed_api__ = True
