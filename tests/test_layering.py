"""Layers: the core stays pure (no I/O, clock, randomness, logging or trio); the journal is a generic log
of bytes that knows nothing of the domain or the API; the shell (actors) never reaches up into the API;
no module imports itself through others (no import circles); no unbounded channels anywhere."""

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


def test_the_client_library_imports_nothing_of_the_service() -> None:
    """The client (and the operation table it carries, which the services read) stands alone."""
    files = sorted((ROOT / "client").rglob("*.py"))
    assert files
    forbidden = {"actors", "journal", "api", "simulations"}
    offenders = {str(p.relative_to(ROOT)): sorted(imported_modules(p) & forbidden) for p in files}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_shell_never_reaches_up_into_the_api() -> None:
    files = sorted((ROOT / "actors").rglob("*.py"))
    offenders = {str(p.relative_to(ROOT)): sorted(imported_modules(p) & {"api", "simulations"}) for p in files}
    assert {k: v for k, v in offenders.items() if v} == {}


PACKAGES = ("actors", "journal", "api", "simulations", "client")


def module_names() -> dict[str, Path]:
    """``kvrouter.actors.system`` -> its file, for every module of the four packages."""
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(("kvrouter", *parts))] = path
    return modules


def kvrouter_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The kvrouter modules ``path`` imports, anywhere in the file (TYPE_CHECKING and function bodies too:
    a circle hidden there is still a circle)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in modules else node.module)
    return {name for name in found if name in modules}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_import_circles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_circles(graph) == [["a", "b", "c"]]


def test_no_import_circles() -> None:
    modules = module_names()
    graph = {name: kvrouter_imports(path, modules) - {name} for name, path in modules.items()}
    assert "kvrouter.actors.system" in graph["kvrouter.api.main"]  # the graph is really built
    assert import_circles(graph) == []


def test_no_unbounded_memory_channels() -> None:
    pattern = re.compile(r"open_memory_channel[^(]*\(\s*(math\.inf|float\(['\"]inf)")
    sources = [p for d in ("actors", "journal", "api", "simulations") for p in (ROOT / d).rglob("*.py")]
    assert [str(p) for p in sources if pattern.search(p.read_text())] == []
