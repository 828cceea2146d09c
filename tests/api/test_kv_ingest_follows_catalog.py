"""KV listeners follow the applied catalog, and never exceed the process's listener capacity.

Real hypercorn on 127.0.0.1 and real ZMQ SUB sockets (their publishers are absent: the listeners stay
"connecting", which is all these tests need).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import trio

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.commands import RemoveWorker, UpsertWorker
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.transport.socket_budget import ListenerSlots
from tests.conftest import start_select_service

LIMIT = "limited by this test's budget; raise it"


def worker(worker_id: int, ranks: int, model: str = "m") -> dict[str, Any]:
    return {
        "worker_id": worker_id,
        "model_name": model,
        "endpoint": f"http://w{worker_id}",
        "block_size": 4,
        "data_parallel_size": ranks,
        "kv_events_endpoints": {str(r): f"tcp://127.0.0.1:{worker_id * 10 + r + 1}" for r in range(ranks)},
    }


async def listeners(http: httpx.AsyncClient) -> dict[int, list[str]]:
    return {row["worker_id"]: sorted(row.get("kv_listeners", {})) for row in (await http.get("/workers")).json()}


async def test_a_registration_beyond_listener_capacity_is_refused_before_it_is_journaled(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    slots = ListenerSlots(3, LIMIT)
    async with trio.open_nursery() as first:  # left once the first service has stopped
        handle = await start_select_service(first, tmp_path / "data", listener_slots=slots)
        async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
            assert (await http.post("/workers", json=worker(1, 2))).status_code == 201
            refused = await http.post("/workers", json=worker(2, 2))
            assert refused.status_code == 409
            assert refused.json() == {
                "error": "worker 2 not registered: cannot listen to 2 more KV event stream(s): 2 of 3 KV listener "
                f"slots are in use, {LIMIT}"
            }
            assert await listeners(http) == {1: ["0", "1"]} and slots.in_use == 2
            assert (await http.post("/workers", json=worker(3, 1))).status_code == 201
            # Full, yet a worker may still move or change: it keeps the slots it holds.
            moved = await http.post("/workers", json=worker(1, 2, model="other"))
            assert moved.status_code == 201 and sorted(moved.json()["kv_listeners"]) == ["0", "1"]
            assert slots.in_use == 3
            assert (await http.delete("/workers/3")).status_code == 200
            assert slots.in_use == 2
            assert (await http.post("/workers", json=worker(2, 2))).status_code == 409
            assert (await http.post("/workers", json=worker(2, 1))).status_code == 201
            before = await listeners(http)
        handle.stop()

    again = ListenerSlots(3, LIMIT)
    handle = await start_select_service(nursery, tmp_path / "data", listener_slots=again)
    async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
        rows = (await http.get("/workers")).json()
        assert await listeners(http) == before == {1: ["0", "1"], 2: ["0"]}
        assert all(s["state"] != "failed" for row in rows for s in row["kv_listeners"].values())
        assert again.in_use == 3
    handle.stop()


async def test_listeners_follow_catalog_events_however_they_are_applied(nursery: trio.Nursery, tmp_path: Path) -> None:
    """A catalog change applied straight to the actor system (as a simulation or a peer would) starts and
    stops listeners just as a route does: the ingest follows events, not callers."""
    slots = ListenerSlots(8, LIMIT)
    handle = await start_select_service(nursery, tmp_path / "data", listener_slots=slots)
    system = handle.system
    record = WorkerRecord(5, "m", endpoint="http://w5", kv_events_endpoint="tcp://127.0.0.1:9", block_size=4)
    async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
        await system.ask(ScopeKey("m", "default"), UpsertWorker(record))
        assert await listeners(http) == {5: ["0"]} and slots.in_use == 1
        await system.ask(ScopeKey("m", "default"), RemoveWorker(5))
        assert await listeners(http) == {} and slots.in_use == 0
    handle.stop()
