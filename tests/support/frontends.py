"""Frontends for tests: in-process on 127.0.0.1 (port 0), journal in memory, in front of small mock workers."""

from __future__ import annotations

from typing import Any

import attrs
import httpx
import trio

from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.api.frontend.options import FrontendLimits, FrontendOptions
from kvrouter.api.frontend.service import FrontendHandle, run_frontend
from kvrouter.api.mock_worker.service import MockWorkerHandle
from tests.support.mock_workers import BLOCK, start_mock_worker


def frontend_options(mode: str = "kv", **changes: Any) -> FrontendOptions:
    base = FrontendOptions(port=0, router=RouterConfig(router_mode=mode), block_size=BLOCK, seed=7)
    return attrs.evolve(base, **changes)


async def start_frontend(nursery: trio.Nursery, mode: str = "kv", **changes: Any) -> FrontendHandle:
    handle: FrontendHandle = await nursery.start(run_frontend, frontend_options(mode, **changes))
    return handle


async def start_workers(
    nursery: trio.Nursery, frontend: FrontendHandle, count: int, **changes: Any
) -> list[MockWorkerHandle]:
    """``count`` mock workers that register themselves with ``frontend`` (ids 1..count), listeners active."""
    workers = [
        await start_mock_worker(nursery, register_url=frontend.url, worker_id=index + 1, **changes)
        for index in range(count)
    ]
    await wait_listeners(frontend, count)
    return workers


async def wait_listeners(frontend: FrontendHandle, count: int) -> None:
    """Until ``count`` workers' KV listeners are subscribed (events sent before would be lost)."""
    with trio.fail_after(10):
        while True:
            rows = await frontend.routing.service.workers()
            active = [
                row
                for row in rows
                if row.listeners and all(state.get("state") == "active" for state in row.listeners.values())
            ]
            if len(active) >= count:
                return
            await trio.sleep(0.01)


async def loads(http: httpx.AsyncClient) -> dict[int, dict[str, int]]:
    """``GET /loads`` by worker id."""
    rows = {}
    for partition in (await http.get("/loads")).json():
        for row in partition["loads"]:
            rows[row["worker_id"]] = row
    return rows


async def wait_idle(http: httpx.AsyncClient) -> dict[int, dict[str, int]]:
    """Until no worker has an active request in ``/loads`` (the bookings were freed); the loads then."""
    with trio.fail_after(10):
        while True:
            found = await loads(http)
            if all(row["active_requests"] == 0 for row in found.values()):
                return found
            await trio.sleep(0.01)


def small_limits(**changes: Any) -> FrontendLimits:
    return attrs.evolve(FrontendLimits(), **changes)
