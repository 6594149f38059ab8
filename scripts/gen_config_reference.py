"""Rewrite the generated tables of docs/config_reference.md from hf_zero's key tables.

    python scripts/gen_config_reference.py          # rewrite in place
    python scripts/gen_config_reference.py --check  # exit 1 if the page is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

from hf_zero.config.reference import update_page

PAGE = Path(__file__).resolve().parents[1] / "docs" / "config_reference.md"


def main() -> int:
    text = PAGE.read_text(encoding="utf-8")
    new = update_page(text)
    if "--check" in sys.argv[1:]:
        if new != text:
            print(f"{PAGE} is out of date: run python scripts/gen_config_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
