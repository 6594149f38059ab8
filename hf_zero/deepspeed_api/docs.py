"""The tables of ``docs/deepspeed_compat.md`` that come straight from the code's tables.

``python -m hf_zero.deepspeed_api.docs`` rewrites the page's ``<!-- generated: NAME -->`` blocks; a
unit test checks the page against :func:`render_blocks`, so the docs cannot drift from the code.
"""

from __future__ import annotations

from pathlib import Path

from hf_zero.utils.doc_blocks import replace_generated_blocks

__all__ = ["DOCS_PAGE", "render_blocks", "update_page"]

DOCS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "deepspeed_compat.md"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def render_blocks() -> dict[str, str]:
    """``{block name: markdown}`` for every generated block of the page."""
    from hf_zero.deepspeed_api.symbols import SYMBOLS, UNSUPPORTED
    from hf_zero.deepspeed_api.zero3_answer import CALLER_RULES, LIBRARY_BRANCHES
    from hf_zero.integration.versions import render_table

    symbols = [(", ".join(f"`{n}`" for n in s.names),
                f"imports; raises naming it when used. Instead: {s.maps_to}" if s.stand_in else s.maps_to)
               for s in SYMBOLS]
    refused = [(f"`{name}`", hint) for name, hint in UNSUPPORTED.items()]
    callers = [(f"`{r.pattern}`", r.answer, r.why) for r in CALLER_RULES]
    branches = [(b.library, b.where, b.branch, b.under_hf_zero) for b in LIBRARY_BRANCHES]
    return {
        "deepspeed_symbols": _table(("name (and its other names)", "under hf_zero"), symbols),
        "deepspeed_refused": _table(("name (and everything under it not listed above)", "what hf_zero offers instead"),
                                    refused),
        "zero3_callers": _table(("calling module", "answer", "why"), callers),
        "library_branches": _table(("library", "where", "its DeepSpeed branch", "under hf_zero"), branches),
        "transformers_removed": render_table(),
    }


def update_page(text: str) -> str:
    """``text`` with every generated block replaced by :func:`render_blocks`."""
    return replace_generated_blocks(text, render_blocks())


if __name__ == "__main__":
    DOCS_PAGE.write_text(update_page(DOCS_PAGE.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"updated {DOCS_PAGE}")
