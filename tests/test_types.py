"""mypy over the ``kvrouter`` package, as part of README's test command (so CI enforces it).

Strict on the pure core, the journal and the domain's persistence, normal elsewhere: see ``[tool.mypy]`` in
pyproject.toml. The source folders are installed under ``kvrouter`` through setuptools' ``package-dir``, which
mypy cannot follow from the repository root, so the check runs in a temporary directory holding a ``kvrouter/``
folder of symlinks to them.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"


def subpackage_folders() -> list[str]:
    """The top-level source folders installed as ``kvrouter.<folder>`` (from pyproject's package list)."""
    packages = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["packages"]
    return sorted({name.split(".")[1] for name in packages if name.startswith("kvrouter.")})


@pytest.fixture(scope="module")
def package_view(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory where ``import kvrouter`` finds the repository's sources; its mypy cache is shared by the
    tests of this module, so the planted-error runs re-check only what the planted line touches."""
    view = tmp_path_factory.mktemp("mypy-view")
    package = view / "kvrouter"
    package.mkdir()
    for module in ROOT.glob("*.py"):  # the package's own modules (__init__, compiled), not the build script
        if module.name != "setup.py":
            (package / module.name).symlink_to(module)
    for folder in subpackage_folders():
        (package / folder).symlink_to(ROOT / folder, target_is_directory=True)
    return view


def run_mypy(view: Path, *options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(PYPROJECT),
            "--cache-dir",
            str(view / ".mypy_cache"),
            *options,
            "-p",
            "kvrouter",
        ],
        cwd=view,
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_package_type_checks(package_view: Path) -> None:
    result = run_mypy(package_view)
    assert result.returncode == 0, result.stdout + result.stderr
    # Every module of every installed folder was checked (a folder mypy could not see would pass silently).
    sources = len([p for p in ROOT.glob("*.py") if p.name != "setup.py"]) + sum(
        len(list((ROOT / folder).rglob("*.py"))) for folder in subpackage_folders()
    )
    assert f"no issues found in {sources} source files" in result.stdout


# (appended text, its line that mypy reports, the error code)
PLAIN_ERROR = ('def _planted() -> int:\n    return "not a number"\n', 2, "return-value")
UNTYPED_DEF = ("def _planted(value):\n    return value\n", 1, "no-untyped-def")


@pytest.mark.parametrize(
    ("module", "planted"),
    [
        ("api/http/app.py", PLAIN_ERROR),
        ("actors/kv_ingest.py", PLAIN_ERROR),
        ("actors/core/slots.py", UNTYPED_DEF),
        ("journal/frames.py", UNTYPED_DEF),
        ("actors/persistence/codec.py", UNTYPED_DEF),
    ],
    ids=["plain-api", "plain-actors", "strict-core", "strict-journal", "strict-persistence"],
)
def test_a_type_error_fails_the_check(
    package_view: Path, tmp_path: Path, module: str, planted: tuple[str, int, str]
) -> None:
    """A module with one bad function appended (mypy reads it in place of the real file) fails the check at
    that line: a plain error anywhere, an unannotated function in the strict packages."""
    text, line_in_text, code = planted
    source = (ROOT / module).read_text()
    shadow = tmp_path / "shadow.py"
    shadow.write_text(source + "\n\n" + text)
    line = source.count("\n") + 2 + line_in_text
    result = run_mypy(package_view, "--shadow-file", f"kvrouter/{module}", str(shadow))
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [row for row in result.stdout.splitlines() if ": error: " in row]
    assert len(errors) == 1, result.stdout
    assert errors[0].startswith(f"kvrouter/{module}:{line}: error: "), errors[0]
    assert errors[0].endswith(f"[{code}]"), errors[0]
