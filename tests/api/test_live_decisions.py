"""GET /ws/decisions and ``"explain": true`` against a real selection service (both process layouts): one message
per selection matching the /select reply, the reasons (tie, load, cache, constraint), the same explanation in
the reply, replies unchanged without it, filters, the drop-oldest bound, and the subscriber limit."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from trio_websocket import ConnectionClosed, WebSocketConnection

from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.api.process.main import (
    ServiceHandle,
)
from kvrouter.api.streams import decisions as live_decisions
from kvrouter.api.streams.live import DEFAULT_STREAMS, StreamSettings
from kvrouter.client.live import open_stream, stream_url
from tests.support.stream_services import SELECT, serving

LAYOUTS = ["one-process", "proxied"]
APPROXIMATE = RouterConfig(use_kv_events=False)  # bookings are the cache: no KV publisher needed


@contextlib.asynccontextmanager
async def selector(
    data_dir: Path, layout: str, config: RouterConfig = APPROXIMATE, streams: StreamSettings = DEFAULT_STREAMS
) -> AsyncIterator[tuple[ServiceHandle, httpx.AsyncClient]]:
    async with (
        serving(SELECT, data_dir, layout, streams, config) as handle,
        httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http,
    ):
        yield handle, http


async def add_workers(http: httpx.AsyncClient, *ids: int, ranks: int = 1, model: str = "m") -> None:
    for worker in ids:
        body = {
            "worker_id": worker,
            "model_name": model,
            "block_size": 4,
            "endpoint": f"http://w{worker}",
            "data_parallel_size": ranks,
        }
        assert (await http.post("/workers", json=body)).status_code == 201


def prompt(first: int, model: str = "m", **fields: Any) -> dict[str, Any]:
    return {"model_name": model, "token_ids": list(range(first, first + 16)), **fields}


async def decision(ws: WebSocketConnection) -> dict[str, Any]:
    while True:
        found = orjson.loads(await ws.get_message())
        if found["type"] != "heartbeat":
            return found


@contextlib.asynccontextmanager
async def decisions(handle: ServiceHandle, query: str = "") -> AsyncIterator[WebSocketConnection]:
    url = stream_url(handle.urls[0] + (f"?{query}" if query else ""), "/ws/decisions")
    async with open_stream(url) as ws:
        assert (await decision(ws))["type"] == "ready"
        yield ws


REPLY_FIELDS = ("worker_id", "dp_rank", "endpoint", "overlap", "effective_prefill_tokens", "potential_decode_blocks")


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_each_selection_is_one_message_matching_its_reply_with_reasons(tmp_path: Path, layout: str) -> None:
    async with selector(tmp_path, layout) as (service, http), decisions(service) as ws:
        await add_workers(http, 1, 2)
        reply = (await http.post("/select", json=prompt(0))).json()
        seen = await decision(ws)
        assert seen["type"] == "decision" and seen["reserved"] is False
        assert {field: seen[field] for field in REPLY_FIELDS} == {field: reply[field] for field in REPLY_FIELDS}
        assert seen["explain"]["reason"] == "tie"  # two idle, cold workers: same cost, the draw chose
        assert [c["cost"] for c in seen["explain"]["candidates"]] == [8.0, 8.0]  # 4 prefill + 4 decode blocks

        booked = (await http.post("/select_and_reserve", json=prompt(0, reservation_id="r1"))).json()
        seen_booked = await decision(ws)
        assert seen_booked["reserved"] is True and seen_booked["reservation_id"] == "r1"
        assert seen_booked["seq"] == seen["seq"] + 1
        assert (seen_booked["worker_id"], seen_booked["dp_rank"]) == (booked["worker_id"], booked["dp_rank"])
        holder = booked["worker_id"]
        assert (await http.post("/reservations/r1/prefill_complete")).status_code == 200

        # The same prompt again: the holder has it cached (approximate mode counts bookings).
        again = (await http.post("/select", json=prompt(0))).json()
        cached = await decision(ws)
        assert again["worker_id"] == cached["worker_id"] == holder
        assert cached["explain"]["reason"] == "cache"
        assert max(c["cached_tokens"] for c in cached["explain"]["candidates"]) == 16

        # Another prompt: the holder is busy, the other worker is cheaper on load alone.
        other = (await http.post("/select", json=prompt(1000))).json()
        by_load = await decision(ws)
        assert other["worker_id"] == by_load["worker_id"] != holder
        assert by_load["explain"]["reason"] == "load"

        pinned = prompt(1000, pinned_worker={"worker_id": holder, "dp_rank": 0})
        assert (await http.post("/select", json=pinned)).json()["worker_id"] == holder
        forced = await decision(ws)
        assert forced["explain"]["reason"] == "constraint" and forced["explain"]["rule"] == "pinned_worker"
        excluded = [c for c in forced["explain"]["candidates"] if c["worker_id"] != holder]
        assert excluded[0]["excluded"] == "pinned_worker" and excluded[0]["cost"] is None


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_explain_true_adds_the_explanation_and_changes_nothing_else(tmp_path: Path, layout: str) -> None:
    async with selector(tmp_path, layout) as (service, http):
        await add_workers(http, 1, 2)
        assert (await http.post("/select_and_reserve", json=prompt(0, reservation_id="busy"))).status_code == 200
        plain = await http.post("/select", json=prompt(500))
        off = await http.post("/select", json=prompt(500, explain=False))
        assert plain.content == off.content  # byte for byte
        explained = (await http.post("/select", json=prompt(500, explain=True))).json()
        explanation = explained.pop("explain")
        assert explained == plain.json()
        assert explanation["reason"] == "load"
        assert {(c["worker_id"], c["active_requests"]) for c in explanation["candidates"]} == {(1, 1), (2, 0)} or {
            (c["worker_id"], c["active_requests"]) for c in explanation["candidates"]
        } == {(1, 0), (2, 1)}
        booked = (await http.post("/select_and_reserve", json=prompt(900, reservation_id="x", explain=True))).json()
        assert booked["explain"]["reason"] in ("load", "tie")
        async with decisions(service) as ws:  # with a subscriber, the reply and the message say the same
            reply = (await http.post("/select", json=prompt(700, explain=True))).json()
            assert (await decision(ws))["explain"] == reply["explain"]
        bad = await http.post("/select", json=prompt(1, explain=1))
        assert bad.status_code == 422


async def test_filters_and_a_plain_get(tmp_path: Path) -> None:
    async with selector(tmp_path, "one-process") as (service, http):
        await add_workers(http, 1, model="a")
        await add_workers(http, 2, model="b")
        async with decisions(service, "model_name=b") as only_b:
            assert (await http.post("/select", json=prompt(0, model="a"))).status_code == 200
            assert (await http.post("/select", json=prompt(0, model="b"))).status_code == 200
            seen = await decision(only_b)
            assert (seen["model_name"], seen["worker_id"]) == ("b", 2)
        response = await http.get("/ws/decisions")
        assert response.status_code == 426


async def test_a_slow_subscriber_gets_the_newest_decisions_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader with a 4 KiB buffer that reads nothing while 40 selections of 64 candidates each (~16 KB per
    message) are made: its queue (bounded at 32 KB here) drops the oldest; it then reads the newest, with gaps."""
    monkeypatch.setattr(live_decisions, "QUEUE_BYTES", 32_000)
    async with selector(tmp_path, "one-process") as (service, http):
        await add_workers(http, 1, ranks=64)
        url = stream_url(service.urls[0], "/ws/decisions")
        async with open_stream(url, receive_buffer=4096) as ws:
            ready = await decision(ws)
            for i in range(40):
                assert (await http.post("/select", json=prompt(i * 100))).status_code == 200
            seqs = []
            while not seqs or seqs[-1] < ready["seq"] + 40:
                seqs.append((await decision(ws))["seq"])
        # In order and ending with the newest. (Whether any were dropped depends on how much the kernel's socket
        # buffers took: the hub writes each read's chunk to the socket at once while its subscriber waits.)
        assert seqs == sorted(seqs) and seqs[-1] == ready["seq"] + 40


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_beyond_the_limit_a_subscriber_is_closed_with_1013(tmp_path: Path, layout: str) -> None:
    settings = StreamSettings(max_subscribers=1)
    async with (
        selector(tmp_path, layout, streams=settings) as (service, _),
        decisions(service),
        open_stream(stream_url(service.urls[0], "/ws/decisions")) as second,
    ):
        with pytest.raises(ConnectionClosed) as closed:
            await second.get_message()
        assert closed.value.reason.code == 1013


def sample(text: str, name: str) -> float | None:
    """The value of the exposition line starting with ``name`` (labels included), None if absent."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_stream_counters_move_in_the_metrics(tmp_path: Path, layout: str) -> None:
    settings = StreamSettings(max_subscribers=1)
    async with selector(tmp_path, layout, streams=settings) as (service, http), decisions(service) as ws:
        await add_workers(http, 1, 2)
        assert (await http.post("/select", json=prompt(0))).status_code == 200
        assert (await decision(ws))["explain"]["reason"] == "tie"
        async with open_stream(stream_url(service.urls[0], "/ws/decisions")) as second:
            with pytest.raises(ConnectionClosed):
                await second.get_message()
        text = (await http.get("/metrics")).text
        assert sample(text, 'kvrouter_stream_subscribers{stream="decisions"}') == 1.0
        assert sample(text, 'kvrouter_stream_refused_total{stream="decisions"}') == 1.0
        assert sample(text, 'kvrouter_selections_explained_total{reason="tie"}') == 1.0
