"""Shared fixtures: a real kvrouter service on 127.0.0.1 with an ephemeral port, and a client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio

from api.main import ServiceHandle, ServiceOptions, run_service
from api.routes import slot_tracker_routes
from journal.store import Durability


@pytest.fixture
async def slot_tracker(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[ServiceHandle]:
    options = ServiceOptions(port=0, data_dir=tmp_path / "data", durability=Durability.ALWAYS)
    handle: ServiceHandle = await nursery.start(run_service, "slot tracker", options, slot_tracker_routes)
    yield handle
    handle.stop()


@pytest.fixture
async def client(slot_tracker: ServiceHandle) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=slot_tracker.urls[0], timeout=10) as http:
        yield http
