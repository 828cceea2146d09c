"""The HTTP front as a client meets it: early answers close the connection and say so, rejected bodies are
neither buffered past the limit nor kept alive, slow bodies time out, WebSocket upgrades get a 4xx.

Real hypercorn on 127.0.0.1 over raw sockets where the wire matters; the ASGI app in process (virtual
time for the body deadline) where the interleaving or the memory must be controlled.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
import trio

from kvrouter.api.bodies.schemas import AddBody, parse
from kvrouter.api.http import OK, Request, Response, Route
from kvrouter.api.http.app import make_app
from kvrouter.api.process.main import ServiceHandle
from tests.support.raw_http import ResponseReader, connect, exchange, request_bytes

JSON = {"content-type": "application/json"}
LIMIT = 2 * 1024 * 1024  # the slot tracker's
WEBSOCKET_UPGRADE = {
    "connection": "upgrade",
    "upgrade": "websocket",
    "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ==",
    "sec-websocket-version": "13",
}


# -- in-process ASGI --------------------------------------------------------------------------------------


class Client:
    """Calls the ASGI app directly; ``chunks`` are what ``receive`` hands out, one per call."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.received = 0  # body bytes the app pulled

    async def call(
        self, method: str, path: str, chunks: Iterator[bytes] | list[bytes] = (), headers: dict[str, str] = JSON
    ) -> tuple[int, dict[bytes, bytes], bytes]:
        source = iter(chunks)
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            chunk = next(source, None)
            if chunk is None:
                return {"type": "http.request", "body": b"", "more_body": False}
            self.received += len(chunk)
            return {"type": "http.request", "body": chunk, "more_body": True}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "method": method,
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
        }
        await self.app(scope, receive, send)
        return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]


async def parse_add(request: Request) -> Response:
    parse(AddBody, request.json())  # the slot tracker's /add parsing: a 422 for a bad hash
    return OK


def add_app(**options: Any) -> Client:
    return Client(make_app([Route("POST", "/add", parse_add, json_body=True)], body_limit=LIMIT, **options))


def endless(chunk: bytes) -> Iterator[bytes]:
    while True:
        yield chunk


async def test_a_body_over_the_limit_is_refused_without_reading_past_it() -> None:
    client = add_app()
    status, headers, body = await client.call(
        "POST", "/add", endless(b" " * 65536), {**JSON, "transfer-encoding": "chunked"}
    )
    assert (status, orjson.loads(body)) == (413, {"error": "Failed to buffer the request body: length limit exceeded"})
    assert headers[b"connection"] == b"close"
    assert client.received <= LIMIT + 65536  # stopped at the first chunk past the limit


@pytest.fixture
def without_cyclic_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()
        gc.enable()


@pytest.mark.usefixtures("without_cyclic_gc")
async def test_rejected_bodies_are_freed_at_once_not_by_the_cyclic_gc() -> None:
    client = add_app()
    # ~0.2 MB each; the bad last hash makes /add's parsing raise inside cattrs and answer 422.
    hashes: list[object] = [*range(20_000), "x"]
    bad = orjson.dumps({"model_name": "m", "request_id": "r", "worker_id": 1, "dp_rank": 0, "sequence_hashes": hashes})
    await client.call("POST", "/add", [bad])  # warm up caches (cattrs hooks, orjson)
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(10):
        status, _, _ = await client.call("POST", "/add", [bad])
        assert status == 422
    kept = tracemalloc.get_traced_memory()[0] - before
    # The bodies and their parsed JSON add up to ~15 MB when the exception chain keeps them alive.
    assert kept < 2_000_000, f"{kept} bytes still held after 10 rejected bodies"


async def test_a_trickling_body_gets_408_once_its_deadline_passes(autojump_clock: trio.testing.MockClock) -> None:
    client = add_app(body_timeout=10.0)

    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:  # one byte a second, never the end
        await trio.sleep(1.0)
        chunks.append(b" ")
        return {"type": "http.request", "body": b" ", "more_body": True}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/add", "raw_path": b"/add", "query_string": b""}
    start = trio.current_time()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"1000")]
    await client.app({**scope, "headers": headers}, receive, send)
    assert sent[0]["status"] == 408 and (b"connection", b"close") in sent[0]["headers"]
    assert orjson.loads(sent[1]["body"]) == {"error": "the request body did not arrive within 10 s"}
    assert 10.0 < trio.current_time() - start <= 11.0 and len(chunks) == 11


# -- real hypercorn -----------------------------------------------------------------------------------------


async def test_early_413_and_415_say_connection_close_and_close(slot_tracker: ServiceHandle) -> None:
    url = slot_tracker.urls[0]
    too_large = request_bytes("POST", "/add", headers={**JSON, "content-length": str(LIMIT + 1)})
    not_json = request_bytes("POST", "/add", b"{}", {"content-type": "text/plain"})
    for request, status in ((too_large, 413), (not_json, 415)):
        stream = await connect(url)
        async with stream:
            await stream.send_all(request)
            reader = ResponseReader(stream)
            response = await reader.response()
            assert response.status == status and set(response.json()) == {"error"}  # type: ignore[arg-type]
            assert response.closes
            assert await reader.closed()


async def test_a_keep_alive_connection_serves_request_after_request(slot_tracker: ServiceHandle) -> None:
    stream = await connect(slot_tracker.urls[0])
    async with stream:
        reader = ResponseReader(stream)
        for _ in range(3):
            await stream.send_all(request_bytes("POST", "/free", b'{"model_name": "m", "request_id": "r"}', JSON))
            response = await reader.response()
            assert response.status == 404 and not response.closes


@pytest.mark.parametrize(("path", "status"), [("/health", 400), ("/loads", 400), ("/add", 400), ("/nowhere", 404)])
async def test_a_websocket_upgrade_is_a_4xx_with_an_error_body(
    slot_tracker: ServiceHandle, path: str, status: int
) -> None:
    response = await exchange(slot_tracker.urls[0], request_bytes("GET", path, headers=WEBSOCKET_UPGRADE))
    assert response.status == status
    assert set(response.json()) == {"error"}  # type: ignore[arg-type]
    async with httpx.AsyncClient(base_url=slot_tracker.urls[0]) as http:
        assert (await http.get("/health")).status_code == 200  # and the service carries on
