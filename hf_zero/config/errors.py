"""Errors and warnings raised while reading a DeepSpeed-style config.

Every message names where the config came from (a file path, ``<dict>`` or ``<json string>``), the
dotted key, the offending value and what to write instead, so a user can fix the file without
reading hf_zero's code. Problems found in one pass are collected and raised together.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

__all__ = ["ZeroConfigError", "ZeroConfigWarning", "format_problem", "show_value"]


def show_value(value: Any) -> str:
    """Render a config value the way the user wrote it (JSON spelling: ``"two"``, ``true``, ``[0.9, 0.99]``)."""
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return repr(value)


def format_problem(source: str, key: str | None, value: Any, issue: str, fix: str | None = None) -> str:
    """Build one problem line: ``<source>: <key>=<value> <issue>; <fix>``.

    Args:
        source: Where the config came from (file path, ``<dict>``, ``<json string>``).
        key: Dotted key (``zero_optimization.stage``); None for problems about the whole document.
        value: The offending value (rendered as JSON).
        issue: What is wrong, phrased to follow the value (``"is not one of 0, 1, 2, 3"``).
        fix: What to do instead; omitted when None.

    Returns:
        The message line.
    """
    head = f"{source}: " if key is None else f"{source}: {key}={show_value(value)} "
    line = head + issue
    if fix:
        line += f"; {fix}"
    return line


class ZeroConfigError(ValueError):
    """A config that hf_zero cannot use.

    ``problems`` holds one line per problem (each names the source, key, value and fix); ``str(err)``
    joins them. Subclasses ``ValueError`` so code that catches the HF integration's ``ValueError``
    for DeepSpeed config mismatches keeps working.
    """

    def __init__(self, problems: str | Iterable[str]):
        self.problems: list[str] = [problems] if isinstance(problems, str) else list(problems)
        if not self.problems:
            self.problems = ["invalid config"]
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = f"{len(self.problems)} problems in the config:\n" + "\n".join(
                f"- {p}" for p in self.problems
            )
        super().__init__(message)


class ZeroConfigWarning(UserWarning):
    """Issued instead of an error for unknown keys when a config is parsed with ``strict=False``."""
