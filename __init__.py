"""kvrouter: a KV-cache-aware request router for LLM inference clusters.

The source folders at the top of the repository (``actors/``, ``journal/``, ``api/``,
``simulations/``) are installed as ``kvrouter.actors``, ``kvrouter.journal``, ``kvrouter.api`` and
``kvrouter.simulations`` (``package-dir`` in ``pyproject.toml``), so the distribution claims no
generic top-level import names. This file is the ``kvrouter`` package itself.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvrouter")
except PackageNotFoundError:  # pragma: no cover - running from a source tree that was never installed
    __version__ = "0+unknown"
