"""A load hub writing its frames straight to subscribers' sockets (``api/streams/ws_direct.py``), on a real server.

The hub here follows a feed the test drives (one change per item), with a tiny update interval, so what
reaches the wire can be checked message by message: the same messages as the ASGI path, in order, a frame
the socket took in part finished before anything else, a client offering permessage-deflate served the
ASGI way, heartbeats after direct writes, and nothing written once the client has closed.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest
import trio
from trio_websocket import WebSocketConnection
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, CloseConnection, Ping, Pong, Request, TextMessage
from wsproto.extensions import PerMessageDeflate
from wsproto.frame_protocol import FrameProtocol, Opcode

from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.load_feed import LoadChange, LoadChanges
from kvrouter.api.http import server as server_module
from kvrouter.api.http.app import make_app
from kvrouter.api.http.server import hypercorn_config, serve_http
from kvrouter.api.streams.live import StreamSettings
from kvrouter.api.streams.loads import LoadHub
from kvrouter.api.streams.ws_direct import binary_frame, text_frame
from kvrouter.client.live import open_stream

FAST = StreamSettings(interval_seconds=0.001, fan_out_per_second=1e9)


class Feed:
    """What the hub polls: each item the test sends (a change, or several published in one go) is one answer;
    a change's ``pending_count`` is the size of its message's pad."""

    def __init__(self) -> None:
        self.send, self._receive = trio.open_memory_channel[LoadChange | list[LoadChange]](100)
        self.cursor = 0

    async def fetch(self, epoch: str, cursor: int, wait_seconds: float) -> LoadChanges:
        with trio.move_on_after(wait_seconds):
            item = await self._receive.receive()
            self.cursor += 1
            return LoadChanges("test", self.cursor, False, item if isinstance(item, list) else [item])
        return LoadChanges("test", self.cursor, False, [])


def render(change: LoadChange) -> dict[str, Any]:
    return {"model_name": change.scope.model_name, "pad": "x" * change.pending_count}


def change(model: str, version: int, pad: int = 10) -> LoadChange:
    return LoadChange(ScopeKey(model, "default"), version, [], pending_count=pad)


@asynccontextmanager
async def hub_server(settings: StreamSettings = FAST) -> AsyncIterator[tuple[str, LoadHub, Feed]]:
    feed = Feed()
    hub = LoadHub(feed.fetch, render, settings)
    app = make_app([hub.route()], body_limit=1 << 20)
    stop = trio.Event()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(serve_http, app, hypercorn_config("127.0.0.1", 0), stop.wait)
            yield binds[0].replace("http://", "ws://") + "/ws/loads", hub, feed
            stop.set()


async def until(condition: Callable[[], bool]) -> None:
    while not condition():  # noqa: ASYNC110 - the hub's and the server's state, which have no events to wait on
        await trio.sleep(0.005)


async def received(ws: WebSocketConnection) -> dict[str, Any]:
    found: dict[str, Any] = orjson.loads(await ws.get_message())
    return found


@pytest.mark.parametrize("size", [0, 125, 126, 65535, 65536, 70000])
def test_a_text_frame_is_what_wsproto_frames(size: int) -> None:
    message = "é" * (size // 2) + "x" * (size % 2)
    assert text_frame(message) == FrameProtocol(client=False, extensions=[]).send_data(message, fin=True)
    protocol = FrameProtocol(client=True, extensions=[])
    protocol.receive_bytes(text_frame(message))
    [frame] = list(protocol.received_frames())
    assert frame.opcode is Opcode.TEXT and frame.payload == message and frame.frame_finished


@pytest.mark.parametrize("size", [0, 125, 126, 65535, 65536, 70000])
def test_a_binary_frame_is_what_wsproto_frames(size: int) -> None:
    payload = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    assert binary_frame(payload) == FrameProtocol(client=False, extensions=[]).send_data(payload, fin=True)


async def test_updates_go_straight_to_every_waiting_subscriber_in_order() -> None:
    async with (
        hub_server() as (url, hub, feed),
        open_stream(url) as one,
        open_stream(url) as two,
        open_stream(url) as three,
    ):
        subscribers = (one, two, three)
        for ws in subscribers:
            assert await received(ws) == {"type": "snapshot", "scopes": []}
        for version in range(1, 6):
            await until(lambda: len(hub._subscribers) == 3 and all(s.idle for s in hub._subscribers))
            await feed.send.send(change("a", version))
            for ws in subscribers:
                assert await received(ws) == {"type": "update", "model_name": "a", "pad": "x" * 10, "seq": version}
        assert hub.written_directly == 15  # each subscriber's task stayed asleep
        async with open_stream(url) as late:  # the snapshot holds the latest state
            assert await received(late) == {"type": "snapshot", "scopes": [render(change("a", 5)) | {"seq": 5}]}


def send_buffer_limit() -> int:
    """The most a TCP socket's send buffer may hold (Linux: the largest ``tcp_wmem``)."""
    with open("/proc/sys/net/ipv4/tcp_wmem") as limits:
        return int(limits.read().split()[2])


