"""kvrouter.client against real services: from trio, asyncio and plain threads; typed results, the service's
errors raised, commands batched under load, and durability (a result received, kill -9, restart: it is there)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import threading
import types
import typing
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from functools import partial
from pathlib import Path

import msgpack
import orjson
import pytest
import trio
import trio.testing
from trio_websocket import ConnectionClosed, WebSocketRequest, serve_websocket

from kvrouter.client import AsyncioClient, BlockingClient, CommandError, Selection, StreamClient, StreamClosed
from kvrouter.client.compact import SUBPROTOCOL
from tests.api.test_cli import CLI, Service
from tests.support.services import running

WORKER = {
    "worker_id": 5,
    "model_name": "m",
    "endpoint": "http://w5",
    "block_size": 4,
    "kv_events_endpoint": "tcp://127.0.0.1:9",
}


async def test_the_trio_client_runs_a_lifecycle_and_raises_refusals(tmp_path: Path) -> None:
    async with running("slot tracker", tmp_path) as service, StreamClient.connect(service.urls[0]) as client:
        assert await client.register(1, block_size=16, dp_size=2, model_name="m") is True
        with pytest.raises(CommandError) as refused:
            await client.register(1, block_size=16, dp_size=2, model_name="m")
        assert refused.value.status == 409 and refused.value.message.startswith("worker 1 already registered")
        assert await client.add("r1", 1, [1, 2, 3], new_isl_tokens=48, model_name="m") is True
        assert await client.prefill_complete("r1", model_name="m") is False
        assert await client.free("r1", model_name="m") is False
        with pytest.raises(CommandError) as refused:
            await client.prefill_complete("ghost", model_name="m")
        assert refused.value.status == 404 and refused.value.message == "Request ghost not found"
        with pytest.raises(CommandError) as refused:
            await client.add("r2", 1, [1], dp_rank=9, model_name="m")
        assert refused.value.status == 404 and "dp_rank" in refused.value.message
        reply = await client.call("GET", "/loads?model_name=m")
        assert reply.status == 200 and [row["active_decode_blocks"] for row in reply.body] == [0, 0]


async def test_concurrent_calls_share_messages(tmp_path: Path) -> None:
    async with running("slot tracker", tmp_path) as service, StreamClient.connect(service.urls[0]) as client:
        await client.register(1, block_size=16)
        async with trio.open_nursery() as nursery:
            for i in range(300):
                nursery.start_soon(client.add, f"r{i}", 1, [i])
        assert client.messages_sent < 100  # 301 commands; issued together, they went out together
        reply = await client.call("GET", "/loads")
        assert sum(row["active_decode_blocks"] for row in reply.body) == 300


async def test_the_selection_operations(tmp_path: Path) -> None:
    async with running("selection service", tmp_path) as service, StreamClient.connect(service.urls[0]) as client:
        with pytest.raises(CommandError) as refused:
            await client.select({"model_name": "m", "token_ids": [1, 2, 3, 4]})
        assert refused.value.status == 503
        shown = await client.put_worker(WORKER)
        assert shown["worker_id"] == 5
        chosen = await client.select_and_reserve(
            {"model_name": "m", "token_ids": list(range(8)), "reservation_id": "b"}
        )
        assert isinstance(chosen, Selection) and chosen.worker_id == 5 and chosen.reservation_id == "b"
        assert await client.reservation_prefill_complete("b") is None
        assert await client.output_block("b") is None
        booked = await client.reserve(
            {"model_name": "m", "reservation_id": "c", "worker_id": 5, "sequence_hashes": [1], "isl_tokens": 4}
        )
        assert booked.reservation_id == "c" and booked.worker_id == 5 and booked.endpoint == "http://w5"
        await client.release("b")
        with pytest.raises(CommandError) as refused:
            await client.release("b")
        assert refused.value.status == 404 and "b" in refused.value.message
        assert (await client.remove_worker(5))["worker_id"] == 5


def holds_its_type(value: object, hint: object) -> bool:
    """``value`` is of the annotated type ``hint`` (an ``X | None``, a ``dict[...]`` checked by its origin)."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    return any(isinstance(value, typing.get_origin(option) or option) for option in options)  # type: ignore[arg-type]


