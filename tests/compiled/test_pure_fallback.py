"""Without a C compiler the install still works, pure Python; a compiled module built from an edited source is
reported stale (and the suite fails on it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvrouter.compiled import COMPILED_MODULES, PURE_ENV

REPO = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter: which modules are compiled, and does the index work.
PROBE = """
import json
from kvrouter.compiled import COMPILED_MODULES, is_compiled, status
from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.core.kv_index import KvIndex, Tier
import importlib
index = KvIndex()
index.apply_stored(WorkerRank(1, 0), Tier.DEVICE, None, [(11, 1), (12, 2)])
import kvrouter
print(json.dumps({
    "package": kvrouter.__file__,
    "status": status(),
    "compiled": [m for m in COMPILED_MODULES if is_compiled(importlib.import_module(m))],
    "match": index.find_matches([1, 2, 3])[WorkerRank(1, 0)].device,
}))
"""


def probe(env: dict[str, str], path: Path | None = None) -> dict[str, object]:
    full_env = {**os.environ, **env}
    if path is not None:
        full_env["PYTHONPATH"] = str(path)
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=full_env, capture_output=True, text=True, check=True, cwd=path or REPO
    )
    return json.loads(out.stdout)


def test_an_install_without_a_compiler_is_pure_python_and_works(tmp_path: Path) -> None:
    """``CC=false``: the build finds no working compiler, says so, and installs the .py modules only."""
    # A copy of the sources: the repository's own build/ may hold compiled modules from an earlier install.
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "*.so", "__pycache__"))
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-v",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            str(source),
        ],
        # Without KVROUTER_PURE_PYTHON, which would skip the compiler check (the suite may run with it set).
        env={**{k: v for k, v in os.environ.items() if k != PURE_ENV}, "CC": "false", "PIP_NO_INDEX": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    assert "no working C compiler" in build.stdout + build.stderr
    (wheel,) = wheels.glob("kvrouter-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        assert not [n for n in names if n.endswith((".so", ".pyd", ".c"))]
        for module in COMPILED_MODULES:
            assert module.replace(".", "/") + ".py" in names
            # A module's .pxd is installed beside its .py: the run-time check that a compiled module is current
            # hashes both, as the build did (without it, an installed module ran pure: "source changed").
            if (REPO / (module.split(".", 1)[1].replace(".", "/") + ".pxd")).exists():
                assert module.replace(".", "/") + ".pxd" in names, module
        assert json.loads(archive.read("kvrouter/_compiled_manifest.json")) == {}
        archive.extractall(tmp_path / "site")
    found = probe({}, tmp_path / "site")
    assert str(found["package"]).startswith(str(tmp_path / "site"))
    assert found["compiled"] == []
    assert set(found["status"].values()) == {"pure: not compiled at install"}  # type: ignore[union-attr]
    assert found["match"] == 2


def test_no_compiled_module_is_stale() -> None:
    """A compiled module built from a source edited since would run old code: the suite refuses to test it."""
    from kvrouter import compiled

    stale = [module for module, how in compiled.status().items() if how == compiled.STALE]
    assert stale == [], f"{stale}: {compiled.STALE}"


def test_an_edited_source_is_reported_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvrouter import compiled

    digests = {module: compiled.source_digest(module) for module in COMPILED_MODULES}
    digests["kvrouter.actors.core.node_table"] = "edited since"
    monkeypatch.setattr(compiled, "_manifest", lambda: digests)
    monkeypatch.setattr(compiled, "_extension_path", lambda module: Path(module))
    status = compiled.status()
    assert status["kvrouter.actors.core.node_table"] == compiled.STALE
    assert status["kvrouter.actors.core.hashing"] == "compiled"
