"""The selection service end to end: real hypercorn on 127.0.0.1, real ZMQ KV-event publishers."""

from __future__ import annotations

from pathlib import Path

import httpx
import trio

from kvrouter.actors.core.commands import Reserve
from kvrouter.actors.core.hashing import block_hashes, sequence_hashes
from kvrouter.actors.core.ids import to_i64
from kvrouter.actors.core.kv_wire import encode_batch
from kvrouter.actors.core.pending import entry_bytes
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.api.process.main import ServiceOptions, run_service, select_service_builder
from kvrouter.api.routes.selection import SELECTION_BODY_LIMIT
from tests.support.kv_publisher import open_kv_publisher

BLOCK = 4


def stored(hashes: list[int], tokens: list[int], parent: int | None = None, medium: str | None = None) -> list:
    return ["BlockStored", hashes, parent, tokens, BLOCK, None, medium]


async def wait_for(predicate) -> None:
    """Poll an HTTP-visible condition (the service's state lives in another task's hands)."""
    with trio.fail_after(5):
        while not await predicate():  # noqa: ASYNC110 - polling over HTTP, no event to wait on
            await trio.sleep(0.02)


def worker(worker_id: int, endpoint: str, replay: str | None = None, **extra: object) -> dict:
    return {
        "worker_id": worker_id,
        "model_name": "m",
        "endpoint": f"http://w{worker_id}",
        "block_size": BLOCK,
        "kv_events_endpoint": endpoint,
        "replay_endpoint": replay,
        **extra,
    }


async def test_catalog_lifecycle_and_readiness(selector: httpx.AsyncClient) -> None:
    assert (await selector.get("/ready")).status_code == 503
    incomplete = await selector.post("/workers", json={"worker_id": 1, "model_name": "m"})
    assert incomplete.status_code == 201
    assert incomplete.json()["lifecycle"] == "incomplete"
    assert incomplete.json()["not_schedulable_reasons"] == [
        "endpoint is required",
        "block_size must be greater than 0",
        "kv_events endpoint is required for dp_rank 0",
    ]
    patched = await selector.patch(
        "/workers/1", json={"endpoint": "http://w1", "block_size": BLOCK, "kv_events_endpoint": "tcp://127.0.0.1:1"}
    )
    assert patched.status_code == 200 and patched.json()["lifecycle"] == "schedulable"
    ready = await selector.get("/ready")
    assert ready.status_code == 200 and ready.json()["schedulable_workers"] == 1
    assert (await selector.patch("/workers/9", json={})).json() == {"error": "worker 9 not found"}
    removed = await selector.delete("/workers/1")
    assert removed.status_code == 200 and removed.json()["lifecycle"] == "unschedulable"
    assert (await selector.delete("/workers/1")).status_code == 404
    assert (await selector.get("/workers")).json() == []
    assert (await selector.get("/health")).json() == {"status": "ok"}


async def test_kv_events_steer_selection(selector: httpx.AsyncClient) -> None:
    tokens = list(range(1, 17))  # 4 blocks of 4
    local = block_hashes(tokens, BLOCK)
    async with open_kv_publisher() as warm, open_kv_publisher() as cold:
        for worker_id, publisher in ((1, warm), (2, cold)):
            body = worker(worker_id, publisher.endpoint, publisher.replay_endpoint)
            assert (await selector.post("/workers", json=body)).json()["lifecycle"] == "schedulable"
        # Worker 1 caches the first 3 blocks; the batch uses map events, as vLLM 0.33 sends them.
        warm.publish(encode_batch([stored([101, 102, 103], tokens[:12])], events_as_maps=True))

        async def indexed() -> bool:
            rows = (await selector.post("/overlap_scores", json={"model_name": "m", "token_ids": tokens})).json()
            return any(r["device_blocks"] == 3 for r in rows["workers"])

        await wait_for(indexed)
        for _ in range(10):
            choice = (await selector.post("/select", json={"model_name": "m", "token_ids": tokens})).json()
            assert choice["worker_id"] == 1
        assert choice["overlap"] == {"longest_matched": 12, "gpu": 12, "dp": {"0": 12}, "cpu": 12, "disk": 12}
        assert choice["effective_prefill_tokens"] == 4
        # The precomputed-hash path reaches the same index.
        by_hash = await selector.post(
            "/select",
            json={
                "model_name": "m",
                "block_hashes": [to_i64(h) for h in local],
                "sequence_hashes": [to_i64(h) for h in sequence_hashes(local)],
                "isl_tokens": 16,
            },
        )
        assert by_hash.json()["worker_id"] == 1
        workers = (await selector.get("/workers")).json()
        listener = workers[0]["kv_listeners"]["0"]
        assert listener["state"] == "active" and listener["last_seq"] == 0