async def test_a_frame_the_socket_takes_in_part_is_finished_before_anything_else() -> None:
    """An update larger than any socket send buffer, then two more in the same poll: one write cannot take the
    first frame whole, so the rest of it is kept and written before the two others, which were queued."""
    big = send_buffer_limit() + (2 << 20)
    async with hub_server() as (url, hub, feed), open_stream(url, receive_buffer=4096) as ws:
        assert await received(ws) == {"type": "snapshot", "scopes": []}
        await until(lambda: len(hub._subscribers) == 1 and all(s.idle for s in hub._subscribers))
        await feed.send.send([change("a", 1, pad=big), change("b", 1), change("a", 2)])
        first = await received(ws)
        assert (first["model_name"], first["seq"], len(first["pad"])) == ("a", 1, big)
        rest = [await received(ws) for _ in range(2)]
        assert [(m["model_name"], m["seq"]) for m in rest] == [("b", 1), ("a", 2)]
        assert hub.written_directly == 1


async def test_a_subscriber_gets_heartbeats_after_updates_written_directly() -> None:
    settings = StreamSettings(interval_seconds=0.001, fan_out_per_second=1e9, heartbeat_seconds=0.05)
    async with hub_server(settings) as (url, hub, feed), open_stream(url) as ws:
        assert (await received(ws))["type"] == "snapshot"
        await until(lambda: len(hub._subscribers) == 1 and all(s.idle for s in hub._subscribers))
        await feed.send.send(change("a", 1))
        while (found := await received(ws))["type"] == "heartbeat":
            pass
        assert found["seq"] == 1 and hub.written_directly == 1
        assert await received(ws) == {"type": "heartbeat"}


async def test_nothing_is_written_directly_once_the_client_has_closed() -> None:
    async with hub_server() as (url, hub, _):
        async with open_stream(url) as ws:
            await received(ws)
            await until(lambda: len(hub._subscribers) == 1 and all(s.idle for s in hub._subscribers))
            [subscriber] = hub._subscribers
            direct = subscriber.direct
            assert direct is not None
        await until(lambda: not hub._subscribers)
        assert not direct.write(text_frame('{"type":"heartbeat"}'))


async def handshake(
    url: str, extensions: list[PerMessageDeflate], receive_buffer: int | None = None
) -> tuple[trio.SocketStream, WSConnection]:
    """A raw wsproto client connection (the test reads its socket itself)."""
    host, port = url.removeprefix("ws://").split("/")[0].split(":")
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    await sock.connect((host, int(port)))
    stream = trio.SocketStream(sock)
    client = WSConnection(ConnectionType.CLIENT)
    await stream.send_all(client.send(Request(host=host, target="/ws/loads", extensions=extensions)))
    while True:
        client.receive_data(await stream.receive_some(65536))
        events = list(client.events())
        if any(isinstance(event, AcceptConnection) for event in events):
            return stream, client


