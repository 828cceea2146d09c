"""The hypercorn adapter (api/hypercorn_adapter.py): pinned to one hypercorn version and the internals it uses.

The first tests fail loudly when hypercorn is upgraded or its internals move, so the adapter is revisited
rather than silently wrong. The rest check what it changes, on a real server on 127.0.0.1: one task per
request instead of two, two sends per response instead of three (one for a whole response, with the same
bytes as hypercorn's), a streamed response's head still sent before its body, and the keep-alive timer
still closing an idle connection (after a response, and at shutdown) but never one with a request in flight.
These servers run without the plain HTTP/1.1 path (api/fast_h1.py), so every request goes through hypercorn.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from importlib.metadata import version
from typing import Any

import pytest
import trio
import trio.testing
from hypercorn.events import RawData
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import HTTPStream
from hypercorn.trio.task_group import TaskGroup, _handle
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import TrioSingleTask

import kvrouter.api.server as server_module
from kvrouter.api import hypercorn_adapter
from kvrouter.api.server import HttpSettings, hypercorn_config, serve_http
from tests.support.raw_http import ResponseReader, connect, request_bytes

# -- the pin ----------------------------------------------------------------------------------------


def test_the_installed_hypercorn_is_the_version_the_adapter_was_written_for() -> None:
    # On an upgrade: re-read hypercorn/trio/tcp_server.py, worker_context.py and protocol/h11.py against
    # the adapter, then move HYPERCORN_VERSION (and the pyproject pin) together.
    assert version("hypercorn") == hypercorn_adapter.HYPERCORN_VERSION
    assert hypercorn_adapter.ACTIVE and hypercorn_adapter.inactive_reason() is None


def test_the_hypercorn_internals_the_adapter_relies_on_are_unchanged() -> None:
    source = inspect.getsource
    # The timer is the connection's ``idle_task``, armed and disarmed through restart/stop ...
    assert "self.idle_task = TrioSingleTask()" in source(TCPServer.__init__)
    assert "await self.idle_task.restart(self._task_group, self._idle_timeout)" in source(TCPServer.run)
    sends = source(TCPServer.protocol_send)
    assert "await self.idle_task.restart(self._task_group, self._idle_timeout)" in sends
    assert "await self.idle_task.stop()" in sends
    assert list(inspect.signature(TrioSingleTask.restart).parameters) == ["self", "task_group", "action"]
    assert list(inspect.signature(TrioSingleTask.stop).parameters) == ["self"]
    # ... whose firing waits keep_alive_timeout or termination, then closes through _initiate_server_close.
    timeout = source(TCPServer._idle_timeout)
    assert "self.config.keep_alive_timeout" in timeout and "self.context.terminated.wait()" in timeout
    assert "await self._initiate_server_close()" in timeout
    assert list(inspect.signature(TCPServer._initiate_server_close).parameters) == ["self"]
    assert "async def _read_data(self) -> None" in source(TCPServer._read_data)
    # RawData is what reaches the socket; an empty one is h11's end of a content-length body.
    assert "await self.stream.send_all(event.data)" in sends and "data" in RawData.__dataclass_fields__
    assert "h11.EndOfMessage()" in source(H11Protocol.stream_send)


def test_the_hypercorn_internals_corking_relies_on_are_unchanged() -> None:
    source = inspect.getsource
    # The protocol exists before reading starts (the adapter changes its class there) ...
    run = source(TCPServer.run)
    assert run.index("self.protocol = ProtocolWrapper(") < run.index("await self._read_data()")
    assert "self.protocol = H11Protocol(" in source(ProtocolWrapper.__init__)
    # ... a final response head is built and sent as CorkedH11Protocol builds it, body and end of body
    # as h11 events, everything through _send_h11_event (which the corked class overrides) ...
    sends = source(H11Protocol.stream_send)
    assert 'headers = list(chain(event.headers, self.config.response_headers("h11")))' in sends
    assert "if self.keep_alive_requests >= self.config.keep_alive_max_requests:" in sends
    assert 'headers.append((b"connection", b"close"))' in sends
    assert "h11.Response(" in sends and "status_code=event.status_code," in sends
    assert "h11.Data(data=event.data)" in sends
    assert len(re.findall(r"await self\._send_h11_event\(", sends)) == 4
    send_event = source(H11Protocol._send_h11_event)
    assert "data = self.connection.send(event)" in send_event and "except h11.LocalProtocolError:" in send_event
    assert "if self.connection.their_state != h11.ERROR:" in send_event
    assert "await self.send(RawData(data=data))" in send_event
    # ... and the ASGI send of an HTTP/1.1 request is its HTTPStream's app_send, whose send is the protocol's.
    spawn = source(HTTPStream.handle)
    assert "self.app, self.config, self.scope, self.app_send" in spawn
    assert "self.stream_send," in source(H11Protocol._create_stream)
    assert "self.send = send" in source(HTTPStream.__init__)


def test_the_hypercorn_internals_the_inbox_relies_on_are_unchanged() -> None:
    source = inspect.getsource
    # The connection's task group is made in run, kept as _task_group and handed to the protocol ...
    run = source(TCPServer.run)
    assert "async with TaskGroup() as task_group:" in run and "self._task_group = task_group" in run
    assert run.index("self._task_group = task_group") < run.index("await self._read_data()")
    # ... and spawn_app runs the app through _handle fed by a bounded channel, returning its put.
    spawn = source(TaskGroup.spawn_app)
    assert "config.max_app_queue_size" in spawn and "return app_send_channel.send" in spawn
    assert "_handle," in spawn and "app_receive_channel.receive," in spawn
    assert "trio.to_thread.run_sync," in spawn and "trio.from_thread.run," in spawn
    assert list(inspect.signature(_handle).parameters) == [
        "app",
        "config",
        "scope",
        "receive",
        "send",
        "sync_spawn",
        "call_soon",
    ]
    assert list(inspect.signature(TaskGroup.spawn_app).parameters) == ["self", "app", "config", "scope", "send"]


def test_the_hypercorn_internals_the_read_loop_and_protocol_check_reproduce_are_unchanged() -> None:
    source = inspect.getsource
    # AdaptedTCPServer._read_loop is this loop with a plain cancel scope for the read timeout ...
    reads = source(TCPServer._read_data)
    assert "with trio.fail_after(self.config.read_timeout or inf):" in reads
    assert "data = await self.stream.receive_some(MAX_RECV)" in reads
    assert "trio.ClosedResourceError," in reads and "trio.BrokenResourceError," in reads
    assert "trio.TooSlowError," in reads
    assert "await self.protocol.handle(RawData(bytes(data)))" in reads and 'if data == b"":' in reads
    assert reads.rstrip().endswith("await self.protocol.handle(Closed())")
    # ... and _check_protocol acts only on an Upgrade header (h2c) or the HTTP/2 preface (PRI).
    check = source(H11Protocol._check_protocol)
    assert 'if sanitised_name == "upgrade":' in check
    assert 'upgrade_value.lower() == "h2c"' in check and 'event.method == b"PRI"' in check
    assert len(re.findall(r"\braise\b|await self\.", check)) == 3  # the 101 response and two raises


# -- what it changes, on a real server ---------------------------------------------------------------


Receive = Callable[[], Awaitable[Any]]
Send = Callable[..., Awaitable[None]]


async def hello(scope: dict[str, Any], receive: Receive, send: Send) -> None:
    assert scope["type"] == "http"
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def whole(scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """A whole response, as kvrouter's app sends one (headers h11 would change: a title-cased name, blanks)."""
    while (await receive()).get("more_body"):
        pass
    body = b"" if scope["method"] == "HEAD" else b'{"whole": true}'
    headers = [(b"content-length", b"15"), (b"X-Kind", b" whole "), (b"content-type", b"application/json")]
    await hypercorn_adapter.send_whole_response(
        send,
        {"type": "http.response.start", "status": 201, "headers": headers},
        {"type": "http.response.body", "body": body},
    )