async def test_select_and_reserve_books_and_lifecycle(selector: httpx.AsyncClient) -> None:
    await selector.post("/workers", json=worker(1, "tcp://127.0.0.1:1"))
    prompt = {"model_name": "m", "token_ids": list(range(17))}
    assert (await selector.post("/select", json=prompt)).json()["potential_decode_blocks"] == 5
    before = (await selector.get("/loads")).json()[0]["loads"][0]
    assert before["active_requests"] == 0
    booked = await selector.post("/select_and_reserve", json={**prompt, "reservation_id": "r1"})
    assert booked.status_code == 200 and booked.json()["reservation_id"] == "r1"
    loads = (await selector.get("/loads")).json()[0]["loads"][0]
    assert (loads["active_requests"], loads["potential_prefill_tokens"], loads["potential_decode_blocks"]) == (1, 17, 4)
    duplicate = await selector.post("/select_and_reserve", json={**prompt, "reservation_id": "r1"})
    assert duplicate.status_code == 409
    assert (await selector.post("/reservations/r1/output_block", json={"decay_fraction": 1.5})).status_code == 400
    assert (await selector.post("/reservations/r1/output_block", json={"decay_fraction": 0.5})).status_code == 200
    loads = (await selector.get("/loads")).json()[0]["loads"][0]
    assert loads["potential_decode_blocks"] == 3  # round(4 x 0.5 + 1 x 0.5) = round(2.5)
    assert (await selector.post("/reservations/r1/prefill_complete")).status_code == 200
    assert (await selector.get("/loads")).json()[0]["loads"][0]["potential_prefill_tokens"] == 0
    assert (await selector.delete("/reservations/r1")).status_code == 200
    second = await selector.delete("/reservations/r1")
    assert (second.status_code, second.json()) == (404, {"error": "reservation r1 not found"})


async def test_select_then_reserve_flows(selector: httpx.AsyncClient) -> None:
    await selector.post("/workers", json=worker(1, "tcp://127.0.0.1:1"))
    prompt = {"model_name": "m", "token_ids": list(range(8))}
    selected = (await selector.post("/select", json={**prompt, "selection_id": "s1"})).json()
    replay = await selector.post("/reservations", json={"model_name": "m", "selection_id": "s1"})
    assert replay.status_code == 201 and replay.json()["worker_id"] == selected["worker_id"]
    again = await selector.post("/reservations", json={"model_name": "m", "selection_id": "s1"})
    assert again.status_code == 404 and "no pending selection s1" in again.json()["error"]
    explicit = {
        "model_name": "m",
        "reservation_id": "e1",
        "worker_id": 1,
        "dp_rank": 0,
        "sequence_hashes": [21, 22],
        "isl_tokens": 8,
        "effective_prefill_tokens": 3,
    }
    assert (await selector.post("/reservations", json=explicit)).status_code == 201
    assert (await selector.post("/reservations", json=explicit)).status_code == 409
    too_much = {**explicit, "reservation_id": "e2", "effective_prefill_tokens": 9}
    response = await selector.post("/reservations", json=too_much)
    assert response.json() == {"error": "effective_prefill_tokens (9) must not exceed isl_tokens (8)"}
    rows = (await selector.get("/loads")).json()[0]["loads"]
    assert rows[0]["potential_prefill_tokens"] == 8 + 3


