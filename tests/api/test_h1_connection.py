"""kvrouter's HTTP/1.x (api/http/h1_connection.py): for a well-formed request, what a client receives is what
hypercorn sends, byte for byte.

Each plain case sends the same bytes to a real server on 127.0.0.1 twice, once to kvrouter's server and once
to hypercorn's own (``hypercorn.trio.serve``, same config), and reads everything until the server closes the
connection (a short keep-alive timeout ends the kept ones); only the ``date`` header's value is masked. The
cases cover GET, HEAD, POST bodies in pieces, pipelining, answers without reading the body, app failures,
streamed and chunked responses, refused headers and lengths. The rest of HTTP/1.x (chunked bodies,
``Expect``, ``Connection: close``, HTTP/1.0, malformed requests) is kvrouter's own too, checked by what a
client must see; only HTTP/2 goes to hypercorn (its stock connection), from the first byte of its request.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import hypercorn.trio
import orjson
import pytest
import trio

import kvrouter.api.http.server as server_module
from kvrouter.api.http import h1_connection
from kvrouter.api.http.h1_connection import send_whole_response
from kvrouter.api.http.server import HttpSettings, hypercorn_config, serve_http
from tests.support.raw_http import connect, request_bytes

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
EOF = b""  # (as a piece: the client ends its side of the stream)
IDLE = 0.4  # seconds a kept connection stays open after its last response, so each exchange ends


async def read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"<disconnect>"
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


# Response heads as an app might send them: (status, headers, body). h11 sends, merges or refuses each.
HEADS: dict[str, tuple[int, list[tuple[bytes, bytes]], bytes]] = {
    "/head/two-equal-lengths": (200, [(b"content-length", b"1"), (b"Content-Length", b"1")], b"x"),
    "/head/length-list": (200, [(b"content-length", b"1, 1")], b"x"),
    "/head/lengths-01-and-1": (200, [(b"content-length", b"01"), (b"content-length", b"1")], b"x"),
    "/head/status-minus-1": (-1, [(b"content-length", b"1")], b"x"),
    "/head/status-99": (99, [(b"content-length", b"1")], b"x"),
    "/head/status-1000": (1000, [(b"content-length", b"1")], b"x"),
    "/head/204-chunked": (204, [(b"Transfer-Encoding", b"Chunked")], b""),
    "/head/chunked-and-length": (200, [(b"content-length", b"3"), (b"transfer-encoding", b"chunked")], b"abc"),
    "/head/gzip": (200, [(b"transfer-encoding", b"gzip")], b"x"),
    "/head/two-encodings": (200, [(b"transfer-encoding", b"chunked"), (b"transfer-encoding", b"chunked")], b"x"),
    "/head/host": (200, [(b"content-length", b"1"), (b"x-a", b"1"), (b"Host", b"h")], b"x"),
    "/head/too-short": (200, [(b"content-length", b"3")], b"xx"),
}


async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """Paths choose a behaviour; the answer shows what the app was given."""
    path = scope["path"]
    method = scope["method"]
    if path in HEADS:
        status, head, content = HEADS[path]
        await send_whole_response(
            send,
            {"type": "http.response.start", "status": status, "headers": head},
            {"type": "http.response.body", "body": content},
        )
        return
    if path == "/early":  # answers without reading the body
        await send({"type": "http.response.start", "status": 404, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"no"})
        return
    body = await read_body(receive)
    if path == "/fail":
        raise RuntimeError("the app fails before answering")
    if path == "/fail-after-head":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"9")]})
        raise RuntimeError("the app fails after its head")
    if path == "/stream":  # no length: chunked
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for piece in (b"one ", b"", b"two "):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"three"})
        return
    if path == "/stream-short":  # a length the pieces do not reach
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"9")]})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        await send({"type": "http.response.body", "body": b"b"})
        return
    if path == "/wait-disconnect":  # answers once the client has gone
        message = await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]})
        await send({"type": "http.response.body", "body": message["type"].encode()[-4:]})
        return
    if path == "/bad-header":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-bad", b"a\r\nb: c")]})
        await send({"type": "http.response.body", "body": b""})
        return
    if path == "/too-long":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"three"})
        return
    if path == "/no-content":
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    if path == "/close":
        headers = [(b"content-length", b"6"), (b"Connection", b"close")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"closed"})
        return
    answer = b"%s %s %s q=%s body=%s h=%s" % (
        method.encode(),
        scope["raw_path"],
        path.encode(),
        scope["query_string"],
        body,
        b";".join(b"%s=%s" % pair for pair in scope["headers"] if pair[0] != b"host"),
    )
    headers = [
        (b"content-length", str(len(answer)).encode()),
        (b"X-Kind", b" whole "),
        (b"content-type", b"text/plain"),
    ]
    await send_whole_response(
        send,
        {"type": "http.response.start", "status": 201, "headers": headers},
        {"type": "http.response.body", "body": b"" if method == "HEAD" else answer},
    )


@asynccontextmanager
async def serving(plain: bool, **settings: Any) -> AsyncIterator[str]:
    stop = trio.Event()
    config = hypercorn_config("127.0.0.1", 0, HttpSettings(idle_timeout=IDLE, **settings))
    config.h11_max_incomplete_size = 4096
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            if plain:
                binds = await nursery.start(serve_http, app, config, stop.wait)
            else:
                binds = await nursery.start(partial(hypercorn.trio.serve, app, config, shutdown_trigger=stop.wait))
            yield binds[0]
            stop.set()


DATE = re.compile(rb"date: [^\r]*\r\n")


async def wire(plain: bool, pieces: list[bytes], **settings: Any) -> bytes:
    """Everything the server sends for ``pieces`` (sent a moment apart) until it closes the connection."""
    async with serving(plain, **settings) as url, await connect(url) as stream:
        for index, piece in enumerate(pieces):
            if index:
                await trio.sleep(0.05)
            if piece is EOF:
                await stream.send_eof()
            else:
                await stream.send_all(piece)
        received = b""
        try:
            while chunk := await stream.receive_some(65536):
                received += chunk
        except trio.BrokenResourceError:
            received += b"<reset>"
    return DATE.sub(b"date: <masked>\r\n", received)


def post(path: str, body: bytes, **headers: str) -> bytes:
    return request_bytes("POST", path, body, headers)


PLAIN_CASES = {
    "get": [request_bytes("GET", "/a%2Fb/c?x=1&y=%20")],
    "head": [request_bytes("HEAD", "/h")],
    "post": [post("/p", b'{"a": 1}', **{"Content-Type": "application/json", "X-Pad": "  spaced  "})],
    "pipelined": [request_bytes("GET", "/1") + post("/2", b"body") + request_bytes("HEAD", "/3")],
    "body in pieces": [post("/p", b"0123456789")[:-10], b"01234", b"56789"],
    "head in pieces": [b"GET /slow HTTP/1.1\r\nho", b"st: x\r\n", b"\r\n"],
    "empty body": [post("/p", b"", **{"content-length": "0"})],
    "answered before the body": [post("/early", b"unread body")],
    "answered before the body, then another request": [post("/early", b"unread body") + request_bytes("GET", "/2")],
    "answered before the body, another request later": [post("/early", b"unread body"), request_bytes("GET", "/2")],
    "the end of the stream while the app waits for it": [request_bytes("GET", "/wait-disconnect"), EOF],
    "streamed body under its length": [request_bytes("GET", "/stream-short")],
    **{f"response head {path.rpartition('/')[2]}": [request_bytes("GET", path)] for path in HEADS},
    "app fails": [request_bytes("GET", "/fail") + request_bytes("GET", "/after")],
    "app fails after its head": [request_bytes("GET", "/fail-after-head")],
    "streamed": [request_bytes("GET", "/stream") + request_bytes("HEAD", "/stream")],
    "header refused": [request_bytes("GET", "/bad-header")],
    "body over its length": [request_bytes("GET", "/too-long")],
    "no content": [request_bytes("GET", "/no-content") + request_bytes("GET", "/after")],
    "app closes": [request_bytes("GET", "/close") + request_bytes("GET", "/after")],
    "keep-alive header": [request_bytes("GET", "/k", headers={"Connection": "keep-alive"})],
    "partial head, then silence": [b"GET /x HTTP/1.1\r\nHost: a\r\n"],
}

# What a client sees of the rest of HTTP/1.x, after a plain request on the same connection: the statuses in order
# (then the connection closes), and a text each answer after the first must hold.
OTHER_CASES: dict[str, tuple[list[bytes], list[int], bytes]] = {
    "chunked body": (
        [request_bytes("GET", "/1") + post("/c", b"", **{"Transfer-Encoding": "chunked"}) + b"3\r\nabc\r\n0\r\n\r\n"],
        [201, 201],
        b"body=abc",
    ),
    "expect 100-continue": (
        [request_bytes("GET", "/1") + post("/e", b"ab", Expect="100-continue")],
        [201, 100, 201],
        b"",
    ),
    "connection close": (
        [request_bytes("GET", "/1") + request_bytes("GET", "/2", headers={"Connection": "close"})],
        [201, 201],
        b"connection: close",
    ),
    "http/1.0": ([request_bytes("GET", "/1") + b"GET /old HTTP/1.0\r\n\r\n"], [201, 201], b"connection: close"),
    "absolute form": ([request_bytes("GET", "/1") + b"GET http://a/x HTTP/1.1\r\nhost: a\r\n\r\n"], [201, 201], b"/x"),
    "leading blank line": ([request_bytes("GET", "/1") + b"\r\nGET /x HTTP/1.1\r\nhost: a\r\n\r\n"], [201, 201], b""),
    "no host": ([request_bytes("GET", "/1") + b"GET /nohost HTTP/1.1\r\n\r\n"], [201, 400], b'{"error":'),
    "two hosts": (
        [request_bytes("GET", "/1") + b"GET /2 HTTP/1.1\r\nhost: a\r\nhost: b\r\n\r\n"],
        [201, 400],
        b'{"error":',
    ),
    "oversized head": (
        [request_bytes("GET", "/1") + request_bytes("GET", "/big", headers={"x-big": "y" * 5000})],
        [201, 431],
        b'{"error":',
    ),
    "bare LF head": ([request_bytes("GET", "/1") + b"GET /x HTTP/1.1\nHost: a\n\n"], [201, 400], b'{"error":'),
    "head ending in CRLF LF": (
        [request_bytes("GET", "/1") + b"GET /x HTTP/1.1\r\nHost: a\r\n\n"],
        [201, 400],
        b'{"error":',
    ),
    "TLS hello": ([request_bytes("GET", "/1") + b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03"], [201], b""),
    "two spaces in the request line": (
        [request_bytes("GET", "/1") + b"GET  /x HTTP/1.1\r\nhost: a\r\n\r\n"],
        [201, 201],  # (llhttp takes it)
        b"/x",
    ),
    "garbage": ([request_bytes("GET", "/1") + b"\x16\x03\x01 not http\r\n\r\n"], [201, 400], b'{"error":'),
    "lower-case method": (
        [request_bytes("GET", "/1") + b"get /x HTTP/1.1\r\nhost: a\r\n\r\n"],
        [201, 400],
        b'{"error":',
    ),
    "bad content-length": (
        [request_bytes("GET", "/1") + b"POST /x HTTP/1.1\r\nhost: a\r\ncontent-length: +3\r\n\r\nabc"],
        [201, 400],
        b'{"error":',
    ),
    "HTTP/1.2": ([request_bytes("GET", "/1") + b"GET /x HTTP/1.2\r\nhost: a\r\n\r\n"], [201, 505], b'{"error":'),
    "body cut short by the end of the stream": ([post("/p", b"0123456789")[:-5], EOF], [400], b'{"error":'),
    "partial head, then the end of the stream": ([b"GET /x HTTP/1.1\r\nHost: a\r\n", EOF], [400], b'{"error":'),
}


def statuses(received: bytes) -> list[int]:
    return [int(status) for status in re.findall(rb"HTTP/1\.1 (\d+) ", received)]


async def counting_hypercorn_connections(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    made: list[int] = []
    original = server_module.TCPServer

    def counted(*args: Any) -> Any:
        made.append(1)
        return original(*args)

    monkeypatch.setattr(server_module, "TCPServer", counted)
    return made


@pytest.mark.parametrize("case", sorted(PLAIN_CASES))
async def test_a_plain_request_gets_what_hypercorn_sends(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    made = await counting_hypercorn_connections(monkeypatch)
    ours = await wire(True, PLAIN_CASES[case])
    assert made == []
    assert ours == await wire(False, PLAIN_CASES[case])


@pytest.mark.parametrize("case", sorted(OTHER_CASES))
async def test_the_rest_of_http_1_is_answered_by_kvrouter(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    made = await counting_hypercorn_connections(monkeypatch)
    pieces, expected, text = OTHER_CASES[case]
    received = await wire(True, pieces)
    assert made == []
    assert statuses(received) == expected, received
    if text:
        assert text in received.partition(b"\r\n\r\n")[2] if len(expected) == 1 else text in received
    if expected[-1] >= 400:
        error = received[received.rindex(b"\r\n\r\n") + 4 :]
        assert set(orjson.loads(error)) == {"error"}


async def test_an_h2c_upgrade_switches_to_hypercorns_http2_from_the_request_s_first_byte(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = await counting_hypercorn_connections(monkeypatch)
    upgrade = {"Upgrade": "h2c", "Connection": "Upgrade, HTTP2-Settings", "HTTP2-Settings": "AAMAAABkAAQAAP__"}
    pieces = [request_bytes("GET", "/1") + request_bytes("GET", "/u", headers=upgrade)]
    ours = await wire(True, pieces)
    assert made == [1]
    alone = await wire(False, pieces)
    # HTTP/2 after the 101: frames the same size (their dates, HPACK-coded, differ)
    switched = b"upgrade: h2c\r\n\r\n"
    assert switched in ours
    assert ours.partition(switched)[0] + b"%d" % len(ours) == alone.partition(switched)[0] + b"%d" % len(alone)


async def test_a_head_must_arrive_within_the_idle_timeout() -> None:
    async with serving(True) as url, await connect(url) as stream:
        await stream.send_all(b"GET /slow HTTP/1.1\r\nhost: a\r\n")  # and never the blank line
        with trio.fail_after(10):
            assert await stream.receive_some(65536) == b""  # closed, unanswered


async def test_a_body_that_stops_coming_for_the_read_timeout_is_answered_as_hypercorn_does() -> None:
    # The app hears of the disconnect and answers; then the connection closes.
    pieces = [post("/p", b"0123456789")[:-5]]
    plain = await wire(True, pieces, body_timeout=0.3)
    assert b"body=<disconnect>" in plain
    assert plain == await wire(False, pieces, body_timeout=0.3)


async def wire_across_a_stop(before: bytes, after: bytes) -> bytes:
    """What the server sends for ``before``, then for ``after`` sent once it has begun to stop (draining)."""
    stop = trio.Event()
    config = hypercorn_config("127.0.0.1", 0, HttpSettings(idle_timeout=60))
    received = b""
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(serve_http, app, config, stop.wait)
            async with await connect(binds[0]) as stream:
                await stream.send_all(before)
                received = await stream.receive_some(65536)
                stop.set()
                await trio.sleep(0.1)  # draining: listeners closed, kept connections may still send
                await stream.send_all(after)
                while chunk := await stream.receive_some(65536):
                    received += chunk
    return DATE.sub(b"date: <masked>\r\n", received)


@pytest.mark.parametrize(("path", "status"), [("/2", 201), ("/fail", 500), ("/stream", 200)])
async def test_while_draining_every_answer_says_close(path: str, status: int) -> None:
    received = await wire_across_a_stop(request_bytes("GET", "/1"), request_bytes("GET", path))
    assert statuses(received) == [201, status]
    answer = received[received.index(b"HTTP/1.1 ", 1) :]
    assert b"connection: close\r\n" in answer


async def test_a_pipelining_client_cannot_keep_other_tasks_waiting() -> None:
    """Requests answered from bytes already read (big heads, a few per read, an app that never waits) give
    way to the server's other tasks every ``YIELD_EVERY`` requests."""
    turns = 0
    seen: list[int] = []

    async def other_task() -> None:
        nonlocal turns
        while True:
            turns += 1
            await trio.lowlevel.checkpoint()

    async def quick(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        seen.append(turns)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    padded = request_bytes("GET", "/", headers={"x-pad": "y" * 5000})  # ~12 to a 64 KiB read
    stop = trio.Event()
    config = hypercorn_config("127.0.0.1", 0, HttpSettings(idle_timeout=5))
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(serve_http, quick, config, stop.wait)
            nursery.start_soon(other_task)
            async with await connect(binds[0]) as stream:
                nursery.start_soon(stream.send_all, padded * 400)
                received = 0
                while received < 400:
                    received += (await stream.receive_some(1 << 20)).count(b"HTTP/1.1 200 ")
            stop.set()
            nursery.cancel_scope.cancel()
    # (Between two turns of the other task: up to YIELD_EVERY requests before the server gives way, and as
    # many again if the scheduler then runs the server first.)
    longest = max(sum(1 for _ in run) for _, run in itertools.groupby(seen))
    assert longest <= 2 * h1_connection.YIELD_EVERY


async def test_an_idle_plain_connection_is_closed_when_the_server_stops() -> None:
    stop = trio.Event()
    config = hypercorn_config("127.0.0.1", 0, HttpSettings(idle_timeout=60))
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(serve_http, app, config, stop.wait)
            async with await connect(binds[0]) as stream:
                await stream.send_all(request_bytes("GET", "/1"))
                first = await stream.receive_some(65536)
                assert first.startswith(b"HTTP/1.1 201 ") and b"connection: close" not in first
                stop.set()
                # Told nothing more, the idle connection is closed by the drain (not after 60 s).
                assert await stream.receive_some(65536) == b""


async def test_a_request_during_the_drain_is_answered_and_told_to_close() -> None:
    received = await wire_across_a_stop(request_bytes("GET", "/1"), request_bytes("GET", "/2"))
    answer = received[received.index(b"HTTP/1.1 ", 1) :]  # the answer to the request sent while draining
    assert answer.startswith(b"HTTP/1.1 201 ") and b"connection: close\r\n" in answer


async def test_two_thousand_pipelined_requests_are_answered_in_order() -> None:
    requests = b"".join(request_bytes("GET", f"/{index}") for index in range(2000))
    async with serving(True) as url, await connect(url) as stream:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream.send_all, requests)
                received = b""
                while received.count(b"HTTP/1.1 201 ") < 2000 or not received.endswith(b"h="):
                    received += await stream.receive_some(65536)
    paths = re.findall(rb"GET (/\d+) ", received)
    assert paths == [f"/{index}".encode() for index in range(2000)]
