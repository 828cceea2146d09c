"""The command stream's compact format (msgpack, ``kvrouter/client/compact.py``): negotiated per connection by
subprotocol, every command answered exactly as its JSON command is, malformed messages closed with a clear
code and nothing applied, hot writes read exactly as their JSON bodies are (generated fields)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgpack
import orjson
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from trio_websocket import ConnectionClosed, WebSocketConnection

from kvrouter.actors.core.ids import I64_MAX, I64_MIN, U64_MASK
from kvrouter.actors.core.limits import MAX_TEXT_BYTES
from kvrouter.api.http import CREATED, OK, Response, error_response, json_response
from kvrouter.api.routes import slot_tracker as routes
from kvrouter.api.streams.command_runner import MAX_BATCH_COMMANDS, CommandRunner, Ready, _prepare
from kvrouter.api.streams.command_stream import (
    MAX_MESSAGE_BYTES,
    SPLIT_MIN_COMMANDS,
    CommandStream,
    CompactReader,
    InFlight,
    Malformed,
    render_compact,
)
from kvrouter.api.streams.ws_direct import DirectSocket
from kvrouter.client import CommandError, StreamClient
from kvrouter.client.compact import (
    ADD,
    FIELDS,
    FREE,
    PATHS,
    PREFILL_COMPLETE,
    ROUTE,
    SUBPROTOCOL,
    from_int64s,
    int64s,
    json_body,
)
from kvrouter.client.stream import open_websocket
from tests.api.test_command_stream import results, send, ws_url
from tests.support.services import running

HASHES = st.lists(st.sampled_from([0, 1, -1, I64_MAX, I64_MIN]), max_size=5)
ODD = st.sampled_from([None, True, False, 1.5, "7", [], b"raw", -1, U64_MASK + 1 - 1, "x" * (MAX_TEXT_BYTES + 1)])
GOOD = {
    "model_name": st.sampled_from(["m", "", "é", "x" * MAX_TEXT_BYTES]),
    "tenant_id": st.sampled_from([None, "t", "default"]),
    "request_id": st.sampled_from(["r", "", "x" * MAX_TEXT_BYTES]),
    "worker_id": st.sampled_from([0, 1, U64_MASK]),
    "dp_rank": st.sampled_from([0, 1]),
    "sequence_hashes": st.one_of(HASHES, HASHES.map(lambda hashes: int64s(hashes) or b"")),
    "new_isl_tokens": st.sampled_from([None, 0, 48]),
}


class _NoService:
    """The write routes' service object: never called here (only their ``prepare`` runs)."""


def write_runner() -> CommandRunner:
    batches = routes.write_batches(_NoService())  # type: ignore[arg-type]
    table = [
        routes.write_route(_NoService(), path, prepare, batches)  # type: ignore[arg-type]
        for path, prepare in (
            ("add", routes.prepare_add),
            ("prefill_complete", routes.prepare_prefill_complete),
            ("free", routes.prepare_free),
        )
    ]
    runner = CommandRunner()
    runner.serve(table)
    return runner


def outcome_of(item: Any) -> Any:
    """What a command comes to before the service: its plain write item, or (status, body) of its refusal."""
    if isinstance(item, Ready):
        return item.prepared
    if not isinstance(item, Response):
        item = _prepare(item)
    if isinstance(item, Response):
        return item.status, orjson.loads(item.body)
    return item


@st.composite
def hot_commands(draw: st.DrawFn) -> tuple[int, list[Any]]:
    """A hot write's positional fields, well-formed, then up to two of them replaced by a value of any kind."""
    code = draw(st.sampled_from([ADD, PREFILL_COMPLETE, FREE]))
    fields = [draw(GOOD[name]) for name in FIELDS[code]]
    for _ in range(draw(st.integers(0, 2))):
        fields[draw(st.integers(0, len(fields) - 1))] = draw(st.one_of(ODD, st.lists(ODD, max_size=3)))
    return code, fields


RUNNER = write_runner()
READER = CompactReader(RUNNER)


