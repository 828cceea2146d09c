"""Shared fixtures: a real kvrouter service on 127.0.0.1 with an ephemeral port, and a client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.peers.socket_budget import ListenerSlots
from kvrouter.api.main import ServiceHandle, ServiceOptions, run_service, select_service_builder, slot_tracker_app
from kvrouter.api.select_routes import SELECTION_BODY_LIMIT
from kvrouter.journal.store import Durability


@pytest.fixture
async def slot_tracker(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[ServiceHandle]:
    options = ServiceOptions(port=0, data_dir=tmp_path / "data", durability=Durability.ALWAYS)
    handle: ServiceHandle = await nursery.start(run_service, "slot tracker", options, slot_tracker_app)
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
) -> ServiceHandle:
    options = ServiceOptions(
        port=0, data_dir=data_dir, durability=Durability.ALWAYS, seed=seed, body_limit=SELECTION_BODY_LIMIT
    )
    build = select_service_builder(config or RouterConfig(), listener_slots=listener_slots)
    handle: ServiceHandle = await nursery.start(run_service, "selection service", options, build)
    return handle


@pytest.fixture
async def selector(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    """A selection service (KV events on) and an HTTP client for it."""
    handle = await start_select_service(nursery, tmp_path / "data")
    async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
        yield http
    handle.stop()
