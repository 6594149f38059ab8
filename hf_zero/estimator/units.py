"""Parse and print memory sizes and parameter counts.

Memory sizes use **binary** units throughout: ``"24GB"``, ``"24G"``, ``"24g"`` and ``"24GiB"`` all
mean ``24 * 2**30`` bytes. That is what ``nvidia-smi`` reports (it prints MiB) and what a "24 GB"
card actually has; DIMM sizes ("128 GB" of RAM) are binary too. A bare number (``"80e9"``,
``"25769803776"``) is a byte count, so a decimal size can always be written out exactly.

Parameter counts use **decimal** suffixes, as model names do: ``"6.7B"`` is 6,700,000,000.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from hf_zero.estimator.errors import EstimatorError

__all__ = [
    "BINARY_UNITS",
    "PARAM_COUNT_SUFFIXES",
    "format_bytes",
    "format_count",
    "parse_memory_size",
    "parse_param_count",
]

BINARY_UNITS: dict[str, int] = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}
"""Multiplier per unit letter. ``KB``/``K``/``KiB`` are all 2**10: see the module docstring."""

PARAM_COUNT_SUFFIXES: dict[str, int] = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
"""Decimal multipliers for parameter counts (``7B`` = 7e9, as in model names)."""

# number, then an optional unit letter, then an optional "b"/"ib"/"B"/"iB" ("24", "24g", "24GB", "24GiB").
_SIZE_RE = re.compile(r"^\s*([0-9][0-9_.,]*(?:e[+-]?[0-9]+)?)\s*(?:([kmgtp])(i?b)?|(b))?\s*$", re.IGNORECASE)
_COUNT_RE = re.compile(r"^\s*([0-9][0-9_.,]*(?:e[+-]?[0-9]+)?)\s*([kmbt]?)\s*$", re.IGNORECASE)


def _decimal(text: str, original: str, what: str) -> Decimal:
    """``text`` ("1,234.5e3") as an exact Decimal, so "6.7B" is 6,700,000,000 and not 6,699,999,999."""
    try:
        return Decimal(text.replace(",", "").replace("_", ""))
    except InvalidOperation:
        raise EstimatorError(f"cannot read {what} {original!r}") from None


def parse_memory_size(value: str | int | float, *, what: str = "memory size") -> int:
    """Bytes in a memory size written as ``"24GB"``, ``"24GiB"``, ``"24g"``, ``"512MB"``, ``"80e9"``.

    Unit letters are binary (``G`` = 2**30, whatever the spelling); a bare number is bytes.

    Args:
        value: the size; an ``int``/``float`` is taken as bytes.
        what: how error messages name the value (e.g. ``"--gpu_memory"``).

    Returns:
        The size in bytes, rounded down to a whole byte.

    Raises:
        EstimatorError: the text is not a size, or the size is not positive. The message quotes it.

    Examples:
        >>> parse_memory_size("24GB") == parse_memory_size("24GiB") == parse_memory_size("24g") == 24 * 2**30
        True
        >>> parse_memory_size("80e9")
        80000000000
    """
    if isinstance(value, bool):
        raise EstimatorError(f"cannot read {what} {value!r}: expected a size like '24GB' or a byte count")
    if isinstance(value, (int, float)):
        number, multiplier = Decimal(str(value)), 1
    else:
        match = _SIZE_RE.match(value)
        if match is None:
            raise EstimatorError(
                f"cannot read {what} {value!r}: expected a size like '24GB', '24GiB', '24g', '512MB' or a "
                "byte count like '80e9'"
            )
        number = _decimal(match.group(1), value, what)
        multiplier = BINARY_UNITS[(match.group(2) or "").lower()]
    size = int(number * multiplier)
    if size <= 0:
        raise EstimatorError(f"{what} {value!r} must be a positive size")
    return size


def parse_param_count(value: str | int) -> int:
    """Parameters in a bare count such as ``7e9``, ``"6.7B"``, ``"500M"``, ``"1,234,567"``.

    Raises:
        EstimatorError: not a count, or not a positive whole number of parameters.

    Examples:
        >>> parse_param_count("6.7B"), parse_param_count("500M"), parse_param_count("1,234,567")
        (6700000000, 500000000, 1234567)
    """
    if isinstance(value, bool):
        raise EstimatorError(f"cannot read parameter count {value!r}")
    if isinstance(value, int):
        count = Decimal(value)
    else:
        match = _COUNT_RE.match(str(value))
        if match is None:
            raise EstimatorError(
                f"cannot read parameter count {value!r}: expected e.g. '7e9', '6.7B', '500M' or '1,234,567'"
            )
        count = _decimal(match.group(1), str(value), "parameter count") * PARAM_COUNT_SUFFIXES[match.group(2).lower()]
    if count <= 0 or count != count.to_integral_value():
        raise EstimatorError(f"parameter count {value!r} must be a positive whole number")
    return int(count)


def format_bytes(num_bytes: int) -> str:
    """``num_bytes`` in binary units with two decimals, e.g. ``"22.35 GiB"``.

    Examples:
        >>> format_bytes(0), format_bytes(1536), format_bytes(24 * 2**30)
        ('0 B', '1.50 KiB', '24.00 GiB')
    """
    if num_bytes < 1024:
        return f"{num_bytes} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        num_bytes /= 1024
        if num_bytes < 1024 or unit == "TiB":
            return f"{num_bytes:.2f} {unit}"
    raise AssertionError("unreachable")


def format_count(count: int) -> str:
    """A parameter count with a short decimal form: ``"7,615,616,512 (7.62B)"``."""
    for suffix, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if count >= size:
            return f"{count:,} ({count / size:.2f}{suffix})"
    return f"{count:,}"
