"""A slot tracker or selection service with chosen stream bounds, in either process layout, for the live-stream
tests (the conftest fixtures serve the default bounds)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import trio

from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.select_service import SelectService
from kvrouter.actors.slot_service import SlotService
from kvrouter.api.process.main import (
    ServiceHandle,
    ServiceOptions,
    run_service,
    select_objects_builder,
    select_service_builder,
    select_service_routes_of,
    slot_tracker_app,
    slot_tracker_objects,
    slot_tracker_routes_of,
)
from kvrouter.api.routes.selection import SELECTION_BODY_LIMIT
from kvrouter.api.streams.live import DEFAULT_STREAMS, StreamSettings
from kvrouter.journal.store import Durability
from tests.support.proxied import run_proxied_service

SLOT = "slot tracker"
SELECT = "selection service"


@contextlib.asynccontextmanager
async def serving(
    kind: str,
    data_dir: Path,
    layout: str,
    streams: StreamSettings = DEFAULT_STREAMS,
    config: RouterConfig = RouterConfig(),  # noqa: B008 - frozen
) -> AsyncIterator[ServiceHandle]:
    """``kind`` in ``layout`` ("one-process" or "proxied") with these stream bounds."""
    options = ServiceOptions(
        port=0,
        data_dir=data_dir,
        durability=Durability.ALWAYS,
        seed=7,
        body_limit=SELECTION_BODY_LIMIT,
        streams=streams,
    )
    async with trio.open_nursery() as nursery:
        handle: ServiceHandle
        if layout == "proxied":
            if kind == SLOT:
                objects, routes_of, cls = slot_tracker_objects, slot_tracker_routes_of, SlotService
            else:
                objects, routes_of, cls = (
                    select_objects_builder(config),
                    select_service_routes_of,
                    SelectService,
                )
            routes = partial(routes_of, streams=streams)
            handle = await nursery.start(run_proxied_service, kind, options, objects, routes, cls)
        else:
            build = slot_tracker_app if kind == SLOT else select_service_builder(config)
            handle = await nursery.start(run_service, kind, options, build)
        try:
            yield handle
        finally:
            handle.stop()
