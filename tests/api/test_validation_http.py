"""Bad input over real HTTP: each answer is a 4xx ``{"error"}`` (these were 500s, or accepted and journaled),
and the service's state is exactly what it was before."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from kvrouter.actors.core.limits import (
    MAX_PROMPT_BLOCKS,
    MAX_RANKS_PER_SCOPE,
    MAX_RANKS_PER_WORKER,
    MAX_TAINTS,
    MAX_TEXT_BYTES,
)

WORKER = {"worker_id": 1, "model_name": "m", "endpoint": "http://w1", "block_size": 4}
LONG = "x" * (MAX_TEXT_BYTES + 1)


async def select_state(http: httpx.AsyncClient) -> tuple[Any, ...]:
    workers = (await http.get("/workers")).json()
    for row in workers:
        row.pop("kv_listeners", None)
    return workers, (await http.get("/loads")).json(), (await http.get("/dump")).json()


async def refused(http: httpx.AsyncClient, method: str, path: str, body: Any, status: int, message: str) -> None:
    response = await http.request(method, path, json=body)
    assert (response.status_code, list(response.json())) == (status, ["error"]), response.text
    assert message in response.json()["error"]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "message"),
    [
        # 500 before: int("²") after "²".isdigit(); and the record was journaled, so every restart exited 1.
        (
            "POST",
            "/workers",
            {**WORKER, "data_parallel_size": 2, "replay_endpoint": "tcp://h:²", "kv_events_endpoint": "tcp://h:1"},
            400,
            "replay_endpoint: `tcp://h:²` has an invalid port `²`",
        ),
        ("POST", "/workers", {**WORKER, "kv_events_endpoints": {"²": "tcp://h:1"}}, 422, "invalid dp_rank key '²'"),
        ("POST", "/workers", {**WORKER, "kv_events_endpoints": {"9" * 5000: "tcp://h:1"}}, 413, "exceeds the maximum"),
        ("POST", "/workers", {**WORKER, "kv_events_endpoints": {"1": "a", "01": "b"}}, 422, "dp_rank 1 is given twice"),
        ("POST", "/workers", {**WORKER, "kv_events_endpoint": "tcp://h:65536"}, 400, "invalid port `65536`"),
        ("POST", "/workers", {**WORKER, "kv_events_endpoint": "udp://h:1"}, 400, "unsupported transport `udp`"),
        # 4e9 ranks crashed the service; 1M blocked it for 5.4 s.
        ("POST", "/workers", {**WORKER, "data_parallel_size": 4_000_000_000}, 400, "maximum of 4096 ranks per worker"),
        ("POST", "/workers", {**WORKER, "taints": ["t"] * (MAX_TAINTS + 1)}, 413, "taints: 257 entries exceed"),
        ("POST", "/workers", {**WORKER, "model_name": LONG}, 413, "model_name: a string of 4097 bytes"),
        ("PATCH", "/workers/%C2%B2", {}, 400, "Cannot parse `²` to a `u64`"),
        ("DELETE", "/workers/" + "9" * 5000, None, 400, "to a `u64`"),
        # 500 before: the scope has no actor, and decide had no rule for the replay form.
        ("POST", "/reservations", {"selection_id": "q"}, 404, "no pending selection q"),
        ("POST", "/reservations", {"selection_id": LONG}, 413, "selection_id: a string of 4097 bytes"),
        (
            "POST",
            "/reservations",
            {"reservation_id": "r", "worker_id": 1, "sequence_hashes": [0] * (MAX_PROMPT_BLOCKS + 1), "isl_tokens": 1},
            413,
            "sequence_hashes: 262145 hashes exceed the maximum of 262144 per prompt",
        ),
        (
            "POST",
            "/select_and_reserve",
            {"model_name": "m", "block_hashes": [1], "sequence_hashes": [1] * (MAX_PROMPT_BLOCKS + 1), "isl_tokens": 4},
            413,
            "sequence_hashes: 262145 hashes exceed",
        ),
    ],
)
async def test_bad_selection_service_input_is_a_4xx_that_changes_nothing(
    selector: httpx.AsyncClient, method: str, path: str, body: Any, status: int, message: str
) -> None:
    assert (await selector.post("/workers", json={**WORKER, "kv_events_endpoint": "tcp://127.0.0.1:9"})).is_success
    before = await select_state(selector)
    await refused(selector, method, path, body, status, message)
    assert await select_state(selector) == before


async def test_a_prompt_cut_into_too_many_blocks_is_refused(selector: httpx.AsyncClient) -> None:
    worker = {**WORKER, "block_size": 1, "kv_events_endpoint": "tcp://127.0.0.1:9"}
    assert (await selector.post("/workers", json=worker)).status_code == 201
    before = await select_state(selector)
    body = {"model_name": "m", "token_ids": [1] * (MAX_PROMPT_BLOCKS + 1), "reservation_id": "r"}
    await refused(selector, "POST", "/select_and_reserve", body, 400, "token_ids make 262145 blocks of 1 tokens")
    assert await select_state(selector) == before


async def test_moving_a_worker_into_a_full_scope_leaves_it_where_it_was(selector: httpx.AsyncClient) -> None:
    for worker_id in range(MAX_RANKS_PER_SCOPE // MAX_RANKS_PER_WORKER):
        body = {**WORKER, "worker_id": 10 + worker_id, "model_name": "full", "data_parallel_size": MAX_RANKS_PER_WORKER}
        assert (await selector.post("/workers", json=body)).status_code == 201
    assert (await selector.post("/workers", json=WORKER)).status_code == 201
    before = await select_state(selector)
    await refused(selector, "PATCH", "/workers/1", {"model_name": "full"}, 409, "ranks per scope")
    assert await select_state(selector) == before


async def slot_state(http: httpx.AsyncClient) -> tuple[Any, ...]:
    return (await http.get("/workers")).json(), (await http.get("/loads")).json()


async def test_slot_tracker_ranks_per_scope_are_capped(client: httpx.AsyncClient) -> None:
    """100 registrations of 4,096 ranks each took 409,600 ranks and 265 MiB; now the scope fills up."""
    register = {"model_name": "m", "block_size": 4, "dp_start": 0, "dp_size": MAX_RANKS_PER_WORKER}
    for worker_id in range(MAX_RANKS_PER_SCOPE // MAX_RANKS_PER_WORKER):
        assert (await client.post("/register", json={**register, "worker_id": worker_id})).status_code == 201
    before = await slot_state(client)
    await refused(client, "POST", "/register", {**register, "worker_id": 99, "dp_size": 1}, 409, "ranks per scope")
    assert await slot_state(client) == before
    # Another scope is not affected.
    assert (await client.post("/register", json={**register, "worker_id": 99, "model_name": "n"})).status_code == 201


async def test_slot_tracker_request_sizes_are_capped(client: httpx.AsyncClient) -> None:
    register = {"worker_id": 1, "model_name": "m", "block_size": 4, "dp_start": 0, "dp_size": 1}
    assert (await client.post("/register", json=register)).status_code == 201
    before = await slot_state(client)
    add = {"model_name": "m", "worker_id": 1, "dp_rank": 0, "sequence_hashes": [1, 2], "new_isl_tokens": 8}
    await refused(client, "POST", "/add", {**add, "request_id": LONG}, 413, "request_id: a string of 4097 bytes")
    too_many = {**add, "request_id": "r", "sequence_hashes": [7] * (MAX_PROMPT_BLOCKS + 1)}
    await refused(client, "POST", "/add", too_many, 413, "sequence_hashes: 262145 hashes exceed")
    assert await slot_state(client) == before


async def test_prefill_loads_past_u64_are_refused_not_a_500(selector: httpx.AsyncClient) -> None:
    """A reservation of 2**64 - 1 tokens made /potential_loads answer 500 (its sum no longer fits the wire's u64),
    and a second one on the same rank made /loads answer 500 for good."""
    assert (await selector.post("/workers", json={**WORKER, "kv_events_endpoint": "tcp://127.0.0.1:9"})).is_success
    top = 2**64 - 1
    booking = {"model_name": "m", "worker_id": 1, "sequence_hashes": [1], "isl_tokens": top}
    assert (await selector.post("/reservations", json={**booking, "reservation_id": "a"})).status_code == 201
    prompt = {"model_name": "m", "block_hashes": [2], "sequence_hashes": [2], "isl_tokens": 5}
    potential = await selector.post("/potential_loads", json=prompt)
    assert potential.status_code == 200 and potential.json()[0]["potential_prefill_tokens"] == top  # saturated
    before = await select_state(selector)
    await refused(selector, "POST", "/reservations", {**booking, "reservation_id": "b"}, 400, "would overflow")
    await refused(selector, "POST", "/select_and_reserve", {**prompt, "reservation_id": "c"}, 400, "would overflow")
    assert await select_state(selector) == before