@asynccontextmanager
async def serving(idle_timeout: float = 5.0, app: Any = hello) -> AsyncIterator[tuple[str, trio.Event]]:
    stop = trio.Event()
    config = hypercorn_config("127.0.0.1", 0, HttpSettings(idle_timeout=idle_timeout))
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(partial(serve_http, plain_fast_path=False), app, config, stop.wait)
            yield binds[0], stop
            stop.set()


def counting_sends(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """What the server's connection streams were given to write, one item per write (a send, or a write
    without waiting), empty ones left out."""
    sent: list[bytes] = []
    send_all, write_now = server_module._Stream.send_all, server_module._Stream.write_now

    async def counting_send_all(self: Any, data: bytes | bytearray | memoryview) -> None:
        if data:
            sent.append(bytes(data))
        await send_all(self, data)

    def counting_write_now(self: Any, data: bytes) -> bool:
        written = write_now(self, data)
        if written:
            sent.append(bytes(data))
        return written

    monkeypatch.setattr(server_module._Stream, "send_all", counting_send_all)
    monkeypatch.setattr(server_module._Stream, "write_now", counting_write_now)
    return sent


class SpawnCounter(trio.abc.Instrument):
    def __init__(self) -> None:
        self.spawned = 0

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.spawned += 1


async def test_a_keep_alive_request_costs_one_task_and_two_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    sent = counting_sends(monkeypatch)
    async with serving() as (url, _):
        stream = await connect(url)
        reader = ResponseReader(stream)
        await stream.send_all(request_bytes("GET", "/"))
        assert (await reader.response()).body == b"ok"  # the connection and its timer are up
        counter = SpawnCounter()
        sent.clear()
        trio.lowlevel.add_instrument(counter)
        try:
            for _ in range(20):
                await stream.send_all(request_bytes("GET", "/"))
                assert (await reader.response()).body == b"ok"
        finally:
            trio.lowlevel.remove_instrument(counter)
        await stream.aclose()
    # hypercorn alone: the app's task and a fresh keep-alive timer task per request, and head, body and an
    # empty end of body as three sends.
    assert (counter.spawned, len(sent)) == (20, 40)


async def test_an_idle_keep_alive_connection_is_closed_at_the_idle_timeout_after_each_response() -> None:
    async with serving(idle_timeout=0.3) as (url, _), await connect(url) as stream:
        reader = ResponseReader(stream)
        for _ in range(3):  # re-armed after every response, disarmed while a request is in flight
            await trio.sleep(0.1)
            await stream.send_all(request_bytes("GET", "/"))
            assert (await reader.response()).status == 200
        assert await reader.closed()


async def test_a_request_in_flight_past_the_idle_timeout_is_answered() -> None:
    async with serving(idle_timeout=0.2) as (url, _), await connect(url) as stream:
        reader = ResponseReader(stream)
        body = b"x" * 10
        await stream.send_all(request_bytes("POST", "/", body)[: -len(body)])  # the head: the timer is disarmed
        await trio.sleep(0.6)  # three idle timeouts
        await stream.send_all(body)
        assert (await reader.response()).body == b"ok"


async def test_shutdown_closes_idle_keep_alive_connections() -> None:
    async with serving() as (url, stop), await connect(url) as stream:
        reader = ResponseReader(stream)
        await stream.send_all(request_bytes("GET", "/"))
        assert (await reader.response()).status == 200
        stop.set()  # the server terminates: the idle connection's timer fires at once
        assert await reader.closed()


async def responses_as_sent(requests: list[bytes]) -> list[bytes]:
    """Each request's response as the wire carried it (a whole response read to its end), from ``whole``."""
    async with serving(app=whole) as (url, _), await connect(url) as stream:
        answers = []
        for raw in requests:
            await stream.send_all(raw)
            data = b""
            while not (b"\r\n\r\n" in data and (data.endswith(b"}") or raw.startswith(b"HEAD"))):
                data += await stream.receive_some(65536)
            answers.append(re.sub(rb"date: [^\r]*", b"date: -", data))  # the one header that moves
        return answers


async def test_a_whole_response_is_one_send_with_the_bytes_hypercorn_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    requests = [request_bytes("GET", "/"), request_bytes("POST", "/", b"x" * 5), request_bytes("HEAD", "/")]
    monkeypatch.setattr(hypercorn_adapter, "ACTIVE", False)  # hypercorn's own path: head and body apart
    sent = counting_sends(monkeypatch)
    hypercorns = await responses_as_sent(requests)
    assert len(sent) == 2 * len(requests) - 1  # head and body apart (HEAD: the head alone)
    monkeypatch.setattr(hypercorn_adapter, "ACTIVE", True)
    sent.clear()
    corked = await responses_as_sent(requests)
    assert len(sent) == len(requests)
    assert corked == hypercorns
    assert corked[0].startswith(b"HTTP/1.1 201 \r\ncontent-length: 15\r\nX-Kind: whole\r\n")
    assert corked[0].endswith(b'server: hypercorn-h11\r\n\r\n{"whole": true}')


async def test_a_streamed_response_sends_its_head_before_its_body() -> None:
    head_read = trio.Event()

    async def streamed(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await head_read.wait()  # the body only once the client has the head
        await send({"type": "http.response.body", "body": b"late", "more_body": False})

    async with serving(app=streamed) as (url, _), await connect(url) as stream:
        await stream.send_all(request_bytes("GET", "/"))
        head = b""
        while b"\r\n\r\n" not in head:
            head += await stream.receive_some(65536)
        assert head.startswith(b"HTTP/1.1 200 ") and b"Transfer-Encoding: chunked" in head
        head_read.set()
        rest = b""
        while not rest.endswith(b"0\r\n\r\n"):
            rest += await stream.receive_some(65536)
        assert rest == b"4\r\nlate\r\n0\r\n\r\n"


async def test_a_whole_response_larger_than_the_socket_takes_at_once_arrives_whole() -> None:
    big = bytes(range(256)) * 40_000  # 10 MB: written in part at once, the rest as the client reads

    async def large(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body"):
            pass
        await hypercorn_adapter.send_whole_response(
            send,
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(big)).encode())]},
            {"type": "http.response.body", "body": big},
        )

    async with serving(app=large) as (url, _), await connect(url) as stream:
        reader = ResponseReader(stream)
        for _ in range(2):
            await stream.send_all(request_bytes("GET", "/"))
            await trio.sleep(0.05)  # the server has filled the socket's buffer before the client reads
            assert (await reader.response()).body == big


