"""Every benchmark script still imports against today's code.

Nothing else runs them (they print figures, they are not tests), so a renamed module or function
broke ``snapshot_pause_bench.py`` unnoticed once. Importing each one executes its imports and top-level
definitions, not its ``main``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[path.name for path in SCRIPTS])
def test_benchmark_script_imports(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import their siblings (common) by name
    spec = importlib.util.spec_from_file_location(f"benchmark_{script.stem}", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    assert script.name in {"common.py", "http_client.py"} or callable(getattr(module, "main", None))


def test_a_broken_import_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = tmp_path / "broken_bench.py"
    broken.write_text("from kvrouter.api.select_service import builder\n")
    with pytest.raises(ImportError):
        test_benchmark_script_imports(broken, monkeypatch)
