"""The command stream (GET /ws/commands): pipelined messages against a real server, results matched by id,
order across ordered messages, the in-flight bound (the service stops reading), size and shape limits, auth."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import httpx
import msgpack
import orjson
import pytest
import trio
import trio.testing
from trio_websocket import ConnectionClosed, HandshakeError, WebSocketConnection

from kvrouter.api.http import OK, Request, Response, Route, json_response
from kvrouter.api.streams.command_runner import MAX_BATCH_COMMANDS, CommandRunner
from kvrouter.api.streams.command_stream import MAX_MESSAGE_BYTES, MAX_RESULTS_BYTES, CommandStream
from kvrouter.client.stream import open_websocket
from tests.api.test_batch import add, cmd, ref, register
from tests.support.services import running


def ws_url(http_url: str) -> str:
    return "ws" + http_url[4:] + "/ws/commands"


async def send(ws: WebSocketConnection, commands: list[Any], *, ordered: bool = True) -> None:
    await ws.send_message(orjson.dumps({"commands": commands, "ordered": ordered}).decode())


async def results(ws: WebSocketConnection, count: int) -> dict[Any, dict[str, Any]]:
    """The next ``count`` results, by id."""
    found: dict[Any, dict[str, Any]] = {}
    while len(found) < count:
        for result in orjson.loads(await ws.get_message())["results"]:
            assert result["id"] not in found
            found[result["id"]] = result
    return found


def with_id(command_id: Any, command: dict[str, Any]) -> dict[str, Any]:
    return {"id": command_id, **command}


async def test_pipelined_messages_are_answered_by_id(tmp_path: Path) -> None:
    async with running("slot tracker", tmp_path) as service, open_websocket(ws_url(service.urls[0])) as ws:
        await send(ws, [with_id("reg", register(1))])
        # Sent without waiting: the adds unordered, then ordered steps that depend on them, across messages.
        await send(ws, [with_id(i, add(f"r{i}", first_hash=10 * i)) for i in range(40)], ordered=False)
        await send(ws, [with_id("late", add("late", first_hash=999))])
        await send(ws, [with_id("late-prefill", ref("/prefill_complete", "late"))])
        await send(ws, [with_id("late-free", ref("/free", "late")), with_id("ghost", ref("/free", "ghost"))])
        await send(ws, [with_id("junk", cmd("GET", "/x"))])
        found = await results(ws, 46)
    assert found["reg"]["status"] == 201
    assert all(found[i]["status"] == 201 and found[i]["body"] == {"status": "ok"} for i in range(40))
    assert found["late"]["status"] == 201
    assert found["late-prefill"]["status"] == 200  # 404 had it overtaken the add
    assert found["late-free"]["status"] == 200
    assert found["ghost"]["status"] == 200  # freeing an unknown request is a no-op (as on its route)
    assert found["junk"] == {"id": "junk", "status": 404, "body": {"error": "route not found"}}


async def test_a_message_too_large_or_with_too_many_commands_closes_with_1009(tmp_path: Path) -> None:
    async with running("slot tracker", tmp_path) as service:
        async with open_websocket(ws_url(service.urls[0])) as ws:
            await ws.send_message("x" * (MAX_MESSAGE_BYTES + 1))
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
            assert closed.value.reason.code == 1009
        async with open_websocket(ws_url(service.urls[0])) as ws:
            await send(ws, [with_id(i, cmd("GET", "/health")) for i in range(MAX_BATCH_COMMANDS + 1)])
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
            assert closed.value.reason.code == 1009
            assert f"at most {MAX_BATCH_COMMANDS} commands" in (closed.value.reason.reason or "")


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "a message is a JSON object"),
        ('{"commands": [{"method": "GET", "path": "/health"}]}', "every command needs an `id`"),
        ('{"commands": [], "ordered": "yes"}', "a message is a JSON object"),
        ('{"commands": [{"id": "%s", "method": "GET", "path": "/health"}]}' % ("x" * 4097), "at most 4096 bytes"),
    ],
)
async def test_a_malformed_message_closes_with_1007(tmp_path: Path, message: str, reason: str) -> None:
    async with running("slot tracker", tmp_path) as service, open_websocket(ws_url(service.urls[0])) as ws:
        await ws.send_message(message)
        with pytest.raises(ConnectionClosed) as closed:
            await ws.get_message()
    assert closed.value.reason.code == 1007 and reason in (closed.value.reason.reason or "")


async def test_the_stream_needs_the_token(tmp_path: Path) -> None:
    async with running("slot tracker", tmp_path, token="tok") as service:
        with pytest.raises(HandshakeError) as refused:
            async with open_websocket(ws_url(service.urls[0])):
                pass
        assert getattr(refused.value, "status_code", None) == 401
        with pytest.raises(HandshakeError):
            async with open_websocket(ws_url(service.urls[0]), token="no"):
                pass
        async with open_websocket(ws_url(service.urls[0]), token="tok") as ws:
            await send(ws, [with_id(1, register(1))])
            assert (await results(ws, 1))[1]["status"] == 201
        async with httpx.AsyncClient(base_url=service.urls[0]) as client:
            plain = await client.get("/ws/commands", headers={"authorization": "Bearer tok"})
            assert plain.status_code == 426 and "WebSocket" in plain.json()["error"]


async def test_the_service_stops_reading_when_its_window_is_full() -> None:
    """In process (the ASGI messages themselves): with a window of 4 commands held undecided, the stream
    reads exactly the messages that fit; once they are answered it reads the rest."""
    gate = trio.Event()
    started = 0

    async def held(request: Request) -> Response:
        nonlocal started
        started += 1
        await gate.wait()
        return OK

    runner = CommandRunner()
    runner.serve([Route("POST", "/held", held, json_body=True)])
    inbox_send, inbox = trio.open_memory_channel[dict[str, Any]](math.inf)
    sent: list[dict[str, Any]] = []

    async def send_out(message: dict[str, Any]) -> None:
        sent.append(message)

    for i in range(10):
        message = {"commands": [{"id": i, "method": "POST", "path": "/held", "body": {}}], "ordered": False}
        inbox_send.send_nowait({"type": "websocket.receive", "text": orjson.dumps(message).decode()})
    stream = CommandStream(runner, send_out, limit=4)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream.serve, inbox.receive)
        await trio.testing.wait_all_tasks_blocked()
        assert started == 4 and inbox.statistics().current_buffer_used == 6  # 6 messages left unread
        gate.set()
        await trio.testing.wait_all_tasks_blocked()
        answered = [r["id"] for m in sent for r in orjson.loads(m["text"])["results"]]
        assert sorted(answered) == list(range(10)) and started == 10
        assert stream.window.used == 0
        nursery.cancel_scope.cancel()


async def test_a_stopping_service_answers_what_is_in_flight_then_closes_with_1001(tmp_path: Path) -> None:
    """Without this the open stream held the shutdown for the whole grace period (10 s) and was then cut."""
    async with running("slot tracker", tmp_path) as service, open_websocket(ws_url(service.urls[0])) as ws:
        await send(ws, [with_id(1, register(1))])
        assert (await results(ws, 1))[1]["status"] == 201
        service.stop()
        with pytest.raises(ConnectionClosed) as closed:
            await ws.get_message()
    assert closed.value.reason.code == 1001 and "stopping" in (closed.value.reason.reason or "")


@pytest.mark.parametrize("compact", [False, True])
async def test_large_results_that_finish_together_go_in_messages_of_bounded_size(compact: bool) -> None:
    """In process: ten answers of ~300 KB finishing together went out as one ~3 MB message (100 reads of a large
    /loads made 120 MB, past kvrouter.client's 64 MiB bound, and the client's stream closed with 1009, failing
    every caller); now a message holds at most MAX_RESULTS_BYTES unless it is a single larger result."""
    big = json_response(200, {"pad": "x" * 300_000})

    async def large(request: Request) -> Response:
        return big

    runner = CommandRunner()
    runner.serve([Route("GET", "/large", large)])
    inbox_send, inbox = trio.open_memory_channel[dict[str, Any]](math.inf)
    sent: list[dict[str, Any]] = []

    async def send_out(message: dict[str, Any]) -> None:
        sent.append(message)

    commands = [[i, 0, "GET", "/large"] for i in range(10)]
    if compact:
        inbox_send.send_nowait({"type": "websocket.receive", "bytes": msgpack.packb([False, commands])})
    else:
        message = {"commands": [{"id": i, "method": "GET", "path": "/large"} for i in range(10)], "ordered": False}
        inbox_send.send_nowait({"type": "websocket.receive", "text": orjson.dumps(message).decode()})
    stream = CommandStream(runner, send_out, compact=compact)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream.serve, inbox.receive)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    answered: list[Any] = []
    for message in sent:
        data = message["bytes"] if compact else message["text"].encode()
        results = msgpack.unpackb(data) if compact else orjson.loads(data)["results"]
        assert len(data) <= MAX_RESULTS_BYTES or len(results) == 1
        answered += [result[0] if compact else result["id"] for result in results]
    assert sorted(answered) == list(range(10)) and len(sent) > 1 and stream.window.used == 0
