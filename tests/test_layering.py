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
    assert "kvrouter.actors.system" in graph["kvrouter.api.process.main"]  # the graph is really built
    assert import_circles(graph) == []


def test_no_unbounded_memory_channels() -> None:
    pattern = re.compile(r"open_memory_channel[^(]*\(\s*(math\.inf|float\(['\"]inf)")
    sources = [p for d in ("actors", "journal", "api", "simulations") for p in (ROOT / d).rglob("*.py")]
    assert [str(p) for p in sources if pattern.search(p.read_text())] == []


GUARDED_LIBRARIES = ("trio", "hypercorn", "wsproto")
PRODUCT = ("actors", "journal", "api", "simulations", "client")


def private_uses(source: str) -> list[str]:
    """Private names of trio, hypercorn or wsproto that ``source`` imports (a module path or an imported name
    starting with ``_``), and assignments into any third-party module it imported (monkeypatching)."""
    tree = ast.parse(source)
    found = []
    modules: dict[str, str] = {}  # local name -> third-party module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in GUARDED_LIBRARIES and _is_private(alias.name):
                    found.append(f"import {alias.name}")
                if not alias.name.startswith("kvrouter"):
                    modules[alias.asname or alias.name.split(".")[0]] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            guarded = node.module.split(".")[0] in GUARDED_LIBRARIES
            for alias in node.names:
                if guarded and (_is_private(node.module) or alias.name.startswith("_")):
                    found.append(f"from {node.module} import {alias.name}")
                if not node.module.startswith("kvrouter") and _is_module(f"{node.module}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            targets = [ast.Attribute(value=node.args[0], attr="?")] if node.args else []
        for target in targets:
            base = target
            while isinstance(base, ast.Attribute):
                base = base.value
            if base is not target and isinstance(base, ast.Name) and base.id in modules:
                found.append(f"assigns into {modules[base.id]} ({ast.unparse(target)})")
    return found


def _is_private(module: str) -> bool:
    return any(part.startswith("_") for part in module.split("."))


def _is_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def test_private_imports_and_monkeypatching_are_found() -> None:
    source = (
        "import trio._core\nfrom trio._core import wait_all_tasks_blocked\n"
        "from hypercorn.trio.task_group import _handle\n"
        "from hypercorn.protocol import ws_stream\nimport wsproto\nfrom trio import lowlevel\n"
        "ws_stream.PerMessageDeflate = object\nwsproto.x.y = 1\nsetattr(lowlevel, 'z', 2)\n"
        "from trio.testing import wait_all_tasks_blocked\nimport trio\nlocal = object()\nlocal.a = 1\n"
    )
    assert private_uses(source) == [
        "import trio._core",
        "from trio._core import wait_all_tasks_blocked",
        "from hypercorn.trio.task_group import _handle",
        "assigns into hypercorn.protocol.ws_stream (ws_stream.PerMessageDeflate)",
        "assigns into wsproto (wsproto.x.y)",
        "assigns into trio.lowlevel (lowlevel.?)",
    ]


def test_no_product_module_uses_private_names_of_trio_hypercorn_or_wsproto_or_patches_a_library() -> None:
    sources = [p for d in PRODUCT for p in (ROOT / d).rglob("*.py")] + sorted(ROOT.glob("*.py"))
    offenders = {str(p.relative_to(ROOT)): private_uses(p.read_text()) for p in sources}
    assert {path: found for path, found in offenders.items() if found} == {}


def _api_room_imports(room: str) -> set[str]:
    """The api rooms (``kvrouter.api.<room>``) that the modules of ``api/<room>/`` import."""
    found = set()
    for path in (ROOT / "api" / room).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvrouter.api."):
                found.add(node.module.split(".")[2])
    return found - {room}


def test_the_frontend_and_the_mock_worker_do_not_import_each_other() -> None:
    """What both need (the OpenAI protocol, the endpoint's default id) lives below them, not in either."""
    assert "mock_worker" not in _api_room_imports("frontend")
    assert "frontend" not in _api_room_imports("mock_worker")


def test_the_openai_protocol_and_the_request_bodies_know_no_route_stream_or_process() -> None:
    for room in ("openai", "bodies"):
        assert _api_room_imports(room) <= {"http", "bodies", "openai"}, room
