"""Both services in-process on 127.0.0.1 port 0 (real hypercorn), for tests of the command routes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import attrs
import trio

from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.api.http.auth import BearerToken
from kvrouter.api.http.server import HttpSettings
from kvrouter.api.process.main import (
    ServiceHandle,
    ServiceOptions,
    run_service,
    select_service_builder,
    slot_tracker_app,
)
from kvrouter.api.streams.live import StreamSettings
from kvrouter.journal.store import Durability


@contextlib.asynccontextmanager
async def running(
    kind: str,
    data_dir: Path,
    *,
    token: str | None = None,
    seed: int = 7,
    body_timeout: float | None = None,
    config: RouterConfig | None = None,
    streams: StreamSettings | None = None,
) -> AsyncIterator[ServiceHandle]:
    """``kind``: "slot tracker" or "selection service" (``config``: its router knobs); yields the handle
    (``urls[0]`` is its URL)."""
    builder = slot_tracker_app if kind == "slot tracker" else select_service_builder(config or RouterConfig())
    options = ServiceOptions(
        port=0,
        data_dir=data_dir,
        durability=Durability.ALWAYS,
        seed=seed,
        auth=None if token is None else BearerToken(token.encode()),
    )
    if streams is not None:
        options = attrs.evolve(options, streams=streams)
    if body_timeout is not None:
        options = attrs.evolve(options, http=HttpSettings(body_timeout=body_timeout))
    async with trio.open_nursery() as nursery:
        handle: ServiceHandle = await nursery.start(run_service, kind, options, builder)
        try:
            yield handle
        finally:
            handle.stop()
