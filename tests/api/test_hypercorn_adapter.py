"""The hypercorn adapter (api/hypercorn_adapter.py): pinned to one hypercorn version and the internals it uses.

The first tests fail loudly when hypercorn is upgraded or its internals move, so the adapter is revisited
rather than silently wrong. The rest check what it changes, on a real server on 127.0.0.1: one task per
request instead of two, two sends per response instead of three, and the keep-alive timer still closing
an idle connection (after a response, and at shutdown) but never one with a request in flight.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from importlib.metadata import version
from typing import Any

import pytest
import trio
from hypercorn.events import RawData
from hypercorn.protocol.h11 import H11Protocol
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


# -- what it changes, on a real server ---------------------------------------------------------------


Receive = Callable[[], Awaitable[Any]]
Send = Callable[..., Awaitable[None]]


async def hello(scope: dict[str, Any], receive: Receive, send: Send) -> None:
    assert scope["type"] == "http"
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@asynccontextmanager
async def serving(idle_timeout: float = 5.0) -> AsyncIterator[tuple[str, trio.Event]]:
    stop = trio.Event()
    config = hypercorn_config("127.0.0.1", 0, HttpSettings(idle_timeout=idle_timeout))
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(serve_http, hello, config, stop.wait)
            yield binds[0], stop
            stop.set()


class SpawnCounter(trio.abc.Instrument):
    def __init__(self) -> None:
        self.spawned = 0

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.spawned += 1


async def test_a_keep_alive_request_costs_one_task_and_two_sends(monkeypatch: pytest.MonkeyPatch) -> None:
    sends = 0
    send_all = server_module._Stream.send_all

    async def counting_send_all(self: Any, data: bytes | bytearray | memoryview) -> None:
        nonlocal sends
        sends += 1
        await send_all(self, data)

    monkeypatch.setattr(server_module._Stream, "send_all", counting_send_all)
    async with serving() as (url, _):
        stream = await connect(url)
        reader = ResponseReader(stream)
        await stream.send_all(request_bytes("GET", "/"))
        assert (await reader.response()).body == b"ok"  # the connection and its timer are up
        counter = SpawnCounter()
        sends = 0
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
    assert (counter.spawned, sends) == (20, 40)


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
