"""Session affinity across two selection-service replicas peered by replica sync, through HTTP: a session
pinned on A is routed to the same worker by B, a move on B is followed by A, and B keeps what it learnt
across a restart (journaled)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import trio

from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.api.process.main import ServiceHandle, ServiceOptions, run_service, select_service_builder
from kvrouter.api.routes.selection import SELECTION_BODY_LIMIT
from kvrouter.journal.store import Durability
from tests.support.kv_publisher import free_tcp_port

CONFIG = RouterConfig(use_kv_events=False, session_affinity_ttl_secs=600)
M = {"model_name": "m"}


async def start(
    nursery: trio.Nursery, data: Path, port: int | None = None, peers: tuple[str, ...] = ()
) -> ServiceHandle:
    options = ServiceOptions(
        port=0,
        data_dir=data,
        durability=Durability.ALWAYS,
        seed=7,
        body_limit=SELECTION_BODY_LIMIT,
        replica_sync_port=port,
        replica_sync_peers=peers,
    )
    handle: ServiceHandle = await nursery.start(
        run_service, "selection service", options, select_service_builder(CONFIG)
    )
    return handle


async def chosen(http: httpx.AsyncClient, session_id: str) -> int:
    response = await http.post("/select", json={**M, "token_ids": [7, 7, 7, 7], "session_id": session_id})
    assert response.status_code == 200, response.text
    worker_id: int = response.json()["worker_id"]
    return worker_id


async def book(http: httpx.AsyncClient, reservation_id: str, **fields: Any) -> int:
    body = {**M, "reservation_id": reservation_id, "token_ids": list(range(1, 17)), "session_id": "chat", **fields}
    response = await http.post("/select_and_reserve", json=body)
    assert response.status_code == 200, response.text
    worker_id: int = response.json()["worker_id"]
    return worker_id


async def test_a_session_pinned_on_one_replica_is_routed_there_by_its_peer(tmp_path: Path) -> None:
    port_a, port_b = free_tcp_port(), free_tcp_port()
    async with trio.open_nursery() as nursery:
        a = await start(nursery, tmp_path / "a", port_a, (f"tcp://127.0.0.1:{port_b}",))
        b = await start(nursery, tmp_path / "b", port_b, (f"tcp://127.0.0.1:{port_a}",))
        async with httpx.AsyncClient(base_url=a.urls[0]) as http_a, httpx.AsyncClient(base_url=b.urls[0]) as http_b:
            elsewhere = await exchange(http_a, http_b)
        b.stop()
        a.stop()
    # Journaled: B restarted without replica sync still routes the session where it last learnt.
    async with trio.open_nursery() as nursery:
        again = await start(nursery, tmp_path / "b")
        async with httpx.AsyncClient(base_url=again.urls[0]) as http:
            assert await chosen(http, "chat") == elsewhere
        again.stop()


async def exchange(http_a: httpx.AsyncClient, http_b: httpx.AsyncClient) -> int:
    for http in (http_a, http_b):
        for worker_id in (1, 2, 3):
            record = {"worker_id": worker_id, **M, "endpoint": f"http://w{worker_id}", "block_size": 4}
            assert (await http.post("/workers", json=record)).status_code == 201

    # Pin "chat" on A, booking again until B has heard A (ZMQ's slow joiner loses the first messages).
    # Every booking of the pinned session lands on its worker, which makes it B's busiest worker too.
    with trio.fail_after(20):
        n = 1
        pinned = await book(http_a, "a-1")
        while await chosen(http_b, "chat") != pinned:
            n += 1
            assert await book(http_a, f"a-{n}") == pinned
            await trio.sleep(0.05)
    assert await chosen(http_b, "other") != pinned  # without the pin B avoids the busy worker

    # B moves the session to another worker (a newer binding): A follows.
    elsewhere = next(w for w in (1, 2, 3) if w != pinned)
    with trio.fail_after(20):
        n = 0
        while await chosen(http_a, "chat") != elsewhere:
            n += 1
            assert await book(http_b, f"b-{n}", allowed_worker_ids=[elsewhere]) == elsewhere
            await trio.sleep(0.05)
    assert await chosen(http_b, "chat") == elsewhere
    return elsewhere