async def test_selections_and_bookings_hold_the_types_they_declare(tmp_path: Path) -> None:
    """Each field of ``Selection`` and ``Booking`` is of its annotated type in a real answer (``overlap`` was
    declared a float, but the route answers an object of tier counts)."""
    async with running("selection service", tmp_path) as service, StreamClient.connect(service.urls[0]) as client:
        await client.put_worker(WORKER)
        chosen = await client.select_and_reserve(
            {"model_name": "m", "token_ids": list(range(8)), "reservation_id": "t"}
        )
        booked = await client.reserve(
            {"model_name": "m", "reservation_id": "u", "worker_id": 5, "sequence_hashes": [1], "isl_tokens": 4}
        )
    assert chosen.overlap["longest_matched"] == 0
    for result in (chosen, booked):
        for name, hint in typing.get_type_hints(type(result)).items():
            assert holds_its_type(getattr(result, name), hint), (type(result).__name__, name, hint)


@contextlib.contextmanager
def silent_port() -> Iterator[str]:
    """The URL of a port that accepts connections (the kernel completes them) and never answers: a hung process,
    or a port that speaks something else, such as a worker's ZMQ KV-event port."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


async def test_connecting_to_a_port_that_never_answers_times_out() -> None:
    """Each flavour gives up on an upgrade that is never answered (it used to wait for ever: a BlockingClient or
    AsyncioClient pointed at a worker's KV-event port hung its constructor)."""
    with silent_port() as url, trio.fail_after(20):
        with pytest.raises(TimeoutError, match=r"no answer to the WebSocket upgrade within 0\.3 s"):
            async with StreamClient.connect(url, connect_timeout=0.3):
                pass
        for flavour in (BlockingClient, AsyncioClient):
            started = trio.current_time()
            with pytest.raises(TimeoutError):
                await trio.to_thread.run_sync(partial(flavour, url, connect_timeout=0.3))
            assert trio.current_time() - started < 5


async def test_a_client_without_the_token_is_refused(tmp_path: Path) -> None:
    async with running("slot tracker", tmp_path, token="tok") as service:
        with pytest.raises(StreamClosed) as refused:
            async with StreamClient.connect(service.urls[0]):
                pass
        assert "401" in str(refused.value) and "bearer token" in str(refused.value)
        async with StreamClient.connect(service.urls[0], token="tok") as client:
            assert await client.register(1, block_size=16) is True


async def test_the_asyncio_client(tmp_path: Path) -> None:
    async def use(url: str) -> list[bool]:
        async with AsyncioClient(url) as client:
            await client.register(1, block_size=16)
            created = await asyncio.gather(*[client.add(f"r{i}", 1, [i]) for i in range(50)])
            with pytest.raises(CommandError) as refused:
                await client.add("y", 2, [1])  # no such worker
            assert refused.value.status == 404
            return list(created)

    async with running("slot tracker", tmp_path) as service:
        created = await trio.to_thread.run_sync(lambda: asyncio.run(use(service.urls[0])))
    assert created == [True] * 50


async def test_every_flavour_says_its_format_and_speaks_json_when_asked(tmp_path: Path) -> None:
    """``compact=False`` and ``format``, as README gives them for ``StreamClient``, in the thread and asyncio
    flavours too (they had neither: ``client.format`` was an AttributeError)."""

    def blocking(url: str, compact: bool) -> tuple[str, bool]:
        with BlockingClient(url, compact=compact) as client:
            return client.format, client.add(f"b{compact}", 1, [1])

    async def in_asyncio(url: str, compact: bool) -> tuple[str, bool]:
        async with AsyncioClient(url, compact=compact) as client:
            return client.format, await client.add(f"a{compact}", 1, [1])

    async with running("slot tracker", tmp_path) as service, StreamClient.connect(service.urls[0]) as client:
        await client.register(1, block_size=16)
        url = service.urls[0]
        for compact, expected in ((True, "msgpack"), (False, "json")):
            assert await trio.to_thread.run_sync(blocking, url, compact) == (expected, True)
            assert await trio.to_thread.run_sync(lambda c=compact: asyncio.run(in_asyncio(url, c))) == (expected, True)


async def test_the_blocking_client_from_threads(tmp_path: Path) -> None:
    def use(url: str) -> list[bool]:
        results: list[bool] = []
        with BlockingClient(url) as client:
            client.register(1, block_size=16)

            def lifecycle(i: int) -> None:
                results.append(client.add(f"r{i}", 1, [i]))
                client.prefill_complete(f"r{i}")
                client.free(f"r{i}")

            threads = [threading.Thread(target=lifecycle, args=(i,)) for i in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert client.call("GET", "/loads").body[0]["active_decode_blocks"] == 0
        return results

    async with running("slot tracker", tmp_path) as service:
        results = await trio.to_thread.run_sync(use, service.urls[0])
    assert results == [True] * 8


def test_a_result_received_survives_kill_9(tmp_path: Path) -> None:
    data = ["--data-dir", str(tmp_path / "data"), "--durability", "always"]
    service = Service([*CLI, "slot-tracker", *data], tmp_path)
    try:
        url = f"http://127.0.0.1:{service.port}"
        with BlockingClient(url) as client:
            client.register(1, block_size=16)
            for i in range(20):
                assert client.add(f"r{i}", 1, [i, i + 100], new_isl_tokens=32) is True
        service.process.kill()  # SIGKILL, right after the last result arrived
        assert service.process.wait(30) == -9
    finally:
        service.kill()
    restarted = Service([*CLI, "slot-tracker", *data], tmp_path)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{restarted.port}/loads", timeout=30) as response:
            loads = orjson.loads(response.read())
    finally:
        restarted.stop()
    assert loads[0]["active_decode_blocks"] == 40 and loads[0]["active_prefill_tokens"] == 20 * 32


def test_the_client_module_imports_without_the_service() -> None:
    """``kvrouter.client`` needs trio-websocket, orjson and msgpack only, not the service's modules."""
    code = "import sys, kvrouter.client; print(sorted(m for m in sys.modules if m.startswith('kvrouter.')))"
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "kvrouter.actors" not in shown and "kvrouter.api" not in shown, shown


@pytest.mark.parametrize("compact", [True, False], ids=["msgpack", "json"])
async def test_commands_too_large_for_one_message_go_in_several(tmp_path: Path, compact: bool) -> None:
    """200 adds of 1,600 hashes each (2.6 MB as the compact format's int64s, 6.4 MB in JSON) issued together:
    split by size (the service closes the stream on a message over 1 MiB), every one answered; a single
    command over 1 MiB is refused before it is sent."""
    async with (
        running("slot tracker", tmp_path) as service,
        StreamClient.connect(service.urls[0], compact=compact) as client,
    ):
        assert client.format == ("msgpack" if compact else "json")
        await client.register(1, block_size=16)
        async with trio.open_nursery() as nursery:
            for i in range(200):
                nursery.start_soon(client.add, f"r{i}", 1, list(range(2**60 + i * 2000, 2**60 + i * 2000 + 1600)))
        assert 4 <= client.messages_sent <= 10
        with pytest.raises(ValueError, match="does not fit a stream message"):
            await client.add("huge", 1, list(range(2**62, 2**62 + 140_000)))
        reply = await client.call("GET", "/loads")
        assert sum(row["active_decode_blocks"] for row in reply.body) == 200 * 1600


async def test_an_idle_client_stays_connected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The service closes a connection silent for its body timeout; the client's heartbeat keeps it open."""
    monkeypatch.setattr("kvrouter.client.stream.PING_SECONDS", 0.2)
    async with (
        running("slot tracker", tmp_path, body_timeout=1.0) as service,
        StreamClient.connect(service.urls[0]) as client,
    ):
        await client.register(1, block_size=16)
        await trio.sleep(3.0)  # three body timeouts without a command
        assert await client.add("r", 1, [1]) is True


async def test_cancelled_callers_leave_the_stream_working() -> None:
    """Callers cancelled while their commands are in flight: their results are dropped when they come, and
    the next caller gets its own result."""
    first_read, cancelled = trio.Event(), trio.Event()

    async def handler(request: WebSocketRequest) -> None:
        ws = await request.accept(subprotocol=SUBPROTOCOL)
        held = msgpack.unpackb(await ws.get_message())[1]
        first_read.set()
        await cancelled.wait()
        await ws.send_message(msgpack.packb([[command[0], 200, b'{"status":"ok"}'] for command in held]))
        later = msgpack.unpackb(await ws.get_message())[1]
        await ws.send_message(msgpack.packb([[command[0], 201, b'{"status":"ok"}'] for command in later]))
        with contextlib.suppress(ConnectionClosed):
            await ws.get_message()

    async with serving(handler) as url, StreamClient.connect(url) as client:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                for i in range(50):
                    nursery.start_soon(client.free, f"c{i}")
                await first_read.wait()
                scope.cancel()
        cancelled.set()
        assert await client.add("after", 1, [1, 2, 3]) is True


@contextlib.asynccontextmanager
async def serving(handler: Callable[[WebSocketRequest], Awaitable[None]]) -> AsyncIterator[str]:
    """A WebSocket server on 127.0.0.1 port 0 running ``handler`` per connection; yields its http:// URL."""
    async with trio.open_nursery() as nursery:
        server = await nursery.start(partial(serve_websocket, handler, "127.0.0.1", 0, ssl_context=None))
        yield f"http://127.0.0.1:{server.port}"
        nursery.cancel_scope.cancel()


@contextlib.asynccontextmanager
async def fake_service(subprotocol: str | None, answer: bool) -> AsyncIterator[str]:
    """A WebSocket server on port 0 that accepts with ``subprotocol`` and reads one message; then answers its
    first command (``answer``) or closes with 1011 without answering."""

    async def handler(request: WebSocketRequest) -> None:
        ws = await request.accept(subprotocol=subprotocol)
        message = await ws.get_message()
        if answer:
            first = orjson.loads(message)["commands"][0]
            await ws.send_message(orjson.dumps({"results": [{"id": first["id"], "status": 200, "body": None}]}))
            with contextlib.suppress(ConnectionClosed):
                await ws.get_message()  # until the client closes
        await ws.aclose(code=1011, reason="boom")

    async with serving(handler) as url:
        yield url


async def test_every_waiting_caller_learns_the_stream_closed() -> None:
    async with fake_service(SUBPROTOCOL, answer=False) as url, StreamClient.connect(url) as client:
        assert client.format == "msgpack"
        failures: list[BaseException] = []

        async def caller(i: int) -> None:
            try:
                await client.free(f"r{i}")
            except StreamClosed as closed:
                failures.append(closed)

        async with trio.open_nursery() as nursery:
            for i in range(5):
                nursery.start_soon(caller, i)
        assert len(failures) == 5 and all("1011" in str(failure) for failure in failures)
        with pytest.raises(StreamClosed, match="1011"):
            await client.free("later")


async def test_the_client_speaks_json_to_a_service_without_the_compact_format() -> None:
    async with fake_service(None, answer=True) as url, StreamClient.connect(url) as client:
        assert client.format == "json"
        reply = await client.call("POST", "/free", {"model_name": "m", "request_id": "r"})
        assert reply.status == 200 and reply.body is None


@pytest.mark.parametrize("compact", [True, False], ids=["msgpack", "json"])
async def test_an_integer_beyond_64_bits_is_refused_before_it_is_sent(tmp_path: Path, compact: bool) -> None:
    """A hash >= 2**64 or < -2**63 (which neither format can carry) raises ValueError, as other bad arguments do
    (it was a bare OverflowError from msgpack, orjson.JSONEncodeError in JSON); nothing is sent and the stream
    goes on."""
    async with (
        running("slot tracker", tmp_path) as service,
        StreamClient.connect(service.urls[0], compact=compact) as client,
    ):
        await client.register(1, block_size=16)
        sent = client.messages_sent
        for hashes in ([2**64], [1, -(2**63) - 1]):
            with pytest.raises(ValueError, match=r"cannot be sent .*below -2\*\*63 or from 2\*\*64 on") as refused:
                await client.add("big", 1, hashes)
            assert "/add" in str(refused.value)
        with pytest.raises(ValueError, match="/register"):
            await client.register(2**64, block_size=16)
        assert client.messages_sent == sent
        assert await client.add("ok", 1, [2**63 - 1, -(2**63)]) is True  # the service's range: i64
        reply = await client.call("GET", "/loads")
        assert sum(row["active_decode_blocks"] for row in reply.body) == 2


async def test_a_token_with_a_line_break_is_refused_up_front_by_every_flavour(tmp_path: Path) -> None:
    """A token read from a file with its newline (or any CR/LF) raises ValueError naming ``token`` before anything
    is sent (it was an ExceptionGroup around h11's LocalProtocolError), from each flavour."""
    async with running("slot tracker", tmp_path, token="tok") as service:
        url = service.urls[0]
        for bad in ("tok\n", "tok\r\nX-Injected: 1", "to\rk"):
            with pytest.raises(ValueError, match=r"^token: .*CR, LF"):
                async with StreamClient.connect(url, token=bad):
                    pass
            for flavour in (BlockingClient, AsyncioClient):
                with pytest.raises(ValueError, match=r"^token: .*CR, LF"):
                    await trio.to_thread.run_sync(partial(flavour, url, token=bad))
        async with StreamClient.connect(url, token="tok") as client:
            assert await client.register(1, block_size=16) is True


async def test_a_url_without_a_scheme_is_refused_with_the_forms_accepted() -> None:
    """``host:port`` without a scheme was refused as "'host:port/ws/commands' is not a ws:// URL", a URL the
    caller never wrote; the message now shows what was given and the forms the client accepts."""
    for given in ("127.0.0.1:8091", "localhost:8091", "https://127.0.0.1:8091", "wss://127.0.0.1:8091/ws/commands"):
        with pytest.raises(ValueError) as refused:
            async with StreamClient.connect(given):
                pass
        message = str(refused.value)
        assert message.startswith(repr(given)) and "is not a ws:// URL" not in message, message
        assert "http://host:port" in message and "ws://host:port" in message, message


async def test_openapi_json_is_a_command_like_every_other_get_route(tmp_path: Path) -> None:
    """``GET /openapi.json`` in ``POST /batch`` and on the command stream answers the document that the plain
    route does (it was built after the commands' route table: a 404 "route not found" as a command)."""
    for kind in ("slot tracker", "selection service"):
        async with running(kind, tmp_path / kind.replace(" ", "-")) as service:
            url = service.urls[0]

            def fetch(url: str = url) -> tuple[typing.Any, typing.Any]:
                with urllib.request.urlopen(f"{url}/openapi.json", timeout=30) as response:
                    document = orjson.loads(response.read())
                batch = urllib.request.Request(
                    f"{url}/batch",
                    data=orjson.dumps([{"method": "GET", "path": "/openapi.json"}]),
                    headers={"content-type": "application/json"},
                )
                with urllib.request.urlopen(batch, timeout=30) as response:
                    return document, orjson.loads(response.read())

            document, results = await trio.to_thread.run_sync(fetch)
            assert results == [{"status": 200, "body": document}]
            assert "/openapi.json" in document["paths"] and "/batch" in document["paths"]
            for compact in (True, False):
                async with StreamClient.connect(url, compact=compact) as client:
                    reply = await client.call("GET", "/openapi.json")
                assert (reply.status, reply.body) == (200, document)


async def test_every_operation_of_the_table_works_from_the_client(tmp_path: Path) -> None:
    """The methods that follow the table's reads and writes beyond the lifecycle: each answers as its route."""
    async with running("selection service", tmp_path) as service, StreamClient.connect(service.urls[0]) as client:
        await client.health()
        with pytest.raises(CommandError) as refused:
            await client.ready()
        assert refused.value.status == 503  # no worker yet
        await client.put_worker(WORKER)
        assert (await client.ready())["ready"] is True
        assert [w["worker_id"] for w in await client.workers(model_name="m")] == [5]
        assert await client.workers(model_name="other") == []
        patched = await client.patch_worker(5, {"endpoint": "http://w5b"})
        assert patched["endpoint"] == "http://w5b"
        prompt = {"model_name": "m", "token_ids": list(range(8))}
        assert [row["worker_id"] for row in await client.potential_loads(prompt)] == [5]
        assert (await client.overlap_scores(prompt))["block_size"] == 4
        booked = await client.select_disaggregated({**prompt, "reservation_id": "d"})
        assert booked["reservation_id"] == "d"
        assert [p["loads"][0]["worker_id"] for p in await client.loads(model_name="m")] == [5]
        assert isinstance(await client.dump(), dict)
        assert "kvrouter_" in await client.metrics()
        assert (await client.openapi())["paths"]["/select"]["post"]["operationId"] == "select"
        assert await client.peers() == []
        with pytest.raises(CommandError) as refused:
            await client.register_peer("tcp://127.0.0.1:9")
        assert refused.value.status == 409  # replica sync is off
        assert (await client.remove_worker(5))["worker_id"] == 5