async def test_a_connection_silent_for_the_read_timeout_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    stop = trio.Event()
    config = hypercorn_config("127.0.0.1", 0, HttpSettings(body_timeout=0.3))
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(partial(serve_http, plain_fast_path=False), hello, config, stop.wait)
            async with await connect(binds[0]) as stream:
                body = b"x" * 10
                await stream.send_all(request_bytes("POST", "/", body)[: -len(body)])  # the head; then silence
                with trio.fail_after(10):  # (the app hears of the disconnect and answers; then the end)
                    while await stream.receive_some(65536):
                        pass
            stop.set()


async def test_an_h2c_upgrade_still_switches_to_http2() -> None:
    async with serving() as (url, _), await connect(url) as stream:
        upgrade = {"connection": "Upgrade, HTTP2-Settings", "upgrade": "h2c", "http2-settings": "AAMAAABkAAQAAP__"}
        await stream.send_all(request_bytes("GET", "/", headers=upgrade))
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += await stream.receive_some(65536)
        assert answer.startswith(b"HTTP/1.1 101 ")


async def test_an_inbox_is_first_in_first_out_and_bounded() -> None:
    inbox = hypercorn_adapter.Inbox(2)
    received: list[int] = []
    async with trio.open_nursery() as nursery:

        async def put_five() -> None:
            for number in range(5):
                await inbox.put(number)

        nursery.start_soon(put_five)
        await trio.testing.wait_all_tasks_blocked()
        assert len(inbox._messages) == 2  # the third put waits for room
        for _ in range(5):
            received.append(await inbox.receive())
        with trio.move_on_after(0.05) as waited:
            await inbox.receive()  # empty: waits
        assert waited.cancelled_caught
    assert received == [0, 1, 2, 3, 4]


async def test_a_body_faster_than_the_app_reads_it_arrives_in_order_with_the_reading_held() -> None:
    chunks = [bytes([n]) * 1000 for n in range(60)]
    largest_queue = 0
    put = hypercorn_adapter.Inbox.put

    async def watched_put(self: Any, message: Any) -> None:
        nonlocal largest_queue
        await put(self, message)
        largest_queue = max(largest_queue, len(self._messages))

    async def slow_reader(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            await trio.sleep(0.002)
            if not message.get("more_body"):
                break
        await hypercorn_adapter.send_whole_response(
            send,
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]},
            {"type": "http.response.body", "body": body},
        )

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hypercorn_adapter.Inbox, "put", watched_put)
        async with serving(app=slow_reader) as (url, _), await connect(url) as stream:
            head = request_bytes("POST", "/", headers={"transfer-encoding": "chunked"})
            await stream.send_all(head)
            for chunk in chunks:  # each its own segment, most of them before the app has read the first
                await stream.send_all(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await stream.send_all(b"0\r\n\r\n")
            assert (await ResponseReader(stream).response()).body == b"".join(chunks)
    assert largest_queue <= hypercorn_config("127.0.0.1", 0).max_app_queue_size
