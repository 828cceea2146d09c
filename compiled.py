"""Which core modules run compiled, and the pure-Python oracle the tests compare them with.

``pip install .`` compiles the modules in ``COMPILED_MODULES`` with Cython when a C compiler works
(``setup.py``): each is compiled from its own ``.py`` under its own name, and Python's import order puts an
extension module before the ``.py`` beside it, so nothing imports them differently and no import hook is
involved. Their ``.py`` files stay installed and run when no compiled module was built (no compiler, or
``KVROUTER_PURE_PYTHON=1`` at install time).

The build records a SHA-256 of each source (``.py`` and ``.pxd``): ``status()`` says, per module, whether it
runs compiled, is pure, or was compiled from a source edited since (an editable install: rerun ``pip install
-e .``); the test suite fails on a stale module, so a developer never measures or tests old code unknowingly.

The pure modules are the oracle: ``tests/compiled`` loads them next to the compiled ones (``load_pure``) and
checks that both give identical results.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

COMPILED_MODULES = (
    "kvrouter.actors.core.node_table",
    "kvrouter.actors.core.trie",
    "kvrouter.actors.core.kv_index",
    "kvrouter.actors.core.hashing",
    "kvrouter.actors.core.selection",
    "kvrouter.actors.core.kv_batch_reader",
    "kvrouter.api.bodies.select_body_reader",
)
# Compiled modules that call another's C functions (cimported through its .pxd): they can run compiled only
# while it does, and their pure twins import its pure twin (``load_pure``).
CIMPORTS = {
    "kvrouter.actors.core.trie": ("kvrouter.actors.core.node_table",),
    "kvrouter.actors.core.kv_index": ("kvrouter.actors.core.node_table",),
}
PURE_ENV = "KVROUTER_PURE_PYTHON"  # at install time: build no compiled module
MANIFEST = "_compiled_manifest.json"
_PACKAGE_DIR = Path(__file__).resolve().parent


def source_path(module: str) -> Path:
    """The ``.py`` of a kvrouter module (``kvrouter.actors.core.trie`` -> ``<package>/actors/core/trie.py``)."""
    return _PACKAGE_DIR.joinpath(*module.split(".")[1:]).with_suffix(".py")


def source_digest(module: str) -> str:
    """SHA-256 of the module's ``.py`` and of its ``.pxd`` (the Cython types) when it has one, as the build
    records it: editing either makes the compiled module stale."""
    source = source_path(module)
    digest = hashlib.sha256(source.read_bytes())
    pxd = source.with_suffix(".pxd")
    if pxd.exists():
        digest.update(pxd.read_bytes())
    return digest.hexdigest()


def _extension_path(module: str) -> Path | None:
    stem = source_path(module).with_suffix("")
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = stem.with_name(stem.name + suffix)
        if candidate.exists():
            return candidate
    return None


def _manifest() -> dict[str, str]:
    try:
        data = json.loads((_PACKAGE_DIR / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


STALE = "stale: its source changed since it was compiled (run pip install -e . again)"


def status() -> dict[str, str]:
    """Per module: ``compiled``, ``pure: not compiled at install``, or ``STALE`` (for tests and operators)."""
    digests = _manifest()
    out = {}
    for module in COMPILED_MODULES:
        if _extension_path(module) is None:
            out[module] = "pure: not compiled at install"
        elif digests.get(module) != source_digest(module):
            out[module] = STALE
        else:
            out[module] = "compiled"
    return out


def is_compiled(module: ModuleType) -> bool:
    """The module object was loaded from an extension module, not from its ``.py``."""
    return isinstance(getattr(module, "__loader__", None), importlib.machinery.ExtensionFileLoader)


def load_pure(module: str, alias: str) -> ModuleType:
    """A fresh instance of ``module`` run from its ``.py`` and registered as ``alias`` (the tests' oracle). The
    modules it cimports when compiled are pure too: their pure twins (``<alias's package>.<name>``) stand in for
    them while it imports."""
    found = sys.modules.get(alias)
    if found is not None:
        return found
    package = alias.rpartition(".")[0]
    twins = {
        dep: load_pure(dep, f"{package}.{dep.rsplit('.', 1)[1]}" if package else f"{alias}_{dep.rsplit('.', 1)[1]}")
        for dep in CIMPORTS.get(module, ())
    }
    spec = importlib.util.spec_from_file_location(alias, source_path(module))
    assert spec is not None and spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[alias] = loaded
    saved = {dep: sys.modules.get(dep) for dep in twins}
    sys.modules.update(twins)
    try:
        spec.loader.exec_module(loaded)
    finally:
        for dep, previous in saved.items():
            if previous is None:
                sys.modules.pop(dep, None)
            else:
                sys.modules[dep] = previous
    return loaded