@settings(max_examples=500, deadline=None)
@given(hot_commands())
def test_a_hot_write_comes_to_what_its_json_command_comes_to(command: tuple[int, list[Any]]) -> None:
    code, fields = command
    compact = outcome_of(READER.item([7, code, *fields]))
    if code == ADD and type(fields[5]) is bytes:  # the hashes as int64s: the JSON command has them as a list
        if len(fields[5]) % 8:
            assert compact[0] == 400
            return
        fields = [*fields[:5], list(from_int64s(fields[5], signed=True) or ()), fields[6]]
    try:
        body = orjson.loads(orjson.dumps(json_body(code, fields)))
    except TypeError:  # bytes: JSON cannot carry it, so there is no JSON command to compare with
        assert compact[0] == 400
        return
    assert compact == outcome_of(RUNNER.resolve({"method": "POST", "path": PATHS[code], "body": body}))


def test_typical_hot_writes_skip_the_request() -> None:
    add = READER.item([1, ADD, "m", None, "r", 3, 1, [-1, 2], None])
    assert isinstance(add, Ready) and add.prepared == ["add", "m", "default", "r", 3, 1, (U64_MASK, 2), 0]
    packed = READER.item([1, ADD, "m", None, "r", 3, 1, int64s([-1, 2]), None])
    assert isinstance(packed, Ready) and packed.prepared == add.prepared
    free = READER.item([2, FREE, "m", "t", "r"])
    assert isinstance(free, Ready) and free.prepared == ["free", "m", "t", "r"]


@pytest.mark.parametrize(
    ("data", "code", "reason"),
    [
        ("[false, []]", 1003, "send binary frames"),
        (b"\xc1", 1007, "not msgpack: FormatError"),
        (b"\x92\xc3" + b"\x91" * 3000 + b"\xc0", 1007, "not msgpack: StackError"),
        (msgpack.packb([True, [["x" * (MAX_TEXT_BYTES + 1), ROUTE, "GET", "/health"]]]), 1007, "at most 4096 bytes"),
        (msgpack.packb([False, []]) + b"\x00", 1007, "not msgpack"),
        (msgpack.packb({"commands": []}), 1007, "[ordered, [command, ...]]"),
        (msgpack.packb([1, []]), 1007, "[ordered, [command, ...]]"),
        (msgpack.packb([True, {}]), 1007, "[ordered, [command, ...]]"),
        (msgpack.packb([True, [[1.5, ROUTE, "GET", "/health"]]]), 1007, "every command needs an `id`"),
        (msgpack.packb([True, [[]]]), 1007, "every command needs an `id`"),
        (msgpack.packb([True, [{"id": 1}]]), 1007, "every command needs an `id`"),
        (msgpack.packb([True, [[True, ROUTE, "GET", "/health"]]]), 1007, "every command needs an `id`"),
        (msgpack.packb([True, [[i, ROUTE, "GET", "/x"] for i in range(MAX_BATCH_COMMANDS + 1)]]), 1009, "at most"),
        (b"\x00" * (MAX_MESSAGE_BYTES + 1), 1009, "at most"),
    ],
)
def test_a_malformed_message_is_refused_as_a_whole(data: bytes | str, code: int, reason: str) -> None:
    with pytest.raises(Malformed) as refused:
        READER.parse(data)
    assert refused.value.code == code and reason in refused.value.reason


@pytest.mark.parametrize(
    "command",
    [[1], [1, "add"], [1, 99], [1, ADD, "m"], [1, ROUTE, "GET"], [1, ROUTE, "POST", "/add", {"model_name": "m"}]],
)
def test_a_command_that_is_not_one_gets_a_400_of_its_own(command: list[Any]) -> None:
    ids, items, ordered = READER.parse(msgpack.packb([True, [command, [2, FREE, "m", None, "r"]]]))
    assert ids == [1, 2] and ordered is True
    assert outcome_of(items[0])[0] == 400 and "compact command" in outcome_of(items[0])[1]["error"]
    assert outcome_of(items[1]) == ["free", "m", "default", "r"]


async def compact_results(ws: WebSocketConnection, count: int) -> dict[Any, list[Any]]:
    found: dict[Any, list[Any]] = {}
    while len(found) < count:
        for result in msgpack.unpackb(await ws.get_message()):
            assert result[0] not in found
            found[result[0]] = result
    return found


def as_json_result(result: list[Any]) -> dict[str, Any]:
    """A compact result in the JSON format's shape (the body parsed from the route's JSON bytes)."""
    body = orjson.loads(result[2]) if type(result[2]) is bytes else result[2]
    shown = {"id": result[0], "status": result[1], "body": body}
    if len(result) > 3:
        shown["headers"] = result[3]
    return shown


