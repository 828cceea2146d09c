"""GET /ws/loads against a real server (both services, both process layouts): the snapshot then one update per
change with per-scope sequence numbers, filters, a subscriber that does not read (the lifecycle goes on, it
gets the latest state), the subscriber limit (1013), heartbeats, a plain GET, and the service stopping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio
from trio_websocket import ConnectionClosed, ConnectionRejected, WebSocketConnection

from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.api.process.main import (
    ServiceHandle,
)
from kvrouter.api.streams.live import StreamSettings
from kvrouter.client.live import open_stream, stream_url
from tests.support.stream_services import SELECT, SLOT, serving


def loads_url(handle: ServiceHandle, query: str = "") -> str:
    return stream_url(handle.urls[0] + (f"?{query}" if query else ""), "/ws/loads")


async def message(ws: WebSocketConnection) -> dict[str, Any]:
    """The next message that is not a heartbeat."""
    while True:
        found = orjson.loads(await ws.get_message())
        if found["type"] != "heartbeat":
            return found


def register(worker: int, model: str = "llama", tenant: str = "default", dp_size: int = 2) -> dict[str, Any]:
    return {
        "worker_id": worker,
        "model_name": model,
        "tenant_id": tenant,
        "block_size": 16,
        "dp_start": 0,
        "dp_size": dp_size,
    }


def add(request_id: str, worker: int = 7, rank: int = 0, model: str = "llama", isl: int = 100) -> dict[str, Any]:
    return {
        "model_name": model,
        "request_id": request_id,
        "worker_id": worker,
        "dp_rank": rank,
        "sequence_hashes": [1, 2, 3],
        "new_isl_tokens": isl,
    }


async def ok(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> None:
    response = await http.post(path, json=body)
    assert response.status_code in (200, 201), response.text


def without_seq(scope: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in scope.items() if name != "seq"}


@pytest.mark.parametrize("layout", ["one-process", "proxied"])
async def test_slot_tracker_snapshot_then_one_update_per_change(tmp_path: Path, layout: str) -> None:
    async with serving(SLOT, tmp_path, layout) as service, httpx.AsyncClient(base_url=service.urls[0]) as http:
        await ok(http, "/register", register(7))
        async with open_stream(loads_url(service)) as ws:
            snapshot = await message(ws)
            assert snapshot["type"] == "snapshot"
            [scope] = snapshot["scopes"]
            assert scope["loads"] == (await http.get("/loads")).json()
            assert (scope["model_name"], scope["tenant_id"], scope["routing_group"]) == ("llama", "default", "default")
            seq = scope["seq"]
            await ok(http, "/add", add("r1"))
            update = await message(ws)
            assert update["type"] == "update" and update["seq"] == seq + 1
            assert update["loads"] == (await http.get("/loads")).json()
            assert update["loads"][0]["active_prefill_tokens"] == 100
            await ok(http, "/free", {"model_name": "llama", "request_id": "r1"})
            update = await message(ws)
            assert update["seq"] == seq + 2
            assert update["loads"][0]["active_prefill_tokens"] == 0
            await ok(http, "/unregister", {"model_name": "llama", "worker_id": 7})
            gone = await message(ws)
            assert gone["seq"] == seq + 3 and gone["loads"] == []


@pytest.mark.parametrize("layout", ["one-process", "proxied"])
async def test_selection_service_partitions_as_get_loads_lists_them(tmp_path: Path, layout: str) -> None:
    async with serving(SELECT, tmp_path, layout) as service, httpx.AsyncClient(base_url=service.urls[0]) as http:
        worker = {
            "worker_id": 1,
            "model_name": "m",
            "block_size": 4,
            "endpoint": "http://w1",
            "kv_events_endpoint": "tcp://127.0.0.1:1",
        }
        assert (await http.post("/workers", json=worker)).status_code == 201
        async with open_stream(loads_url(service)) as ws:
            snapshot = await message(ws)
            [partition] = snapshot["scopes"]
            assert without_seq(partition) == (await http.get("/loads")).json()[0]
            body = {"model_name": "m", "token_ids": list(range(12)), "reservation_id": "a"}
            assert (await http.post("/select_and_reserve", json=body)).status_code == 200
            update = await message(ws)
            assert update["type"] == "update" and update["seq"] > partition["seq"]
            assert without_seq(update) | {"type": "update"} == (await http.get("/loads")).json()[0] | {"type": "update"}
            assert update["loads"][0]["active_requests"] == 1


async def test_filters_by_model_and_tenant_with_the_routing_group_alias(tmp_path: Path) -> None:
    async with serving(SLOT, tmp_path, "one-process") as service, httpx.AsyncClient(base_url=service.urls[0]) as http:
        await ok(http, "/register", register(1, model="a"))
        await ok(http, "/register", register(2, model="b"))
        await ok(http, "/register", register(3, model="a", tenant="t2"))
        async with (
            open_stream(loads_url(service, "model_name=a")) as only_a,
            open_stream(loads_url(service, "model_name=a&routing_group=t2")) as only_a_t2,
        ):
            first = await message(only_a)
            assert sorted((s["model_name"], s["tenant_id"]) for s in first["scopes"]) == [("a", "default"), ("a", "t2")]
            assert [(s["model_name"], s["tenant_id"]) for s in (await message(only_a_t2))["scopes"]] == [("a", "t2")]
            await ok(http, "/add", add("rb", worker=2, model="b"))  # not theirs
            await ok(http, "/add", {**add("ra", worker=3, model="a"), "tenant_id": "t2"})
            update = await message(only_a)
            assert (update["model_name"], update["tenant_id"]) == ("a", "t2")
            assert (await message(only_a_t2))["loads"][0]["active_prefill_tokens"] == 100


async def test_a_repeated_filter_refuses_the_upgrade_with_400(tmp_path: Path) -> None:
    async with serving(SLOT, tmp_path, "one-process") as service:
        with pytest.raises(ConnectionRejected) as refused:
            async with open_stream(loads_url(service, "model_name=a&model_name=b")):
                pass
        assert refused.value.status_code == 400
        assert b"duplicate field `model_name`" in (refused.value.body or b"")


async def test_a_plain_get_is_426(tmp_path: Path) -> None:
    async with serving(SLOT, tmp_path, "one-process") as service, httpx.AsyncClient(base_url=service.urls[0]) as http:
        response = await http.get("/ws/loads")
        assert response.status_code == 426
        assert "WebSocket" in response.json()["error"]


@pytest.mark.parametrize("layout", ["one-process", "proxied"])
async def test_a_subscriber_that_does_not_read_gets_the_latest_state_and_blocks_nothing(
    tmp_path: Path, layout: str
) -> None:
    """512 ranks make each message ~75 KB: a reader with a 4 KiB buffer that reads nothing blocks the service's
    sends at once, while 200 lifecycle writes all complete; it then reads the final state, with gaps in
    ``seq`` where intermediate states were conflated."""
    async with serving(SLOT, tmp_path, layout) as service, httpx.AsyncClient(base_url=service.urls[0]) as http:
        await ok(http, "/register", register(7, dp_size=512))
        async with open_stream(loads_url(service), receive_buffer=4096) as ws:
            first = await message(ws)
            seq = first["scopes"][0]["seq"]
            for i in range(100):  # the reader reads nothing meanwhile
                await ok(http, "/add", add(f"r{i}", rank=i % 512))
                await ok(
                    http,
                    "/free",
                    {"model_name": "llama", "request_id": f"r{i}"}
                    if i % 2
                    else {"model_name": "llama", "request_id": "none"},
                )
            await ok(http, "/add", add("last", rank=5, isl=777))
            final = (await http.get("/loads")).json()
            seen = []
            while True:
                update = await message(ws)
                seen.append(update["seq"])
                if update["loads"] == final:
                    break
        changes = 100 + 50 + 1  # adds, frees of existing requests, the last add
        assert seen[-1] == seq + changes
        assert len(seen) < changes  # conflated: not one message per change


@pytest.mark.parametrize("layout", ["one-process", "proxied"])
async def test_beyond_the_subscriber_limit_a_connection_is_closed_with_1013(tmp_path: Path, layout: str) -> None:
    async with serving(SLOT, tmp_path, layout, StreamSettings(max_subscribers=2)) as service:
        async with open_stream(loads_url(service)) as one, open_stream(loads_url(service)) as two:
            assert (await message(one))["type"] == (await message(two))["type"] == "snapshot"
            async with open_stream(loads_url(service)) as three:
                with pytest.raises(ConnectionClosed) as closed:
                    await three.get_message()
                assert closed.value.reason.code == 1013
                assert "try again later" in (closed.value.reason.reason or "")
        async with open_stream(loads_url(service)) as again:  # the first two left: room again
            assert (await message(again))["type"] == "snapshot"


async def test_an_idle_subscriber_gets_heartbeats(tmp_path: Path) -> None:
    settings = StreamSettings(heartbeat_seconds=0.05)
    async with serving(SLOT, tmp_path, "one-process", settings) as service, open_stream(loads_url(service)) as ws:
        assert orjson.loads(await ws.get_message()) == {"type": "snapshot", "scopes": []}
        assert orjson.loads(await ws.get_message()) == {"type": "heartbeat"}
        await ws.send_message("anything")  # client messages are ignored
        assert orjson.loads(await ws.get_message()) == {"type": "heartbeat"}


async def test_subscribers_are_closed_with_1001_when_the_service_stops(tmp_path: Path) -> None:
    async with serving(SLOT, tmp_path, "one-process") as service, open_stream(loads_url(service)) as ws:
        await message(ws)
        service.stop()
        with pytest.raises(ConnectionClosed) as closed:
            await ws.get_message()
        assert closed.value.reason.code == 1001


@pytest.mark.parametrize("layout", ["one-process", "proxied"])
async def test_a_selection_waiting_in_the_queue_shows_in_pending_count(tmp_path: Path, layout: str) -> None:
    """Parking a selection changes no state (no event): the queue tells the feed itself."""
    config = RouterConfig(use_kv_events=False, router_queue_threshold=1.0)
    async with (
        serving(SELECT, tmp_path, layout, config=config) as service,
        httpx.AsyncClient(base_url=service.urls[0], timeout=30) as http,
        trio.open_nursery() as nursery,
    ):
        worker = {
            "worker_id": 1,
            "model_name": "m",
            "block_size": 4,
            "endpoint": "http://w",
            "max_num_batched_tokens": 10,
        }
        assert (await http.post("/workers", json=worker)).status_code == 201
        first = {"model_name": "m", "token_ids": list(range(12)), "reservation_id": "a"}
        booked = await http.post("/select_and_reserve", json=first)
        assert booked.status_code == 200, booked.text
        async with open_stream(loads_url(service)) as ws:
            [partition] = (await message(ws))["scopes"]
            assert partition["pending_count"] == 0

            async def book_second() -> None:
                second = {"model_name": "m", "token_ids": list(range(100, 120)), "reservation_id": "b"}
                assert (await http.post("/select_and_reserve", json=second)).status_code == 200

            nursery.start_soon(book_second)
            queued = await message(ws)
            assert (queued["pending_count"], queued["pending_isl_tokens"]) == (1, 20)
            assert (await http.post("/reservations/a/prefill_complete")).status_code == 200
            while True:  # the prefill completes and b is admitted: maybe one update, maybe two
                admitted = await message(ws)
                if admitted["pending_count"] == 0 and admitted["loads"][0]["active_requests"] == 2:
                    break
