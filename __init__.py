"""kvrouter: a KV-cache-aware request router for LLM inference clusters.

The source folders at the top of the repository (``actors/``, ``journal/``, ``api/``,
``simulations/``) are installed as ``kvrouter.actors``, ``kvrouter.journal``, ``kvrouter.api`` and
``kvrouter.simulations`` (``package-dir`` in ``pyproject.toml``), so the distribution claims no
generic top-level import names. This file is the ``kvrouter`` package itself.

It exports the in-process router (``from kvrouter import Router``, README "Embedding the router
in-process"), imported on first use so that importing a subpackage (the pure core, a forked snapshot
child) does not load the whole service.
"""

from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvrouter.actors.core.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, KvBatch
    from kvrouter.actors.core.router_config import RouterConfig
    from kvrouter.actors.kv_ingest import IN_PROCESS_KV_EVENTS
    from kvrouter.api.embedded import Router, RouterClosed, RouterError
    from kvrouter.api.embedded_thread import AsyncioRouter, BlockingRouter

try:
    __version__ = version("kvrouter")
except PackageNotFoundError:  # pragma: no cover - running from a source tree that was never installed
    __version__ = "0+unknown"

# name -> the module that defines it
_EXPORTS = {
    "Router": "kvrouter.api.embedded",
    "RouterError": "kvrouter.api.embedded",
    "RouterClosed": "kvrouter.api.embedded",
    "AsyncioRouter": "kvrouter.api.embedded_thread",
    "BlockingRouter": "kvrouter.api.embedded_thread",
    "RouterConfig": "kvrouter.actors.core.router_config",
    "IN_PROCESS_KV_EVENTS": "kvrouter.actors.kv_ingest",
    "KvBatch": "kvrouter.actors.core.kv_wire",
    "BlockStored": "kvrouter.actors.core.kv_wire",
    "BlockRemoved": "kvrouter.actors.core.kv_wire",
    "AllBlocksCleared": "kvrouter.actors.core.kv_wire",
}
__all__ = [
    "IN_PROCESS_KV_EVENTS",
    "AllBlocksCleared",
    "AsyncioRouter",
    "BlockRemoved",
    "BlockStored",
    "BlockingRouter",
    "KvBatch",
    "Router",
    "RouterClosed",
    "RouterConfig",
    "RouterError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvrouter' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value
