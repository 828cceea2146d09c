"""The build requirements are pinned, and to the same versions CI installs for the tests.

pip's ``-c .ci/constraints.txt`` does not reach the isolated environment in which ``pip install .`` builds
the package (only ``PIP_CONSTRAINT`` would), so ``[build-system] requires`` pins exact versions itself; they
must agree with the constraints, or the tests would exercise another Cython than the one that compiled.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


def pins(lines: list[str]) -> dict[str, str]:
    out = {}
    for line in lines:
        requirement = Requirement(line)
        (specifier,) = requirement.specifier
        assert specifier.operator == "==", f"{line!r} is not an exact pin"
        out[requirement.name.lower()] = specifier.version
    return out


def test_build_requirements_are_exact_pins_matching_the_ci_constraints() -> None:
    build = pins(tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"])
    constraints = pins(
        [line for line in (ROOT / ".ci" / "constraints.txt").read_text().splitlines() if line and line[0] != "#"]
    )
    assert set(build) == {"setuptools", "cython"}
    assert {name: constraints.get(name) for name in build} == build