async def text_messages(stream: trio.SocketStream, client: WSConnection, count: int) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    text = ""
    while len(found) < count:
        client.receive_data(await stream.receive_some(65536))
        for event in client.events():
            if isinstance(event, TextMessage):
                text += event.data
                if event.message_finished:
                    found.append(orjson.loads(text))
                    text = ""
    return found


async def test_a_client_offering_permessage_deflate_is_served_without_it_and_written_to_directly() -> None:
    async with hub_server() as (url, hub, feed):
        stream, client = await handshake(url, [PerMessageDeflate()])
        async with stream:
            assert await text_messages(stream, client, 1) == [{"type": "snapshot", "scopes": []}]
            await until(lambda: len(hub._subscribers) == 1 and all(s.idle for s in hub._subscribers))
            assert hub._subscribers.copy().pop().direct is not None  # (no extension was negotiated)
            await feed.send.send(change("a", 1, pad=5000))
            [update] = await text_messages(stream, client, 1)
            assert update == {"type": "update", "model_name": "a", "pad": "x" * 5000, "seq": 1}
            assert hub.written_directly == 1
            await stream.send_all(client.send(CloseConnection(code=1000)))


async def test_a_plain_client_is_written_to_directly_with_standard_frames() -> None:
    """The frames a raw wsproto client parses: the same messages, unmasked text frames."""
    async with hub_server() as (url, hub, feed):
        stream, client = await handshake(url, [])
        async with stream:
            assert await text_messages(stream, client, 1) == [{"type": "snapshot", "scopes": []}]
            await until(lambda: len(hub._subscribers) == 1 and all(s.idle for s in hub._subscribers))
            await feed.send.send(change("a", 1, pad=70000))
            [update] = await text_messages(stream, client, 1)
            assert update == {"type": "update", "model_name": "a", "pad": "x" * 70000, "seq": 1}
            assert hub.written_directly == 1
            assert struct.unpack("!H", text_frame("x")[:2]) == (0x8101,)
            await stream.send_all(client.send(CloseConnection(code=1000)))


async def test_a_pong_waits_for_the_rest_of_a_frame_written_in_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client pings while the rest of a large frame waits for room: hypercorn's pong goes out after it
    (two writers of one socket), not into the middle of the frame, nor as a second concurrent send."""
    sends = 0
    send_all = server_module.ConnectionStream.send_all

    async def counting(self: Any, data: bytes | bytearray | memoryview) -> None:
        nonlocal sends
        sends += 1
        await send_all(self, data)

    monkeypatch.setattr(server_module.ConnectionStream, "send_all", counting)
    big = send_buffer_limit() + (2 << 20)
    async with hub_server() as (url, hub, feed):
        stream, client = await handshake(url, [], receive_buffer=4096)
        async with stream:
            assert await text_messages(stream, client, 1) == [{"type": "snapshot", "scopes": []}]
            await until(lambda: len(hub._subscribers) == 1 and all(s.idle for s in hub._subscribers))
            before = sends
            await feed.send.send(change("a", 1, pad=big))
            await until(lambda: sends == before + 1)  # the subscriber's task is writing the rest
            await stream.send_all(client.send(Ping(b"are you there")))
            await until(lambda: sends == before + 2)  # hypercorn's pong
            events: list[Any] = []
            text = ""
            while not any(isinstance(event, Pong) for event in events):
                client.receive_data(await stream.receive_some(1 << 20))
                for event in client.events():
                    events.append(event)
                    if isinstance(event, TextMessage):
                        text += event.data
            assert isinstance(events[-1], Pong) and events[-1].payload == b"are you there"
            update = orjson.loads(text)
            assert (update["seq"], len(update["pad"])) == (1, big)
            await stream.send_all(client.send(CloseConnection(code=1000)))
