"""Layers: the core stays pure (no I/O, clock, randomness, logging or trio); the journal is a generic log
of bytes that knows nothing of the domain or the API; no unbounded channels anywhere."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN_IN_CORE = {
    "trio",
    "journal",
    "api",
    "time",
    "random",
    "uuid",
    "os",
    "socket",
    "logging",
    "datetime",
    "zmq",
    "asyncio",
    "threading",
    "secrets",
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(_package(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(_package(node.module))
    return names


def _package(module: str) -> str:
    """``kvrouter.journal.x`` -> ``journal``; ``trio.lowlevel`` -> ``trio``."""
    parts = module.split(".")
    return parts[1] if parts[0] == "kvrouter" and len(parts) > 1 else parts[0]


def test_core_imports_nothing_impure() -> None:
    core_files = sorted((ROOT / "actors" / "core").rglob("*.py"))
    assert core_files
    offenders = {str(p.relative_to(ROOT)): sorted(imported_modules(p) & FORBIDDEN_IN_CORE) for p in core_files}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_journal_imports_neither_the_domain_nor_the_api() -> None:
    journal_files = sorted((ROOT / "journal").rglob("*.py"))
    assert journal_files
    offenders = {
        str(p.relative_to(ROOT)): sorted(imported_modules(p) & {"actors", "api", "simulations"}) for p in journal_files
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_domains_persistence_does_not_reach_up_into_the_api() -> None:
    files = sorted((ROOT / "actors" / "persistence").rglob("*.py"))
    assert files
    offenders = {str(p.relative_to(ROOT)): sorted(imported_modules(p) & {"api", "simulations"}) for p in files}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_no_unbounded_memory_channels() -> None:
    pattern = re.compile(r"open_memory_channel[^(]*\(\s*(math\.inf|float\(['\"]inf)")
    sources = [p for d in ("actors", "journal", "api", "simulations") for p in (ROOT / d).rglob("*.py")]
    assert [str(p) for p in sources if pattern.search(p.read_text())] == []
