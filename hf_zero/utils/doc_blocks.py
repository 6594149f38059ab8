"""Generated blocks in the docs: ``<!-- generated: NAME -->`` ... ``<!-- end generated -->``.

Pages whose tables come from the code (docs/config_reference.md, docs/deepspeed_compat.md) keep
them between these markers; a generator rewrites them and a test checks the page is current.
"""

from __future__ import annotations

import re

__all__ = ["replace_generated_blocks"]

_BLOCK = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- end generated -->)", re.S)


def replace_generated_blocks(text: str, blocks: dict[str, str]) -> str:
    """``text`` with the body of every generated block replaced by ``blocks[NAME]``.

    Raises:
        KeyError: the page has a block that ``blocks`` does not generate (names the known ones).
    """

    def replace(match: re.Match) -> str:
        name = match.group(2)
        if name not in blocks:
            raise KeyError(f"docs block {name!r} has no generator (known: {', '.join(blocks)})")
        return match.group(1) + blocks[name] + match.group(4)

    return _BLOCK.sub(replace, text)
