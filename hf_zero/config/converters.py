"""Converters: ``(parser, dotted key, raw value) -> typed value``, or :data:`BAD` after recording a
problem on the parser. Numbers may be written ``2e8`` or ``"2e8"``; ``"auto"`` is kept as
:data:`~hf_zero.config.schema.AUTO` where a converter allows it.
"""

from __future__ import annotations

import copy
import difflib
import math
from collections.abc import Mapping
from typing import Any, Callable, Protocol

from hf_zero.config.schema import AUTO

BAD = object()
"""Returned by a converter that recorded a problem; the value is dropped."""

# --------------------------------------------------------------------------------------------------
# Converters: (parser, dotted key, raw value) -> typed value, or BAD after recording a problem.
# --------------------------------------------------------------------------------------------------
class ProblemSink(Protocol):
    """What a converter reports to: the parser (``parse._Parser``), which collects every problem
    of a file before raising. A protocol, so that this module does not import the parser."""

    def problem(self, key: str, value: Any, issue: str, fix: str | None = None) -> None: ...


Converter = Callable[[ProblemSink, str, Any], Any]


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


def _number(value: Any) -> int | float | None:
    """``2e8``, ``"2e8"``, ``500000000``, ``"8"`` -> a number; bools and other strings -> None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            return float(text)
        except ValueError:
            return None
    return None


def _auto_refused(p: ProblemSink, key: str, value: Any) -> Any:
    p.problem(key, value, "is not allowed here: hf_zero fills \"auto\" only for the keys in the "
              "\"auto\" table of docs/config_reference.md", "write a value")
    return BAD


def _int(
    minimum: int | None = None, maximum: int | None = None, auto: bool = False, hint: str | None = None
) -> Converter:
    def convert(p: ProblemSink, key: str, value: Any) -> Any:
        if _is_auto(value):
            return AUTO if auto else _auto_refused(p, key, value)
        n = _number(value)
        example = hint or ("write a whole number such as 8 or 2e8" + (' or "auto"' if auto else ""))
        if n is None:
            p.problem(key, value, "is not a number", example)
            return BAD
        if isinstance(n, float):
            if not math.isfinite(n) or n != int(n):
                p.problem(key, value, "is not a whole number", example)
                return BAD
            n = int(n)
        if minimum is not None and n < minimum:
            p.problem(key, value, f"is below the minimum {minimum}", hint or f"write a number >= {minimum}")
            return BAD
        if maximum is not None and n > maximum:
            p.problem(key, value, f"is above the maximum {maximum}", hint or f"write a number <= {maximum}")
            return BAD
        return n

    return convert


def _float(
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    exclusive_min: bool = False,
    auto: bool = False,
) -> Converter:
    def convert(p: ProblemSink, key: str, value: Any) -> Any:
        if _is_auto(value):
            return AUTO if auto else _auto_refused(p, key, value)
        n = _number(value)
        if n is None or not math.isfinite(n):
            p.problem(key, value, "is not a finite number", "write a number such as 1e-5" + (' or "auto"' if auto else ""))
            return BAD
        n = float(n)
        if minimum is not None and (n <= minimum if exclusive_min else n < minimum):
            p.problem(key, value, f"must be {'>' if exclusive_min else '>='} {minimum:g}", "write a value in range")
            return BAD
        if maximum is not None and n > maximum:
            p.problem(key, value, f"must be <= {maximum:g}", "write a value in range")
            return BAD
        return n

    return convert


def _bool(auto: bool = False) -> Converter:
    def convert(p: ProblemSink, key: str, value: Any) -> Any:
        if isinstance(value, bool):
            return value
        if _is_auto(value):
            return AUTO if auto else _auto_refused(p, key, value)
        p.problem(key, value, "is not a boolean",
                  "write true or false (JSON booleans, without quotes)" + (' or "auto"' if auto else ""))
        return BAD

    return convert


def _choice(choices: Mapping[str, str], *, case_sensitive: bool = False) -> Converter:
    """``choices`` maps accepted spellings to the canonical value."""

    def convert(p: ProblemSink, key: str, value: Any) -> Any:
        if isinstance(value, str):
            probe = value if case_sensitive else value.lower()
            table = choices if case_sensitive else {k.lower(): v for k, v in choices.items()}
            if probe in table:
                return table[probe]
        canon = sorted(set(choices.values()))
        close = difflib.get_close_matches(str(value).lower(), [c.lower() for c in canon], n=1, cutoff=0.5)
        fix = f'did you mean "{close[0]}"? ' if close else ""
        p.problem(key, value, "is not one of " + ", ".join(f'"{c}"' for c in canon), fix + "use one of those")
        return BAD

    return convert


def _str() -> Converter:
    def convert(p: ProblemSink, key: str, value: Any) -> Any:
        if isinstance(value, str):
            return value
        p.problem(key, value, "is not a string", "write a quoted string")
        return BAD

    return convert


def _path() -> Converter:
    def convert(p: ProblemSink, key: str, value: Any) -> Any:
        if isinstance(value, str) and value.strip():
            return value
        p.problem(key, value, "is not a folder path", 'write a path such as "/local_nvme"')
        return BAD

    return convert


def _betas(auto: bool = True) -> Converter:
    def convert(p: ProblemSink, key: str, value: Any) -> Any:
        if _is_auto(value):
            return AUTO if auto else _auto_refused(p, key, value)
        if isinstance(value, (list, tuple)) and len(value) == 2:
            nums = [_number(v) for v in value]
            if all(n is not None and 0.0 <= n < 1.0 for n in nums):
                return (float(nums[0]), float(nums[1]))
        p.problem(key, value, "is not a pair of numbers in [0, 1)", 'write two numbers such as [0.9, 0.999] or "auto"')
        return BAD

    return convert


def _dict() -> Converter:
    def convert(p: ProblemSink, key: str, value: Any) -> Any:
        if isinstance(value, dict):
            return copy.deepcopy(value)
        p.problem(key, value, "is not an object", "write {...}")
        return BAD

    return convert

