"""Which core modules run compiled, and the switch back to their pure-Python source.

``pip install .`` compiles the modules in ``COMPILED_MODULES`` with Cython when a C compiler works
(``setup.py``): each is compiled from its own ``.py`` under its own name, and Python's import order puts an
extension module before the ``.py`` beside it, so nothing imports them differently. Their ``.py`` files stay
installed; they run instead when

* no compiled module was built (no compiler, or ``KVROUTER_PURE_PYTHON=1`` at install time);
* ``KVROUTER_PURE_PYTHON=1`` is set when the process starts (for comparing, or to rule the compiled code out);
* the ``.py`` (or its ``.pxd``) changed since it was compiled (an editable install whose source was edited
  afterwards: rerun ``pip install -e .`` to compile it again). The build records a SHA-256 of each source.

The pure modules are the oracle: ``tests/compiled`` loads them next to the compiled ones (``load_pure``) and
checks that both give identical results.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
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
    "kvrouter.api.select_body_reader",
)
# Compiled modules that call another's C functions (cimported through its .pxd): they can run compiled only
# while it does, and their pure twins import its pure twin (``load_pure``).
CIMPORTS = {
    "kvrouter.actors.core.trie": ("kvrouter.actors.core.node_table",),
    "kvrouter.actors.core.kv_index": ("kvrouter.actors.core.node_table",),
}
PURE_ENV = "KVROUTER_PURE_PYTHON"
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


def status() -> dict[str, str]:
    """Per module: ``compiled``, or why its pure-Python source runs instead (for tests and operators)."""
    forced = bool(os.environ.get(PURE_ENV))
    digests = _manifest()
    out = {}
    for module in COMPILED_MODULES:
        if _extension_path(module) is None:
            out[module] = "pure: not compiled at install"
        elif forced:
            out[module] = f"pure: {PURE_ENV} is set"
        elif digests.get(module) != source_digest(module):
            out[module] = "pure: source changed since it was compiled"
        else:
            out[module] = "compiled"
    for module, needed in CIMPORTS.items():
        stale = [m for m in needed if out[m] != "compiled"]
        if out[module] == "compiled" and stale:
            out[module] = f"pure: {stale[0]}, whose C functions it calls, is not compiled"
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


class _PureSourceFinder(importlib.abc.MetaPathFinder):
    """Finds the ``.py`` of the compiled modules that must not run compiled (see the module docstring)."""

    def __init__(self, modules: frozenset[str]) -> None:
        self.modules = modules

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.modules:
            return None
        return importlib.util.spec_from_file_location(fullname, source_path(fullname))


def install_finder() -> None:
    """Route every compiled module that must run as pure Python to its ``.py`` (before any of them is imported)."""
    pure = frozenset(m for m, how in status().items() if how != "compiled" and _extension_path(m) is not None)
    if pure and not any(isinstance(f, _PureSourceFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PureSourceFinder(pure))
