"""The per-scope caps on active requests over real HTTP (hypercorn on 127.0.0.1, both layouts): beyond either the
answer is 409 ``{"error"}`` naming the cap, and nothing changes. The caps are patched small here
(``actors/core/limits.py`` has the defaults; ``tests/core/test_booking_caps.py`` the rules)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from kvrouter.actors.core import decide, selection_rules
from tests.api.test_batch import batched, cmd

REQUESTS, BLOCKS = 3, 8
REGISTER = {"model_name": "m", "worker_id": 1, "block_size": 4, "dp_start": 0, "dp_size": 1}


@pytest.fixture(autouse=True)
def small_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (decide, selection_rules):
        monkeypatch.setattr(module, "MAX_ACTIVE_REQUESTS_PER_SCOPE", REQUESTS)
        monkeypatch.setattr(module, "MAX_ACTIVE_PROMPT_BLOCKS_PER_SCOPE", BLOCKS)


def add(request_id: str, blocks: int) -> dict[str, Any]:
    hashes = list(range(100, 100 + blocks))
    return {"model_name": "m", "request_id": request_id, "worker_id": 1, "dp_rank": 0, "sequence_hashes": hashes}


async def refused(client: httpx.AsyncClient, path: str, body: dict[str, Any], cap: str) -> None:
    before = (await client.get("/loads")).json()
    response = await client.post(path, json=body)
    assert (response.status_code, list(response.json())) == (409, ["error"]), response.text
    assert cap in response.json()["error"], response.text
    assert (await client.get("/loads")).json() == before


async def test_slot_tracker_adds_beyond_either_cap_get_a_409_naming_it(client: httpx.AsyncClient) -> None:
    assert (await client.post("/register", json=REGISTER)).status_code == 201
    assert (await client.post("/add", json=add("a", 5))).status_code == 201
    await refused(client, "/add", add("b", 4), f"limit of {BLOCKS} active prompt blocks per scope")
    assert (await client.post("/add", json=add("b", 3))).status_code == 201
    assert (await client.post("/add", json=add("c", 0))).status_code == 201
    await refused(client, "/add", add("d", 0), f"limit of {REQUESTS} active requests per scope")
    # The same through POST /batch (the command runner the command stream shares), then a free makes room.
    results = await batched(client.base_url, [cmd("POST", "/add", add("d", 0))])
    assert results[0]["status"] == 409 and "active requests per scope" in results[0]["body"]["error"]
    assert (await client.post("/free", json={"model_name": "m", "request_id": "a"})).status_code == 200
    assert (await client.post("/add", json=add("d", 5))).status_code == 201


async def test_selection_service_bookings_beyond_a_cap_get_a_409_naming_it(selector: httpx.AsyncClient) -> None:
    worker = {
        "worker_id": 1,
        "model_name": "m",
        "endpoint": "http://w1",
        "block_size": 4,
        "kv_events_endpoint": "tcp://127.0.0.1:1",
    }
    assert (await selector.post("/workers", json=worker)).status_code == 201
    prompt = {"model_name": "m", "token_ids": list(range(24))}  # 6 blocks
    assert (await selector.post("/select_and_reserve", json={**prompt, "reservation_id": "s1"})).status_code == 200
    cap = f"limit of {BLOCKS} active prompt blocks per scope"
    await refused(selector, "/select_and_reserve", {**prompt, "reservation_id": "s2"}, cap)
    explicit = {"model_name": "m", "worker_id": 1, "dp_rank": 0, "sequence_hashes": [1, 2, 3], "isl_tokens": 12}
    await refused(selector, "/reservations", {**explicit, "reservation_id": "e1"}, cap)
    small = {**explicit, "reservation_id": "e1", "sequence_hashes": [1, 2]}
    assert (await selector.post("/reservations", json=small)).status_code == 201
    assert (
        await selector.post("/reservations", json={**small, "reservation_id": "e2", "sequence_hashes": []})
    ).status_code == 201
    await refused(
        selector,
        "/reservations",
        {**small, "reservation_id": "e3", "sequence_hashes": []},
        f"limit of {REQUESTS} active requests per scope",
    )
    assert (await selector.delete("/reservations/s1")).status_code == 200
    assert (await selector.post("/reservations", json={**small, "reservation_id": "e3"})).status_code == 201