async def test_selection_errors(selector: httpx.AsyncClient) -> None:
    empty = await selector.post("/select", json={"model_name": "nope", "token_ids": [1]})
    assert (empty.status_code, empty.json()) == (503, {"error": "no schedulable workers are available"})
    await selector.post("/workers", json=worker(1, "tcp://127.0.0.1:1"))
    other = await selector.post("/select", json={"model_name": "nope", "token_ids": [1]})
    assert (other.status_code, other.json()) == (
        503,
        {"error": "no schedulable workers for model=nope tenant_id=default"},
    )
    for body, message in [
        ({"model_name": "m", "sequence_hashes": [1], "isl_tokens": 4}, "block_hashes is required without token_ids"),
        (
            {"model_name": "m", "block_hashes": [1], "sequence_hashes": [1], "isl_tokens": 0},
            "isl_tokens must be greater than 0",
        ),
        (
            {"model_name": "m", "block_hashes": [1, 2], "sequence_hashes": [1], "isl_tokens": 4},
            "block_hashes length 2 must match sequence_hashes length 1",
        ),
    ]:
        response = await selector.post("/select", json=body)
        assert (response.status_code, response.json()) == (400, {"error": message})
    override = await selector.post(
        "/select", json={"model_name": "m", "token_ids": [1], "router_config_override": {"overlap_score_credit": -1}}
    )
    assert override.status_code == 422
    filtered = await selector.post(
        "/select", json={"model_name": "m", "token_ids": [1], "routing_constraints": {"required_taints": ["gpu-a100"]}}
    )
    assert filtered.status_code == 503


async def test_approximate_mode_counts_bookings_as_cached(nursery: trio.Nursery, tmp_path) -> None:
    """DYN_USE_KV_EVENTS=false (edge cases 31 and 49): workers need no ZMQ endpoint, and a booked
    prompt counts as cached on its rank for a later prompt sharing its first blocks."""
    from kvrouter.actors.core.router_config import RouterConfig
    from tests.conftest import start_select_service

    handle = await start_select_service(nursery, tmp_path / "data", RouterConfig(use_kv_events=False))
    async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
        for worker_id in (1, 2):
            body = {"worker_id": worker_id, "model_name": "m", "endpoint": f"http://w{worker_id}", "block_size": 4}
            assert (await http.post("/workers", json=body)).json()["lifecycle"] == "schedulable"
        first = list(range(16))
        booked = (await http.post("/select_and_reserve", json={"model_name": "m", "token_ids": first})).json()
        later = [*first[:8], 900, 901, 902, 903]
        scores = (await http.post("/overlap_scores", json={"model_name": "m", "token_ids": later})).json()
        device = {row["worker_id"]: row["device_blocks"] for row in scores["workers"]}
        assert device == {booked["worker_id"]: 2, 3 - booked["worker_id"]: 0}
    handle.stop()


async def test_output_blocks_keep_their_own_weight(selector: httpx.AsyncClient) -> None:
    """1.6.1 (behaviour.md#slot-accounting): an output block without a fraction weighs 1.0; one with a fraction f sets
    every
    output block of the reservation to f. Probed on 1.6.1 with a 4-block reservation: 3, 4, 5, 2."""
    await selector.post("/workers", json=worker(1, "tcp://127.0.0.1:1"))
    prompt = {"model_name": "m", "token_ids": list(range(16)), "reservation_id": "r1"}
    assert (await selector.post("/select_and_reserve", json=prompt)).status_code == 200

    async def decode_blocks() -> int:
        return (await selector.get("/loads")).json()[0]["loads"][0]["potential_decode_blocks"]

    assert await decode_blocks() == 4
    seen = []
    for body in ({"decay_fraction": 0.5}, {}, {}, {"decay_fraction": 0.25}):
        assert (await selector.post("/reservations/r1/output_block", json=body)).status_code == 200
        seen.append(await decode_blocks())
    assert seen == [3, 4, 5, 2]


def partition(model: str, loads: list[dict]) -> dict:
    return {
        "model_name": model,
        "tenant_id": "default",
        "routing_group": "default",
        "loads": loads,
        "pending_count": 0,
        "pending_isl_tokens": 0,
    }


def idle(worker_id: int, dp_rank: int = 0) -> dict:
    return {
        "worker_id": worker_id,
        "dp_rank": dp_rank,
        "potential_prefill_tokens": 0,
        "potential_decode_blocks": 0,
        "active_requests": 0,
    }


