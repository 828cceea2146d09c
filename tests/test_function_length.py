"""No product function over 80 lines: a function that long does several jobs and is read in pieces anyway.

``STILL_LONG`` names the ones not split yet, with their length: the list may only shrink (a listed function that
grew, or that is now short enough, fails too, so the list stays true)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("actors", "api", "client", "journal", "simulations")
LIMIT = 80
STILL_LONG: dict[str, int] = {}


def long_functions() -> dict[str, int]:
    found = {}
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > LIMIT:
                        found[f"{path.relative_to(ROOT)}:{node.name}"] = lines
    return found


def test_no_product_function_is_over_80_lines_but_those_listed() -> None:
    found = long_functions()
    new = {name: lines for name, lines in found.items() if name not in STILL_LONG}
    assert not new, f"functions over {LIMIT} lines: split them ({new})"
    grown = {name: lines for name, lines in found.items() if lines > STILL_LONG[name]}
    assert not grown, f"listed functions grew: {grown}"
    split = sorted(set(STILL_LONG) - set(found))
    assert not split, f"now within {LIMIT} lines: remove them from STILL_LONG ({split})"
