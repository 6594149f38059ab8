"""Names that scripts import from ``deepspeed`` at module level but that hf_zero cannot honour
(``deepspeed.initialize``, ``DeepSpeedEngine``, DeepSpeed's memory estimators...): importing them
works, so a script whose other paths run on hf_zero starts; *using* one raises
:class:`DeepSpeedApiUnavailableError`, naming it and what hf_zero offers instead.

Each stand-in is a class (``isinstance(x, DeepSpeedEngine)`` is simply false, a subclass can be
defined, ``torch.serialization.add_safe_globals([...])`` takes it); calling it, or reading a public
attribute of it, raises. The table of names is :data:`~hf_zero.deepspeed_api.symbols.SYMBOLS`
(entries whose target is this module); ``getattr(stand_ins, "deepspeed.initialize")`` builds one.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DeepSpeedApiUnavailableError", "stand_in"]


class DeepSpeedApiUnavailableError(NotImplementedError):
    """A ``deepspeed`` name that imports under hf_zero but has nothing behind it, used."""


class _StandIn(type):
    """Metaclass of the stand-ins: calling (or instantiating a subclass) and reading attributes fail."""

    _hf_zero_name: str
    _hf_zero_advice: str

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise DeepSpeedApiUnavailableError(_message(cls._hf_zero_name, cls._hf_zero_advice))

    def __getattr__(cls, attr: str) -> Any:
        # An AttributeError, so that hasattr() and tools that probe stay quiet; the message still
        # says what to use (DeepSpeed's module-like names, utils.groups, have underscore functions).
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise AttributeError(_message(f"{cls._hf_zero_name}.{attr}", cls._hf_zero_advice))

    def __repr__(cls) -> str:
        return f"<{cls._hf_zero_name}: a stand-in of hf_zero's DeepSpeed API (fails when used)>"


def _message(name: str, advice: str) -> str:
    return (f"{name} cannot be used under hf_zero's DeepSpeed API (it imports only so that scripts start): "
            f"{advice}. See docs/deepspeed_compat.md.")


_made: dict[str, type] = {}


def stand_in(name: str, advice: str) -> type:
    """The stand-in for the DeepSpeed name ``name`` (one object per name)."""
    if name not in _made:
        module, _, leaf = name.rpartition(".")
        _made[name] = _StandIn(leaf, (), {"_hf_zero_name": name, "_hf_zero_advice": advice,
                                          "__module__": module, "__qualname__": leaf,
                                          "__doc__": _message(name, advice)})
    return _made[name]


def __getattr__(name: str) -> Any:
    """``getattr(stand_ins, "deepspeed.initialize")``: the stand-in of a table entry."""
    from hf_zero.deepspeed_api.symbols import SYMBOLS

    for symbol in SYMBOLS:
        if symbol.target == f"{__name__}:{name}":
            return stand_in(name, symbol.maps_to)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
