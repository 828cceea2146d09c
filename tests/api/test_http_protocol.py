"""HTTP/1.x and WebSocket protocol hardening, on kvrouter's HTTP server on 127.0.0.1 (raw sockets: a client
library would refuse to send these requests).

Each case is an attack that once worked: a request smuggled behind a chunked body, error answers without the
API's ``{"error"}``, a chunk size that held the connection for the read timeout, a valid HTTP/1.0 request
refused because another followed it, a request head past the 16 KiB cap, and WebSocket protocol errors and
oversized messages that dropped the socket without the close frame the docs promise.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, BytesMessage, CloseConnection, Request, TextMessage
from wsproto.extensions import PerMessageDeflate

from kvrouter.api.http.server import HttpSettings, hypercorn_config, serve_http

MAX_MESSAGE = 1 << 20  # the server's websocket_max_message_size
HANG_GUARD = 20  # seconds: a case waiting this long is a failure (the server's read timeout is an hour)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Records each request it serves; answers ``{"path": ...}``. WebSockets: echoes text messages."""
    if scope["type"] == "websocket":
        await receive()
        await send({"type": "websocket.accept"})
        while (message := await receive())["type"] == "websocket.receive":
            await send({"type": "websocket.send", "text": f"got {len(message.get('text') or message['bytes'])}"})
        return
    served.append(scope["path"])
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    answer = orjson.dumps({"path": scope["path"], "body": len(body)})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": answer})


served: list[str] = []


@asynccontextmanager
async def server() -> AsyncIterator[int]:
    served.clear()
    stop = trio.Event()
    config = hypercorn_config("127.0.0.1", 0, HttpSettings(body_timeout=3600.0))
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(serve_http, app, config, stop.wait)
        yield int(binds[0].rsplit(":", 1)[1])
        stop.set()


async def exchange(port: int, data: bytes) -> bytes:
    """Everything the server sends for ``data`` until it closes the connection (the client keeps its side open)."""
    received = b""
    with trio.fail_after(HANG_GUARD):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(data)
            try:
                while chunk := await stream.receive_some(65536):
                    received += chunk
            except trio.BrokenResourceError:
                pass
    return received


def responses(data: bytes) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    """The content-length framed responses in ``data``."""
    found = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        status_line, *lines = head.split(b"\r\n")
        headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(b":") for line in lines)}
        length = int(headers.get(b"content-length", b"0"))
        found.append((int(status_line.split()[1]), headers, data[:length]))
        data = data[length:]
    return found


def refused(data: bytes) -> tuple[int, str]:
    """The only response in ``data``: a refusal with ``{"error"}`` that closes the connection."""
    (status, headers, body), *others = responses(data)
    assert others == [], data
    assert headers[b"connection"] == b"close" and headers[b"content-type"] == b"application/json"
    message = orjson.loads(body)
    assert set(message) == {"error"} and message["error"], body
    return status, message["error"]


async def test_a_request_smuggled_behind_a_chunked_body_with_a_length_is_refused_and_never_runs() -> None:
    smuggled = b"GET /smuggled HTTP/1.1\r\nhost: a\r\n\r\n"
    attack = (
        b"POST /first HTTP/1.1\r\nhost: a\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"
        + smuggled
    )
    async with server() as port:
        answer = await exchange(port, attack)
    assert refused(answer)[0] == 400
    assert served == []


@pytest.mark.parametrize("coding", [b"chunked, identity", b"gzip, chunked, identity", b"identity", b"gzip"])
async def test_a_transfer_coding_other_than_chunked_alone_is_refused_with_an_error_body(coding: bytes) -> None:
    async with server() as port:
        answer = await exchange(port, b"POST /p HTTP/1.1\r\nhost: a\r\ntransfer-encoding: %s\r\n\r\n0\r\n\r\n" % coding)
    assert refused(answer)[0] in (400, 501)
    assert served == []


@pytest.mark.parametrize("size", [b"ffffffffffffffffff", b"1" + b"0" * 16, b"x", b"-1", b""])
async def test_a_chunk_size_that_is_no_64_bit_hex_number_is_refused_at_once(size: bytes) -> None:
    """The client sends nothing more and keeps the connection open: the answer must not wait for more."""
    async with server() as port:
        answer = await exchange(port, b"POST /p HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n%s\r\n" % size)
    assert refused(answer)[0] == 400


async def test_a_chunked_body_is_served_and_the_connection_kept() -> None:
    body = b"3\r\nabc\r\n10;ext=1\r\n" + b"x" * 16 + b"\r\n0\r\ntrailer: t\r\n\r\n"
    request = b"POST /c HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n" + body
    last = b"GET /last HTTP/1.1\r\nhost: a\r\nconnection: close\r\n\r\n"
    async with server() as port:
        answer = await exchange(port, request + last)
    assert [(status, orjson.loads(body)) for status, _, body in responses(answer)] == [
        (200, {"path": "/c", "body": 19}),
        (200, {"path": "/last", "body": 0}),
    ]


async def test_pipelined_http_1_0_requests_get_the_first_answered_then_the_connection_closes() -> None:
    async with server() as port:
        answer = await exchange(port, b"GET /one HTTP/1.0\r\n\r\nGET /two HTTP/1.0\r\n\r\n")
    ((status, headers, body),) = responses(answer)
    assert (status, orjson.loads(body)) == (200, {"path": "/one", "body": 0})
    assert headers[b"connection"] == b"close"
    assert served == ["/one"]


def many_headers(count: int = 2000) -> bytes:
    return b"".join(b"x-%d: %d\r\n" % (i, i) for i in range(count))  # 2,000: ~21 KiB in small headers


