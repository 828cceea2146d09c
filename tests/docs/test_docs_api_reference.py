"""docs/api.md is what docs/gen_api.py makes of the operation table: an operation added to the table without
regenerating the page fails here (run ``.venv/bin/python docs/gen_api.py``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import attrs

from kvrouter.client import table

ROOT = Path(__file__).resolve().parent.parent.parent


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_api_reference_is_current() -> None:
    page = (ROOT / "docs" / "api.md").read_text()
    assert page == generator().render(), "docs/api.md is out of date: run .venv/bin/python docs/gen_api.py"


def test_every_operation_has_its_section(monkeypatch) -> None:
    gen = generator()
    extra = attrs.evolve(table.BY_NAME["health"], name="brand_new", path="/brand_new", public=False)
    monkeypatch.setattr(gen, "OPERATIONS", (*table.OPERATIONS, extra))
    page = gen.render()
    for op in (*table.OPERATIONS, extra):
        assert f"### `{op.name}`\n\n`{op.method} {op.path}`" in page
