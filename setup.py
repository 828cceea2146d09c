"""Build step: compile the core's hot modules with Cython where a C compiler works; else install pure Python.

Everything else (metadata, packages, dependencies) is in ``pyproject.toml``. The modules listed in
``compiled.py`` (``kvrouter.compiled``) are compiled from their own ``.py`` source under their own names, so
the extension module shadows the ``.py`` beside it at import time (extension modules come first in Python's
import order). The ``.py`` stays installed: it is the fallback, and the oracle the tests compare with.

No compiler (or ``KVROUTER_PURE_PYTHON=1`` at install time, or a build that fails for any reason): the
install still succeeds with the pure-Python modules only, and says so on stderr.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
MANIFEST = "_compiled_manifest.json"  # in the kvrouter package: module -> sha256 of the source compiled


def _compiled_modules() -> tuple[str, ...]:
    """``COMPILED_MODULES`` from ``compiled.py``, read without importing the package (it is not installed yet)."""
    tree = ast.parse((ROOT / "compiled.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["COMPILED_MODULES"]:
            return tuple(ast.literal_eval(node.value))
    raise RuntimeError("compiled.py names no COMPILED_MODULES")


def _source(module: str) -> str:
    """``kvrouter.actors.core.trie`` -> ``actors/core/trie.py`` (the package dir of ``kvrouter`` is the root)."""
    return "/".join(module.split(".")[1:]) + ".py"


def _digest(source: Path) -> str:
    """SHA-256 of a module's ``.py`` and, when it has one, its ``.pxd`` (``kvrouter.compiled.source_digest``)."""
    digest = hashlib.sha256(source.read_bytes())
    pxd = source.with_suffix(".pxd")
    if pxd.exists():
        digest.update(pxd.read_bytes())
    return digest.hexdigest()


def _say(message: str) -> None:
    print(f"kvrouter build: {message}", file=sys.stderr)


class OptionalBuildExt(build_ext):
    """Compile what can be compiled; never fail the install for it."""

    def run(self) -> None:
        if os.environ.get("KVROUTER_PURE_PYTHON"):
            _say("KVROUTER_PURE_PYTHON is set: installing the pure-Python modules only")
            self.extensions = []
        elif not self._compiler_works():
            _say("no working C compiler: installing the pure-Python modules only (slower, same behaviour)")
            self.extensions = []
        else:
            try:
                from Cython.Build import cythonize
            except ImportError:
                _say("Cython is not installed: installing the pure-Python modules only")
                self.extensions = []
            else:
                # C sources go to the build folder, never beside the .py; the Extension objects stay setuptools'
                # own (an editable install needs their extra attributes), only their sources change to the C.
                translated = cythonize(
                    self.extensions,
                    compiler_directives={"language_level": 3},
                    build_dir=str(Path(self.build_temp) / "cython"),
                    include_path=[str(self._pxd_root())],
                    quiet=True,
                )
                by_name = {ext.name: ext for ext in translated}
                for ext in self.extensions:
                    ext.sources = by_name[ext.name].sources
        self.built: list[str] = []
        if not self.extensions:  # an earlier compiled build in the same tree must not ship its stale modules
            for ext in self.distribution.ext_modules or []:
                Path(self.get_ext_fullpath(ext.name)).unlink(missing_ok=True)
        super().run()
        self._write_manifest()

    def _pxd_root(self) -> Path:
        """A folder where ``kvrouter/...`` leads to the sources, so Cython finds the ``.pxd`` beside each ``.py``.

        Cython looks a module's augmenting ``.pxd`` up by its full name (``kvrouter.actors.core.kv_index``), and
        the repository root is the ``kvrouter`` package only through setuptools' package-dir; without this the
        modules compile untyped. A symlink where the platform allows one, else copies of the ``.pxd`` files.
        """
        root = Path(self.build_temp).resolve() / "pxd"
        link = root / "kvrouter"
        if link.is_symlink() or link.exists():
            return root
        root.mkdir(parents=True, exist_ok=True)
        try:
            link.symlink_to(ROOT, target_is_directory=True)
        except OSError:
            for pxd in ROOT.glob("actors/**/*.pxd"):
                target = link / pxd.relative_to(ROOT)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(pxd.read_bytes())
            for folder in [link, *(p for p in link.rglob("*") if p.is_dir())]:
                (folder / "__init__.pxd").touch()
        return root

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # a failed module falls back to its .py; the rest stay compiled
            _say(f"{ext.name} not compiled ({exc}); its pure-Python module is used")
        else:
            self.built.append(ext.name)

    def _compiler_works(self) -> bool:
        from setuptools._distutils.ccompiler import new_compiler
        from setuptools._distutils.sysconfig import customize_compiler

        compiler = new_compiler(compiler=self.compiler, force=True)
        customize_compiler(compiler)
        with tempfile.TemporaryDirectory() as tmp:
            probe = Path(tmp) / "probe.c"
            probe.write_text("#include <Python.h>\nint kvrouter_probe(void) { return 0; }\n")
            try:
                compiler.compile([str(probe)], output_dir=tmp, include_dirs=self.include_dirs or [])
            except Exception:
                return False
        return True

    def _write_manifest(self) -> None:
        """Which modules were compiled, and from which source: a source edited since is loaded from its .py."""
        digests = {name: _digest(ROOT / _source(name)) for name in sorted(self.built)}
        package_dir = (
            ROOT if self.inplace or getattr(self, "editable_mode", False) else Path(self.build_lib) / "kvrouter"
        )
        package_dir.mkdir(parents=True, exist_ok=True)
        (package_dir / MANIFEST).write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")

    def get_outputs(self) -> list[str]:
        return [*super().get_outputs(), str(Path(self.build_lib) / "kvrouter" / MANIFEST)]


setup(
    ext_modules=[Extension(name, [_source(name)]) for name in _compiled_modules()],
    cmdclass={"build_ext": OptionalBuildExt},
)
