"""The throw-away venv with Dynamo 1.6.1 (``dynamo.mocker``, ``dynamo.frontend``) that the optional Dynamo tests drive
(docs/fleet.md, "Testing against Dynamo"): ``$KVROUTER_DYNAMO_PYTHON``, else ``../dynvenv`` or ``../refvenv`` beside
the repository. A test that needs it and finds none skips, saying how to make it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DYNAMO_MISSING = (
    "Dynamo 1.6.1 is not installed: make a throw-away venv (pip install ai-dynamo==1.6.1 --no-deps, then "
    "ai-dynamo-runtime==1.6.1 and its dependencies; docs/fleet.md) and set KVROUTER_DYNAMO_PYTHON"
)


def dynamo_python() -> str:
    """A python that imports ``dynamo.mocker``, ``dynamo.frontend`` and ``tokenizers``; skips the test otherwise."""
    candidates = (
        os.environ.get("KVROUTER_DYNAMO_PYTHON"),
        str(ROOT.parent / "dynvenv" / "bin" / "python"),
        str(ROOT.parent / "refvenv" / "bin" / "python"),
    )
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            probe = subprocess.run(
                [candidate, "-c", "import dynamo.mocker, dynamo.frontend, tokenizers"],
                capture_output=True,
                check=False,
                timeout=120,
            )
            if probe.returncode == 0:
                return candidate
    pytest.skip(DYNAMO_MISSING)