@pytest.mark.parametrize(
    "request_line",
    [
        b"GET /plain HTTP/1.1\r\nhost: a\r\n",
        b"POST /chunked HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n",
        b"GET /old HTTP/1.0\r\n",
        b"GET /ws HTTP/1.1\r\nhost: a\r\nconnection: upgrade\r\nupgrade: websocket\r\nsec-websocket-version: 13\r\n"
        b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n",
        b"GET /h2c HTTP/1.1\r\nhost: a\r\nconnection: upgrade, http2-settings\r\nupgrade: h2c\r\n"
        b"http2-settings: AAMAAABkAAQAAP__\r\n",
    ],
)
async def test_a_head_past_16_kib_is_refused_on_every_path_even_in_small_headers(request_line: bytes) -> None:
    async with server() as port:
        answer = await exchange(port, request_line + many_headers() + b"\r\n")
    assert refused(answer)[0] in (400, 431)
    assert served == []


async def test_a_head_just_under_the_cap_is_served() -> None:
    headers = many_headers(1200)
    assert len(headers) < 16 * 1024 - 100
    async with server() as port:
        answer = await exchange(port, b"GET /big HTTP/1.1\r\nhost: a\r\nconnection: close\r\n" + headers + b"\r\n")
    assert [status for status, _, _ in responses(answer)] == [200]


# -- WebSockets --


def masked_frame(first_byte: int, payload: bytes) -> bytes:
    """A client's frame, built by hand (wsproto would not send a compressed frame without the extension)."""
    mask = os.urandom(4)
    size = len(payload)
    if size < 126:
        length = bytes((0x80 | size,))
    elif size < 1 << 16:
        length = bytes((0x80 | 126,)) + size.to_bytes(2, "big")
    else:
        length = bytes((0x80 | 127,)) + size.to_bytes(8, "big")
    return bytes((first_byte,)) + length + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


async def websocket(port: int, *, offer_deflate: bool) -> tuple[trio.SocketStream, WSConnection, bool]:
    """An open WebSocket to the echo app; whether permessage-deflate was negotiated."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    client = WSConnection(ConnectionType.CLIENT)
    extensions = [PerMessageDeflate()] if offer_deflate else []
    await stream.send_all(client.send(Request(host="a", target="/ws", extensions=extensions)))
    while True:
        client.receive_data(await stream.receive_some(65536))
        for event in client.events():
            if isinstance(event, AcceptConnection):
                return stream, client, bool(event.extensions)


async def close_code(stream: trio.SocketStream, client: WSConnection, data: bytes) -> int | None:
    """The close code the server sends after ``data`` (None: the socket ended with no close frame)."""
    with trio.fail_after(HANG_GUARD):
        with contextlib.suppress(trio.BrokenResourceError):
            await stream.send_all(data)
        while True:
            try:
                received = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                received = b""
            if not received:
                return None
            client.receive_data(received)
            for event in client.events():
                if isinstance(event, CloseConnection):
                    return int(event.code)


async def test_a_websocket_offering_deflate_is_served_without_it() -> None:
    async with server() as port:
        stream, client, deflate = await websocket(port, offer_deflate=True)
        async with stream:
            assert not deflate
            await stream.send_all(client.send(TextMessage(data="hello")))
            client.receive_data(await stream.receive_some(65536))
            assert [event.data for event in client.events() if isinstance(event, TextMessage)] == ["got 5"]


async def test_a_deflate_bomb_is_answered_with_a_close_frame() -> None:
    """A compressed frame (RSV1) on a connection that negotiated no compression is a protocol error: 1002.
    (Where deflate was negotiated, a message inflating past the bound was dropped with no close frame.)"""
    import zlib

    bomb = zlib.compressobj(9, zlib.DEFLATED, -15)
    payload = bomb.compress(bytes(64 << 20)) + bomb.flush(zlib.Z_SYNC_FLUSH)
    async with server() as port:
        stream, client, deflate = await websocket(port, offer_deflate=True)
        async with stream:
            data = client.send(BytesMessage(data=bytes(64 << 20))) if deflate else masked_frame(0xC2, payload)
            code = await close_code(stream, client, data)
    assert code in (1002, 1009)


async def test_a_message_over_the_bound_is_closed_with_1009() -> None:
    async with server() as port:
        stream, client, _ = await websocket(port, offer_deflate=False)
        async with stream:
            code = await close_code(stream, client, client.send(BytesMessage(data=bytes(MAX_MESSAGE + 1))))
    assert code == 1009


@pytest.mark.parametrize(
    "frame",
    [
        b"\x81\x05hello",  # a client frame without a mask
        masked_frame(0x83, b"x"),  # a reserved opcode
        masked_frame(0xA1, b"x"),  # RSV2 set
        masked_frame(0x09, b"x"),  # a fragmented ping
    ],
    ids=["unmasked", "reserved-opcode", "rsv2", "fragmented-ping"],  # the frames' masks are random
)
async def test_a_protocol_error_is_closed_with_1002(frame: bytes) -> None:
    async with server() as port:
        stream, client, _ = await websocket(port, offer_deflate=False)
        async with stream:
            code = await close_code(stream, client, frame)
    assert code == 1002


async def test_bad_utf_8_in_a_text_message_is_closed_with_1007() -> None:
    async with server() as port:
        stream, client, _ = await websocket(port, offer_deflate=False)
        async with stream:
            code = await close_code(stream, client, masked_frame(0x81, b"\xff\xfe"))
    assert code == 1007
