"""Shared fixtures: a real kvrouter service on 127.0.0.1 with an ephemeral port, and a client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio

from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.select_service import SelectService
from kvrouter.actors.slot_service import SlotService
from kvrouter.actors.transport.socket_budget import ListenerSlots
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
from kvrouter.journal.store import Durability
from tests.support.proxied import run_proxied_service

# Services behind the ``client`` and ``selector`` fixtures run in both layouts: one process (--fronts 0) and
# through a front's proxies and the ZMQ wire (tests/support/proxied.py), so every route test checks both.
LAYOUTS = ["one-process", "proxied"]


@pytest.fixture(params=LAYOUTS)
async def slot_tracker(
    nursery: trio.Nursery, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[ServiceHandle]:
    options = ServiceOptions(port=0, data_dir=tmp_path / "data", durability=Durability.ALWAYS)
    if request.param == "proxied":
        proxied = partial(
            run_proxied_service, "slot tracker", options, slot_tracker_objects, slot_tracker_routes_of, SlotService
        )
        handle: ServiceHandle = await nursery.start(proxied)
    else:
        handle = await nursery.start(run_service, "slot tracker", options, slot_tracker_app)
    yield handle
    handle.stop()


@pytest.fixture
async def client(slot_tracker: ServiceHandle) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=slot_tracker.urls[0], timeout=10) as http:
        yield http


async def start_select_service(
    nursery: trio.Nursery,
    data_dir: Path,
    config: RouterConfig | None = None,
    seed: int = 7,
    listener_slots: ListenerSlots | None = None,
    *,
    proxied: bool = False,
) -> ServiceHandle:
    options = ServiceOptions(
        port=0, data_dir=data_dir, durability=Durability.ALWAYS, seed=seed, body_limit=SELECTION_BODY_LIMIT
    )
    handle: ServiceHandle
    if proxied:
        build_objects = select_objects_builder(config or RouterConfig(), listener_slots=listener_slots)
        service = partial(
            run_proxied_service, "selection service", options, build_objects, select_service_routes_of, SelectService
        )
        handle = await nursery.start(service)
        return handle
    build = select_service_builder(config or RouterConfig(), listener_slots=listener_slots)
    handle = await nursery.start(run_service, "selection service", options, build)
    return handle


@pytest.fixture(params=LAYOUTS)
async def selector(
    nursery: trio.Nursery, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[httpx.AsyncClient]:
    """A selection service (KV events on) and an HTTP client for it."""
    handle = await start_select_service(nursery, tmp_path / "data", proxied=request.param == "proxied")
    async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
        yield http
    handle.stop()
