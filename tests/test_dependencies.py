"""Every third-party module the code imports comes from a distribution pyproject.toml declares.

A module that only arrives as someone else's dependency (``outcome`` through trio, say) works until that
dependency stops pulling it in; the package itself may use only ``[project].dependencies`` (a plain
``pip install .`` must run it), the tests and benchmarks also the ``test`` extra.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
FIRST_PARTY = {"kvrouter", "tests", "benchmarks"}


def declared(*extras: str) -> set[str]:
    """Normalised names of the runtime dependencies, plus those of the given extras."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra in extras:
        specs += project["optional-dependencies"][extra]
    return {_distribution_name(spec) for spec in specs}


def _distribution_name(spec: str) -> str:
    """``"pyzmq==27.3.0"`` -> ``"pyzmq"`` (PEP 508's name comes first)."""
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec)
    assert match, f"unreadable requirement {spec!r}"
    return _normalise(match.group())


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _module_level(tree: ast.AST) -> Iterable[ast.AST]:
    """The nodes of ``tree`` outside function bodies: what runs when the module is imported."""
    for node in ast.iter_child_nodes(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield node
            yield from _module_level(node)


def top_level_imports(path: Path, *, lazy: bool = True) -> set[str]:
    """The top-level names ``path`` imports absolutely, leaving out the standard library and modules that sit
    beside it (scripts and test helpers import their siblings by plain name). ``lazy=False``: only the imports
    that run when the module is imported (not those inside a function)."""
    names = set()
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree) if lazy else _module_level(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return {
        name
        for name in names
        if name not in sys.stdlib_module_names
        and name not in FIRST_PARTY
        and not (path.parent / f"{name}.py").exists()
        and not (path.parent / name / "__init__.py").exists()
    }


def undeclared_imports(
    files: Iterable[Path], allowed: set[str], lazily_allowed: AbstractSet[str] = frozenset()
) -> dict[str, list[str]]:
    """Imported name -> the files importing it, for each name no allowed distribution provides
    (``lazily_allowed``: also allowed inside a function, where an optional extra's package is imported on use)."""
    providers = packages_distributions()
    found: dict[str, list[str]] = {}
    for path in files:
        eager = top_level_imports(path, lazy=False)
        for name in top_level_imports(path):
            can_use = allowed if name in eager else allowed | lazily_allowed
            if not {_normalise(dist) for dist in providers.get(name, [])} & can_use:
                found.setdefault(name, []).append(str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path))
    return found


def python_files(*folders: str) -> list[Path]:
    files = [path for folder in folders for path in sorted((ROOT / folder).rglob("*.py"))]
    assert files, folders
    return files


def test_the_package_imports_only_its_runtime_dependencies() -> None:
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    folders = sorted({name.split(".")[1] for name in packages if name.startswith("kvrouter.")})
    files = [ROOT / "__init__.py", *python_files(*folders)]
    extras = [extra for extra in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"] if extra != "test"]  # fmt: skip
    # An optional extra's package (tokenizers, Jinja2 of the hf extra) only inside the function that needs it.
    assert undeclared_imports(files, declared(), declared(*extras) - declared()) == {}


def test_tests_and_benchmarks_import_only_declared_dependencies() -> None:
    assert undeclared_imports(python_files("tests", "benchmarks"), declared("test")) == {}


def test_an_import_that_arrives_only_transitively_is_reported(tmp_path: Path) -> None:
    """sortedcontainers and idna are installed (trio needs them) but declared nowhere; a sibling module, the
    standard library and the declared trio are fine; the test extra does not count for the package."""
    (tmp_path / "helper.py").write_text("")
    module = tmp_path / "module.py"
    module.write_text(
        "import os.path\nimport sortedcontainers\nimport trio.lowlevel\nfrom idna import encode\n"
        "from helper import x\nfrom . import sibling\nimport hypothesis\n"
    )
    assert undeclared_imports([module], declared()) == {
        "sortedcontainers": [str(module)],
        "idna": [str(module)],
        "hypothesis": [str(module)],
    }
    assert set(undeclared_imports([module], declared("test"))) == {"sortedcontainers", "idna"}


def test_an_optional_extras_import_is_allowed_only_inside_a_function(tmp_path: Path) -> None:
    """``pip install .`` must import every module: an extra's package is imported where it is used, on use."""
    lazy, eager = tmp_path / "lazy.py", tmp_path / "eager.py"
    lazy.write_text("def render():\n    import jinja2\n")
    eager.write_text("import jinja2\n")
    assert undeclared_imports([lazy, eager], declared(), {"jinja2"}) == {"jinja2": [str(eager)]}


def constraint_pins(text: str) -> dict[str, str]:
    """``.ci/constraints.txt`` as {normalised name: version}; every non-comment line must be an exact pin."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        requirement = Requirement(line)
        (specifier,) = requirement.specifier
        assert specifier.operator == "==", f"{line!r} is not an exact pin"
        pins[_normalise(requirement.name)] = specifier.version
    return pins


def test_ci_constraints_pin_every_declared_dependency_inside_its_range() -> None:
    """pyproject.toml states compatible ranges (what a user installing kvrouter beside other packages needs);
    CI and README install the exact set in .ci/constraints.txt. A range widened or narrowed without updating
    the pins, or a new dependency without a pin, fails here instead of CI resolving something untested."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = constraint_pins((ROOT / ".ci" / "constraints.txt").read_text())
    for spec in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
        requirement = Requirement(spec)
        name = _normalise(requirement.name)
        assert name in pins, f"{name} is declared but .ci/constraints.txt does not pin it"
        assert requirement.specifier.contains(pins[name]), f"{name}=={pins[name]} is outside {requirement.specifier}"
        assert not any(s.operator == "==" for s in requirement.specifier), f"{spec!r}: pin in constraints, not here"


def test_a_pin_outside_the_declared_range_is_reported() -> None:
    pins = constraint_pins("# comment\ntrio==0.36.0\n")
    assert not Requirement("trio>=0.35.0,<0.36").specifier.contains(pins["trio"])
    with pytest.raises(AssertionError, match="not an exact pin"):
        constraint_pins("trio>=0.35\n")


def test_every_source_package_is_installed() -> None:
    """A non-editable install (CI's) ships only the packages pyproject.toml lists: a new sub-package left out
    imports in the checkout and is missing once installed."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = sorted({name.split(".")[1] for name in listed if name.startswith("kvrouter.")})
    found = {
        ".".join(("kvrouter", *init.parent.relative_to(ROOT).parts))
        for folder in folders
        for init in (ROOT / folder).rglob("__init__.py")
    }
    assert found - listed == set()
