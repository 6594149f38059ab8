"""The tables of ``docs/config_reference.md`` that come straight from hf_zero's key tables.

``python scripts/gen_config_reference.py`` rewrites the marked blocks of the page; a test checks the
page against :func:`render_blocks`, so the docs cannot drift from what the parser does.
"""

from __future__ import annotations

from hf_zero.config.no_effect import NO_EFFECT_KEYS, STAGE_NO_EFFECT
from hf_zero.config.refused import UNSUPPORTED
from hf_zero.utils.doc_blocks import replace_generated_blocks

__all__ = ["render_blocks", "update_page"]



def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_blocks() -> dict[str, str]:
    """``{block name: markdown}`` for the ``no_effect``, ``stage_no_effect`` and ``refused`` tables."""
    no_effect = ["| key | why it changes nothing |", "| --- | --- |"]
    no_effect += [f"| `{key}` | {_cell(why)} |" for key, why in NO_EFFECT_KEYS.items()]
    by_stage = ["| key | no effect at stages | why |", "| --- | --- | --- |"]
    by_stage += [f"| `{key}` | {', '.join(map(str, sorted(stages)))} | {_cell(why)} |"
                 for key, (_, stages, why, _) in STAGE_NO_EFFECT.items()]
    refused = ["| key | rejected when | what to do |", "| --- | --- | --- |"]
    for key, (predicate, fix) in UNSUPPORTED.items():
        refused.append(f"| `{key}` | {getattr(predicate, 'when', 'see the code')} | {_cell(fix)} |")
    return {"no_effect": "\n".join(no_effect) + "\n", "stage_no_effect": "\n".join(by_stage) + "\n",
            "refused": "\n".join(refused) + "\n"}


def update_page(text: str) -> str:
    """``text`` with every ``<!-- generated: NAME -->`` block replaced by :func:`render_blocks`."""
    return replace_generated_blocks(text, render_blocks())