def json_command(command: list[Any]) -> dict[str, Any]:
    """The JSON command a compact one stands for."""
    if command[1] == ADD and type(command[7]) is bytes:
        command = [*command[:7], list(from_int64s(command[7], signed=True) or ()), command[8]]
    if command[1] == ROUTE:
        shown = {"id": command[0], "method": command[2], "path": command[3]}
        if len(command) > 4:
            shown["body"] = orjson.loads(command[4])
        return shown
    return {"id": command[0], "method": "POST", "path": PATHS[command[1]], "body": json_body(command[1], command[2:])}


REGISTER = orjson.dumps({"model_name": "m", "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 2})
SCRIPT = [
    [[0, ROUTE, "POST", "/register", REGISTER]],
    [
        [1, ADD, "m", None, "r1", 1, 0, int64s([1, 2, 3]), 48],
        [2, ADD, "m", None, "r1", 1, 0, [1, 2, 3], None],  # a duplicate
        [3, ADD, "m", None, "r2", 1, 9, [4], None],  # no such rank
        [4, ADD, "m", None, "r3", -1, 0, int64s([4]), None],  # refused by the strict parser
        [5, ADD, "m", "t", "r4", 1, 0, [4], None],  # no such scope
        [6, PREFILL_COMPLETE, "m", None, "r1"],
        [7, FREE, "m", None, "ghost"],
        ["loads", ROUTE, "GET", "/loads?model_name=m"],
        ["no route", ROUTE, "GET", "/nope"],
        ["405", ROUTE, "DELETE", "/loads"],
        ["nested", ROUTE, "POST", "/batch", b"[]"],
    ],
    [[8, FREE, "m", None, "r1"], ["after", ROUTE, "GET", "/loads?model_name=m"]],
]


@pytest.mark.parametrize("kind", ["slot tracker", "selection service"])
async def test_every_command_is_answered_as_its_json_command(tmp_path: Path, kind: str) -> None:
    """The same script through both formats, on two fresh services: the same results, id for id (the
    selection service has no hot writes: they get the JSON command's 404)."""
    async with (
        running(kind, tmp_path / "compact") as service,
        open_websocket(ws_url(service.urls[0]), subprotocols=[SUBPROTOCOL]) as ws,
    ):
        assert ws.subprotocol == SUBPROTOCOL
        compact: dict[Any, Any] = {}
        for message in SCRIPT:
            await ws.send_message(msgpack.packb([True, message]))
            compact |= await compact_results(ws, len(message))
        # A body that is not JSON (no JSON command can carry one): refused as its HTTP request is.
        path = "/free" if kind == "slot tracker" else "/select"
        await ws.send_message(msgpack.packb([True, [["bad json", ROUTE, "POST", path, b"{"]]]))
        refused = as_json_result((await compact_results(ws, 1))["bad json"])
        assert refused["status"] == 400 and "Failed to parse the request body as JSON" in refused["body"]["error"]
    async with running(kind, tmp_path / "json") as service, open_websocket(ws_url(service.urls[0])) as ws:
        assert ws.subprotocol is None
        answered: dict[Any, Any] = {}
        for message in SCRIPT:
            await send(ws, [json_command(command) for command in message])
            answered |= await results(ws, len(message))
    assert {key: as_json_result(result) for key, result in compact.items()} == answered
    if kind == "slot tracker":
        statuses = [answered[i]["status"] for i in range(1, 9)]
        assert statuses == [201, 409, 404, 422, 404, 200, 200, 200], statuses
        assert answered["after"]["body"][0]["active_decode_blocks"] == 0
        assert answered["405"]["status"] == 405 and answered["405"]["headers"]["allow"]
        assert answered["nested"]["status"] == 400
    assert answered["no route"]["status"] == 404


async def test_a_malformed_message_closes_the_connection_and_applies_nothing(tmp_path: Path) -> None:
    async with running("slot tracker", tmp_path) as service:
        async with open_websocket(ws_url(service.urls[0]), subprotocols=[SUBPROTOCOL]) as ws:
            await ws.send_message(msgpack.packb([True, [[0, ROUTE, "POST", "/register", REGISTER]]]))
            assert (await compact_results(ws, 1))[0][1] == 201
            await ws.send_message(msgpack.packb([True, [[1, ADD, "m", None, "r1", 1, 0, [1], None], [2.5, FREE]]]))
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
        assert closed.value.reason.code == 1007 and "`id`" in (closed.value.reason.reason or "")
        async with open_websocket(ws_url(service.urls[0]), subprotocols=[SUBPROTOCOL]) as ws:
            await ws.send_message("text")
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
        assert closed.value.reason.code == 1003
        async with StreamClient.connect(service.urls[0]) as client:
            assert client.format == "msgpack"
            assert (await client.call("GET", "/loads?model_name=m")).body[0]["active_decode_blocks"] == 0


async def test_hashes_the_client_cannot_pack_are_answered_as_json_would_answer_them(tmp_path: Path) -> None:
    async with running("slot tracker", tmp_path) as service:
        for compact in (True, False):
            async with StreamClient.connect(service.urls[0], compact=compact) as client:
                await client.register(1, block_size=16)
                answers = [
                    await client.call("POST", "/add", body)
                    for body in (
                        {"model_name": "default", "request_id": "a", "worker_id": 1, "dp_rank": 0, **fields}
                        for fields in ({"sequence_hashes": [1, True]}, {"sequence_hashes": [2**63]})
                    )
                ]
                refusals = []
                for hashes in ([1, True], [2**63], [1.0]):
                    with pytest.raises(CommandError) as refused:
                        await client.add("r", 1, hashes)
                    refusals.append((refused.value.status, refused.value.message))
                assert await client.add("r", 1, [-1, 2**63 - 1]) is True
                assert await client.free("r") is False
                await client.unregister(1)
            assert [answer.status for answer in answers] == [422, 422]
            assert refusals == [(answer.status, answer.body["error"]) for answer in answers] + [refusals[2]]
            assert refusals[2][0] == 422


async def test_the_client_speaks_json_when_asked(tmp_path: Path) -> None:
    async with running("slot tracker", tmp_path) as service:
        async with StreamClient.connect(service.urls[0], compact=False) as client:
            assert client.format == "json"
            assert await client.register(1, block_size=16) is True
            assert await client.add("r", 1, [1, 2], tenant_id=None, new_isl_tokens=None) is True
            assert (await client.call("GET", "/loads")).body[0]["active_decode_blocks"] == 2
        async with StreamClient.connect(service.urls[0]) as client:
            assert client.format == "msgpack"
            assert await client.free("r") is False
            assert (await client.call("GET", "/loads")).body[0]["active_decode_blocks"] == 0


async def test_a_large_message_that_is_all_in_flight_is_journaled_in_two_halves(tmp_path: Path) -> None:
    """A client waiting for a whole message is answered half by half: each half gets its own actor turn and its
    own fsync, so the first half's answers can go back while the second is applied (two group commits, where a
    message used to be one). An ordered message is never split; a small one neither."""
    count = 2 * SPLIT_MIN_COMMANDS
    async with (
        running("slot tracker", tmp_path) as service,
        open_websocket(ws_url(service.urls[0]), subprotocols=[SUBPROTOCOL]) as ws,
    ):
        journal = service.system.journal
        await ws.send_message(msgpack.packb([True, [[0, ROUTE, "POST", "/register", REGISTER]]]))
        assert (await compact_results(ws, 1))[0][1] == 201

        async def batches_for(ordered: bool, commands: list[list[Any]]) -> int:
            before = journal.statistics().batches_written
            await ws.send_message(msgpack.packb([ordered, commands]))
            found = await compact_results(ws, len(commands))
            assert sorted(result[1] for result in found.values()) == [201] * len(commands)
            assert journal.durable_lsn == journal.last_lsn
            return journal.statistics().batches_written - before

        def adds(prefix: str, n: int) -> list[list[Any]]:
            return [[i, ADD, "m", None, f"{prefix}{i}", 1, i % 2, int64s([i, i + 1]), 16] for i in range(n)]

        assert await batches_for(False, adds("a", count)) == 2
        assert await batches_for(True, adds("b", count)) == 1
        assert await batches_for(False, adds("c", count - 1)) == 1


class _HeldWrites:
    """A slot tracker whose ``apply_writes`` calls are held until the test lets each one finish."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []  # request ids of each call, in call order
        self.finished = 0
        self.release = trio.Semaphore(0)

    async def apply_writes(self, writes: list[Any]) -> list[Any]:
        self.calls.append([write[3] for write in writes])
        await self.release.acquire()
        self.finished += 1
        return [True] * len(writes)


async def test_hot_writes_that_arrive_while_a_group_is_applied_wait_for_its_answers() -> None:
    """In process: the writes of a message that arrives while the connection's previous group is being applied
    are applied only once that group is answered, together (one call for the messages that came meanwhile),
    so a group's answers never wait for the next group's actor turn."""
    service = _HeldWrites()
    batches = routes.write_batches(service)  # type: ignore[arg-type]
    runner = CommandRunner()
    runner.serve([routes.write_route(service, "add", routes.prepare_add, batches)])  # type: ignore[arg-type]
    inbox_send, inbox = trio.open_memory_channel[dict[str, Any]](math.inf)
    sent: list[list[Any]] = []

    async def send_out(message: dict[str, Any]) -> None:
        sent.append([result[0] for result in msgpack.unpackb(message["bytes"])])

    def message(*names: str) -> dict[str, Any]:
        commands = [[name, ADD, "m", None, name, 1, 0, [1, 2], None] for name in names]
        return {"type": "websocket.receive", "bytes": msgpack.packb([False, commands])}

    stream = CommandStream(runner, send_out, compact=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream.serve, inbox.receive)
        inbox_send.send_nowait(message("a1", "a2"))
        await trio.testing.wait_all_tasks_blocked()
        inbox_send.send_nowait(message("b1"))
        inbox_send.send_nowait(message("c1", "c2"))
        await trio.testing.wait_all_tasks_blocked()
        assert service.calls == [["a1", "a2"]]  # b and c read, held back
        service.release.release()
        await trio.testing.wait_all_tasks_blocked()
        assert sent == [["a1", "a2"]] and service.calls == [["a1", "a2"], ["b1", "c1", "c2"]]
        service.release.release()
        await trio.testing.wait_all_tasks_blocked()
        assert sent == [["a1", "a2"], ["b1", "c1", "c2"]] and stream.window.used == 0
        nursery.cancel_scope.cancel()


async def test_a_large_message_is_split_only_when_it_is_all_the_service_has_in_flight() -> None:
    """In process, two connections: a message that is everything in flight is applied in two halves; while
    another connection has a command in flight, the service has that to overlap with, and it goes whole."""
    service = _HeldWrites()
    batches = routes.write_batches(service)  # type: ignore[arg-type]
    runner = CommandRunner()
    runner.serve([routes.write_route(service, "add", routes.prepare_add, batches)])  # type: ignore[arg-type]
    everywhere = InFlight()

    def message(prefix: str, count: int) -> dict[str, Any]:
        commands = [[f"{prefix}{i}", ADD, "m", None, f"{prefix}{i}", 1, 0, [1, 2], None] for i in range(count)]
        return {"type": "websocket.receive", "bytes": msgpack.packb([False, commands])}

    async def ignore(message: dict[str, Any]) -> None:
        pass

    count = 2 * SPLIT_MIN_COMMANDS
    one_send, one = trio.open_memory_channel[dict[str, Any]](math.inf)
    other_send, other = trio.open_memory_channel[dict[str, Any]](math.inf)
    async with trio.open_nursery() as nursery:
        for inbox in (one, other):
            stream = CommandStream(runner, ignore, compact=True, everywhere=everywhere)
            nursery.start_soon(stream.serve, inbox.receive)
        one_send.send_nowait(message("a", count))
        await trio.testing.wait_all_tasks_blocked()
        assert [len(call) for call in service.calls] == [count // 2]  # the first half, alone
        service.release.release()
        await trio.testing.wait_all_tasks_blocked()
        assert [len(call) for call in service.calls] == [count // 2] * 2
        other_send.send_nowait(message("b", count))  # while the second half of "a" is in flight
        await trio.testing.wait_all_tasks_blocked()
        assert [len(call) for call in service.calls] == [count // 2] * 2 + [count]
        service.release.release()
        service.release.release()
        await trio.testing.wait_all_tasks_blocked()
        assert everywhere.used == 0
        nursery.cancel_scope.cancel()


async def test_results_are_written_to_the_socket_directly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the real server, each message of results goes to the socket as one frame written by the stream's own
    task (``api/streams/ws_direct.py``), not through hypercorn's WebSocket stream; the client reads them as usual."""
    written: list[bool] = []
    write = DirectSocket.write

    def counted(self: DirectSocket, frame: bytes) -> bool:
        written.append(write(self, frame))
        return written[-1]

    monkeypatch.setattr(DirectSocket, "write", counted)
    async with (
        running("slot tracker", tmp_path) as service,
        open_websocket(ws_url(service.urls[0]), subprotocols=[SUBPROTOCOL]) as ws,
    ):
        for message in SCRIPT:
            await ws.send_message(msgpack.packb([True, message]))
            found = await compact_results(ws, len(message))
            assert set(found) == {command[0] for command in message}
    assert written and all(written)


class _PartWriter:
    """A socket that takes the first frame only in part: the rest is flushed before anything else is sent."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.left = 0

    def write(self, frame: bytes) -> bool:
        if self.left:
            return False  # the server's stream writes nothing while a frame is unfinished
        self.log.append("write")
        self.left = 1
        return True

    @property
    def unsent(self) -> bool:
        return self.left > 0

    async def flush(self) -> None:
        await trio.lowlevel.checkpoint()
        self.log.append("flush")
        self.left = 0


async def test_a_frame_written_in_part_is_finished_before_the_next_message() -> None:
    log: list[str] = []

    async def asgi_send(message: dict[str, Any]) -> None:
        log.append("asgi")

    stream = CommandStream(CommandRunner(), asgi_send, compact=True, direct=_PartWriter(log))  # type: ignore[arg-type]
    await stream._send_compact(b"\x90")
    await stream._send_compact(b"\x90")
    assert log == ["write", "flush", "write", "flush"] and stream.written_directly == 2


class _BrokenWriter:
    """A socket that takes the start of a frame, then breaks (the client reset the connection, or took nothing for
    --http-write-timeout-secs and the server closed it)."""

    def write(self, frame: bytes) -> bool:
        return True

    @property
    def unsent(self) -> bool:
        return True

    async def flush(self) -> None:
        await trio.lowlevel.checkpoint()
        raise trio.BrokenResourceError("socket connection broken: [Errno 32] Broken pipe")


async def test_a_client_gone_while_its_results_are_written_ends_the_stream_quietly() -> None:
    """The socket breaking under a direct write ends the connection's stream as a disconnect does; it used to
    raise out of the ASGI app, logged by hypercorn as an "Error in ASGI Framework" with a traceback for every
    client that went away (or was closed for not reading) while its answers were written."""

    async def asgi_send(message: dict[str, Any]) -> None:
        raise AssertionError(f"nothing goes the ASGI way here: {message}")

    inbox_send, inbox = trio.open_memory_channel[dict[str, Any]](math.inf)
    inbox_send.send_nowait({"type": "websocket.receive", "bytes": msgpack.packb([True, [[1, 0, "GET", "/nope"]]])})
    # No websocket.disconnect follows: the stream must end on the broken socket alone.
    stream = CommandStream(CommandRunner(), asgi_send, compact=True, direct=_BrokenWriter())  # type: ignore[arg-type]
    with trio.fail_after(5):
        await stream.serve(inbox.receive)
    assert stream.written_directly == 1  # the frame begun on the socket, then the socket broke


async def test_a_group_s_results_are_each_response_rendered_with_its_own_id() -> None:
    """Responses repeated in a group (a write's 201 or 200) are rendered once: every result is still exactly
    ``render_compact`` of its own id and response, headers and bodies included, whatever the mix."""
    responses = [
        CREATED,
        OK,
        CREATED,
        error_response(404, "Request r not found"),
        error_response(405, "no", ((b"allow", b"GET"),)),
        OK,
        Response(204, b""),
        json_response(200, [{"a": 1}]),
        CREATED,
    ]
    ids: list[Any] = [7, "x", 0, -3, "é", 8, 9, "ten", 11]

    async def apply(prepared: list[Any]) -> list[Response]:
        assert prepared == list(range(len(responses)))
        return responses

    stream = CommandStream(CommandRunner(), None, compact=True)
    await stream._apply_hot(ids, [Ready(apply, index) for index in range(len(responses))], apply)
    assert stream.outgoing == [render_compact(i, r) for i, r in zip(ids, responses, strict=True)]
    assert msgpack.unpackb(msgpack.packb(stream.outgoing)) == [
        render_compact(i, r) for i, r in zip(ids, responses, strict=True)
    ]
