"""Service-wide caps over real HTTP: ranks across every scope, and the number of scopes (actors/core/limits.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from kvrouter.actors import system as actor_system
from kvrouter.actors.core import selection_rules
from kvrouter.actors.core.limits import MAX_RANKS_PER_SCOPE, MAX_RANKS_PER_SERVICE, MAX_RANKS_PER_WORKER
from kvrouter.api.process.main import ServiceOptions, run_service, slot_tracker_app
from kvrouter.journal.store import Durability

REGISTER = {"block_size": 4, "dp_start": 0, "dp_size": MAX_RANKS_PER_WORKER}
WORKER = {"endpoint": "http://w", "block_size": 4, "data_parallel_size": MAX_RANKS_PER_WORKER}


async def refused(response: httpx.Response, status: int, message: str) -> None:
    assert (response.status_code, list(response.json())) == (status, ["error"]), response.text
    assert message in response.json()["error"], response.text


async def slot_state(http: httpx.AsyncClient) -> tuple[Any, ...]:
    return (await http.get("/workers")).json(), (await http.get("/loads")).json()


async def test_slot_tracker_ranks_are_capped_across_scopes(client: httpx.AsyncClient) -> None:
    """Each scope capped at 8,192 ranks, 10,000 scopes could hold 82 M ranks; the service now stops at 65,536."""
    per_scope = MAX_RANKS_PER_SCOPE // MAX_RANKS_PER_WORKER
    scopes = MAX_RANKS_PER_SERVICE // MAX_RANKS_PER_SCOPE
    for scope in range(scopes):
        for worker in range(per_scope):
            body = {**REGISTER, "model_name": f"m{scope}", "worker_id": scope * per_scope + worker}
            assert (await client.post("/register", json=body)).status_code == 201
    before = await slot_state(client)
    more = {**REGISTER, "model_name": "another", "worker_id": 999, "dp_size": 1}
    await refused(await client.post("/register", json=more), 409, f"limit of {MAX_RANKS_PER_SERVICE} ranks per service")
    assert await slot_state(client) == before
    # Unregistering makes room again.
    assert (await client.post("/unregister", json={"model_name": "m0", "worker_id": 0})).status_code == 200
    assert (await client.post("/register", json=more)).status_code == 201


async def test_selection_service_workers_without_ranks_count_toward_the_service_cap(
    selector: httpx.AsyncClient,
) -> None:
    per_scope = MAX_RANKS_PER_SCOPE // MAX_RANKS_PER_WORKER
    for scope in range(MAX_RANKS_PER_SERVICE // MAX_RANKS_PER_SCOPE):
        for worker in range(per_scope):
            body = {**WORKER, "model_name": f"m{scope}", "worker_id": scope * per_scope + worker}
            assert (await selector.post("/workers", json=body)).status_code == 201
    rankless = {"worker_id": 999, "model_name": "another", "data_parallel_size": 0}
    await refused(await selector.post("/workers", json=rankless), 409, "ranks per service")
    # A worker that does not grow is still updated, and moving one to another scope frees its old ranks.
    assert (await selector.patch("/workers/0", json={"endpoint": "http://moved"})).status_code == 200
    assert (await selector.patch("/workers/0", json={"model_name": "another"})).status_code == 200
    shrink = {"data_parallel_size": MAX_RANKS_PER_WORKER - 1}
    assert (await selector.patch("/workers/1", json=shrink)).status_code == 200
    assert (await selector.post("/workers", json=rankless)).status_code == 201


async def test_scopes_are_capped_with_a_409_and_a_restart_over_a_lowered_cap_keeps_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = ServiceOptions(port=0, data_dir=tmp_path / "data", durability=Durability.ALWAYS)
    monkeypatch.setattr(actor_system, "MAX_SCOPES", 3)
    async with trio.open_nursery() as nursery:
        handle = await nursery.start(run_service, "slot tracker", options, slot_tracker_app)
        async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as client:
            for scope in range(3):
                body = {**REGISTER, "dp_size": 2, "model_name": f"m{scope}", "worker_id": scope}
                assert (await client.post("/register", json=body)).status_code == 201
            before = await slot_state(client)
            fourth = {**REGISTER, "dp_size": 2, "model_name": "m3", "worker_id": 3}
            await refused(await client.post("/register", json=fourth), 409, "limit of 3 scopes per service")
            assert await slot_state(client) == before
        handle.stop()
    # The caps are checked on requests only, never while the journal is replayed: a lower rank cap at the next
    # start keeps every worker, refuses growth and still lets workers go.
    monkeypatch.setattr(selection_rules, "MAX_RANKS_PER_SERVICE", 4)
    async with trio.open_nursery() as nursery:
        handle = await nursery.start(run_service, "slot tracker", options, slot_tracker_app)
        async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as client:
            assert await slot_state(client) == before
            more = {**REGISTER, "dp_size": 1, "model_name": "m0", "worker_id": 7}
            await refused(await client.post("/register", json=more), 409, "6 ranks in all scopes")
            assert (await client.post("/unregister", json={"model_name": "m1", "worker_id": 1})).status_code == 200
        handle.stop()