async def test_a_partition_outlives_its_last_worker_and_a_restart(tmp_path) -> None:
    """1.6.1 keeps a partition after its last worker leaves: /loads lists it with no loads, /dump keeps its
    block size, and a later worker with another block size fails reconciliation. kvrouter also keeps it
    across a restart (its catalog is journaled)."""
    from tests.conftest import start_select_service

    mismatch = "reconciliation failed: block_size mismatch for model=m tenant_id=default: existing=4 requested=8"
    async with trio.open_nursery() as nursery:
        first = await start_select_service(nursery, tmp_path / "data")
        async with httpx.AsyncClient(base_url=first.urls[0], timeout=10) as http:
            assert (await http.post("/workers", json=worker(1, "tcp://127.0.0.1:1"))).status_code == 201
            assert (await http.delete("/workers/1")).status_code == 200
            assert (await http.get("/loads")).json() == [partition("m", [])]
            assert (await http.get("/dump")).json() == {"m:default": {"block_size": BLOCK, "events": []}}
            later = await http.post("/workers", json={**worker(2, "tcp://127.0.0.1:1"), "block_size": 8})
            assert (later.json()["lifecycle"], later.json()["not_schedulable_reasons"]) == ("incomplete", [mismatch])
            assert (await http.delete("/workers/2")).status_code == 200
        first.stop()

    async with trio.open_nursery() as nursery:
        second = await start_select_service(nursery, tmp_path / "data")
        async with httpx.AsyncClient(base_url=second.urls[0], timeout=10) as http:
            assert (await http.get("/loads")).json() == [partition("m", [])]
            assert (await http.get("/dump")).json() == {"m:default": {"block_size": BLOCK, "events": []}}
            later = await http.post("/workers", json={**worker(2, "tcp://127.0.0.1:1"), "block_size": 8})
            assert later.json()["not_schedulable_reasons"] == [mismatch]
        second.stop()


async def test_loads_and_dump_show_only_partitions_and_ranks_a_schedulable_worker_fixed(
    selector: httpx.AsyncClient,
) -> None:
    """1.6.1: a partition whose workers are all incomplete is in neither /loads nor /dump, and /loads lists
    only the ranks of schedulable workers."""
    await selector.post("/workers", json={"worker_id": 3, "model_name": "inc", "block_size": BLOCK})
    await selector.post("/workers", json=worker(1, "tcp://127.0.0.1:1"))
    incomplete = await selector.post("/workers", json={**worker(4, "tcp://127.0.0.1:1"), "endpoint": None})
    assert incomplete.json()["lifecycle"] == "incomplete"
    assert (await selector.get("/loads")).json() == [partition("m", [idle(1)])]
    assert (await selector.get("/dump")).json() == {"m:default": {"block_size": BLOCK, "events": []}}
    assert [row["worker_id"] for row in (await selector.get("/workers")).json()] == [3, 1, 4]


async def test_selection_cache_max_bytes_bounds_what_replays_can_find(nursery: trio.Nursery, tmp_path: Path) -> None:
    """--selection-cache-max-bytes reaches the cache: with room for one small selection, a second evicts
    the first, whose replay then answers 404 while the second's books."""
    room = entry_bytes("s1", Reserve("", 1, 0, (0, 0), isl_tokens=0)) * 3 // 2
    options = ServiceOptions(
        port=0, data_dir=tmp_path / "data", seed=7, body_limit=SELECTION_BODY_LIMIT, selection_cache_max_bytes=room
    )
    handle = await nursery.start(run_service, "selection service", options, select_service_builder(RouterConfig()))
    async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as selector:
        await selector.post("/workers", json=worker(1, "tcp://127.0.0.1:1"))
        prompt = {"model_name": "m", "token_ids": list(range(2 * BLOCK))}
        for selection_id in ("s1", "s2"):
            assert (await selector.post("/select", json={**prompt, "selection_id": selection_id})).status_code == 200
        evicted = await selector.post("/reservations", json={"model_name": "m", "selection_id": "s1"})
        assert evicted.status_code == 404
        kept = await selector.post("/reservations", json={"model_name": "m", "selection_id": "s2"})
        assert kept.status_code == 201
    handle.stop()
