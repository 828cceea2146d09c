"""The HTTP server against slow clients, connection floods and shutdown: real hypercorn on 127.0.0.1, raw sockets.

Bounds are asserted as "it happens", under a generous ``trio.fail_after`` that only a regression would hit.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import trio

from kvrouter.api.http.server import HttpSettings
from kvrouter.api.process.main import ServiceHandle, ServiceOptions, run_service, slot_tracker_app
from tests.support.kv_publisher import free_tcp_port
from tests.support.raw_http import ResponseReader, connect, request_bytes

JSON = {"content-type": "application/json"}
REGISTER = b'{"worker_id": 1, "model_name": "m", "block_size": 4, "dp_start": 0, "dp_size": 1}'


async def start(nursery: trio.Nursery, tmp_path: Path, **http: float) -> ServiceHandle:
    options = ServiceOptions(port=0, data_dir=tmp_path / "data", http=HttpSettings(**http))  # type: ignore[arg-type]
    handle: ServiceHandle = await nursery.start(run_service, "slot tracker", options, slot_tracker_app)
    return handle


async def closed_by_server(stream: trio.SocketStream) -> bytes:
    """Everything the server sends until it closes the connection."""
    received = b""
    while True:
        try:
            chunk = await stream.receive_some(65536)
        except trio.BrokenResourceError:
            return received
        if not chunk:
            return received
        received += chunk


async def test_a_request_head_trickling_in_is_closed_at_the_idle_timeout(nursery: trio.Nursery, tmp_path: Path) -> None:
    service = await start(nursery, tmp_path, idle_timeout=0.5, body_timeout=60)
    stream = await connect(service.urls[0])
    async with stream:

        async def trickle() -> None:
            for byte in b"GET /health HTTP/1.1\r\nhost: kvrouter\r\nx-slow: " + b"a" * 1000:
                await stream.send_all(bytes([byte]))
                await trio.sleep(0.05)

        with trio.fail_after(20):
            async with trio.open_nursery() as sending:
                sending.start_soon(trickle)
                assert await closed_by_server(stream) == b""
                sending.cancel_scope.cancel()


async def test_a_trickling_body_gets_408_and_the_connection_closes(nursery: trio.Nursery, tmp_path: Path) -> None:
    service = await start(nursery, tmp_path, body_timeout=0.5)
    stream = await connect(service.urls[0])
    async with stream:
        await stream.send_all(request_bytes("POST", "/register", headers={**JSON, "content-length": "10000"}))
        with trio.fail_after(20):
            async with trio.open_nursery() as sending:

                async def trickle() -> None:
                    for _ in range(10000):  # one byte every 0.1 s: never silent for a whole body timeout
                        await stream.send_all(b" ")
                        await trio.sleep(0.1)

                sending.start_soon(trickle)
                reader = ResponseReader(stream)
                response = await reader.response()
                sending.cancel_scope.cancel()
    assert response.status == 408 and response.closes
    assert response.json() == {"error": "the request body did not arrive within 0.5 s"}


async def test_a_silent_body_closes_the_connection(nursery: trio.Nursery, tmp_path: Path) -> None:
    service = await start(nursery, tmp_path, body_timeout=0.5)
    stream = await connect(service.urls[0])
    async with stream:
        await stream.send_all(request_bytes("POST", "/register", headers={**JSON, "content-length": "100"}))
        with trio.fail_after(20):
            await closed_by_server(stream)


async def test_connections_beyond_the_cap_get_503_and_slots_come_back(nursery: trio.Nursery, tmp_path: Path) -> None:
    service = await start(nursery, tmp_path, max_connections=2, idle_timeout=60)
    url = service.urls[0]
    held = [await connect(url), await connect(url)]
    for stream in held:  # both are being served
        await stream.send_all(request_bytes("GET", "/health"))
        assert (await ResponseReader(stream).response()).status == 200
    refused = await connect(url)
    async with refused:
        response = await ResponseReader(refused).response()
    assert response.status == 503 and response.closes and response.headers[b"retry-after"] == b"1"
    assert "--http-max-connections 2" in response.json()["error"]  # type: ignore[index]
    await held.pop().aclose()
    with trio.fail_after(20):  # the server notices the close, then the slot is free again
        while True:
            stream = await connect(url)
            async with stream:
                await stream.send_all(request_bytes("GET", "/health"))
                if (await ResponseReader(stream).response()).status == 200:
                    break
            await trio.sleep(0.05)
    await held.pop().aclose()


async def test_a_request_pipelined_after_an_early_close_does_not_hold_a_slot(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """415 closes the connection; hypercorn used to wait forever for the request pipelined behind it, which
    held a connection slot. (Hypercorn may also cut the 415 short there: the client must retry both.)"""
    service = await start(nursery, tmp_path, max_connections=1, idle_timeout=60)
    url = service.urls[0]
    for _ in range(3):
        stream = await connect(url)
        async with stream:
            early_close = request_bytes("POST", "/register", b"{}", {"content-type": "text/plain"})
            await stream.send_all(early_close + request_bytes("GET", "/health"))
            with trio.fail_after(20):
                received = await closed_by_server(stream)
            assert b" 200 " not in received  # the pipelined request is not served on a closing connection
    with trio.fail_after(20):  # the one slot is free: the next connection is served, not refused
        while True:
            stream = await connect(url)
            async with stream:
                await stream.send_all(request_bytes("GET", "/health"))
                if (await ResponseReader(stream).response()).status == 200:
                    break
            await trio.sleep(0.05)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], "an error was logged"


async def test_an_early_413_reaches_a_client_still_sending_its_body(slot_tracker: ServiceHandle) -> None:
    """The server drains what the client still sends before closing, so the 413 is not lost to a reset."""
    stream = await connect(slot_tracker.urls[0])
    body = b" " * (8 * 1024 * 1024)
    async with stream:
        head = request_bytes("POST", "/register", headers={**JSON, "content-length": str(len(body))})
        with trio.fail_after(20):
            async with trio.open_nursery() as sending:

                async def send_body() -> None:
                    with contextlib.suppress(trio.BrokenResourceError):  # the server closes after draining a while
                        await stream.send_all(head + body)

                sending.start_soon(send_body)
                response = await ResponseReader(stream).response()
                sending.cancel_scope.cancel()
    assert response.status == 413 and response.closes


# -- SIGTERM, on a real process -------------------------------------------------------------------------------

GRACE = "120"  # far longer than any test waits: a service that waited out its grace would fail the test


async def start_process(tmp_path: Path, port: int) -> trio.Process:
    argv = [sys.executable, "-m", "kvrouter.api.cli.main", "slot-tracker", "--port", str(port), "--data-dir", "data"]
    argv += ["--shutdown-grace-secs", GRACE, "--log-level", "info"]
    log = tmp_path / "service.log"
    with log.open("wb") as stderr:
        process = await trio.lowlevel.open_process(argv, cwd=tmp_path, stderr=stderr, stdout=subprocess.DEVNULL)
    # Its own line, not just an open port: another process on this machine may hold the port we were given.
    while f"listening on http://127.0.0.1:{port} " not in log.read_text():
        assert process.poll() is None, log.read_text()
        await trio.sleep(0.05)
    return process


async def stop(process: trio.Process) -> None:
    if process.poll() is None:
        process.kill()
        await process.wait()


async def test_sigterm_answers_requests_in_flight_closes_idle_ones_and_exits(tmp_path: Path) -> None:
    port = free_tcp_port()
    idle: list[trio.SocketStream] = []
    busy: list[trio.SocketStream] = []
    with trio.fail_after(60):
        process = await start_process(tmp_path, port)
        try:
            idle += [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(3)]
            for stream in idle:
                await stream.send_all(request_bytes("GET", "/health"))
                assert (await ResponseReader(stream).response()).status == 200
            busy += [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(3)]
            head = request_bytes("POST", "/register", headers={**JSON, "content-length": str(len(REGISTER))})
            for stream in busy:  # served once, then a request in flight: head and half the body sent
                await stream.send_all(request_bytes("GET", "/health"))
                assert (await ResponseReader(stream).response()).status == 200
                await stream.send_all(head + REGISTER[:20])
            process.send_signal(signal.SIGTERM)
            while True:  # draining: the listening socket is closed
                try:
                    await (await trio.open_tcp_stream("127.0.0.1", port)).aclose()
                except OSError:
                    break
                await trio.sleep(0.02)
            for stream in busy:
                await stream.send_all(REGISTER[20:])
                reader = ResponseReader(stream)
                response = await reader.response()
                assert response.status in (201, 409) and response.closes
                assert await reader.closed()
            for stream in idle:
                assert await ResponseReader(stream).closed()
            # Well before the grace: the service stops once the last in-flight request is answered.
            assert await process.wait() == 0
        finally:
            await stop(process)
            for stream in idle + busy:
                await stream.aclose()
    assert "Traceback" not in (tmp_path / "service.log").read_text()


@attrs.define
class KeepAliveClient:
    """Loops requests on one connection, each sent as soon as the previous answer arrives."""

    sent: int = 0
    answered: int = 0
    told_to_close: bool = False
    unanswered: bool = False

    async def run(self, port: int, started: trio.Event) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            reader = ResponseReader(stream)
            while not self.told_to_close:
                await stream.send_all(request_bytes("POST", "/register", REGISTER, JSON))
                self.sent += 1
                try:
                    response = await reader.response()
                except (EOFError, trio.BrokenResourceError):
                    self.unanswered = True
                    return
                self.answered += 1
                self.told_to_close = response.closes
                if self.answered == 5:
                    started.set()


async def test_sigterm_under_keep_alive_load_tells_every_client_to_close_and_exits(tmp_path: Path) -> None:
    """Before: every busy connection lost its last request and the service waited out its whole grace."""
    port = free_tcp_port()
    clients = [KeepAliveClient() for _ in range(8)]
    with trio.fail_after(60):
        process = await start_process(tmp_path, port)
        try:
            async with trio.open_nursery() as load:
                for client in clients:
                    ready = trio.Event()
                    load.start_soon(client.run, port, ready)
                    await ready.wait()
                process.send_signal(signal.SIGTERM)
            assert await process.wait() == 0
        finally:
            await stop(process)
    for client in clients:
        assert not client.unanswered and client.told_to_close, client
        assert client.sent == client.answered
    assert "Traceback" not in (tmp_path / "service.log").read_text()


@pytest.mark.parametrize("sent", [b"", b'{"worker_id": 1, "model'], ids=["no-body-yet", "part-of-the-body"])
async def test_a_body_that_stalls_gets_408_naming_the_body_timeout(
    nursery: trio.Nursery, tmp_path: Path, sent: bytes
) -> None:
    service = await start(nursery, tmp_path, body_timeout=0.5)
    stream = await connect(service.urls[0])
    async with stream:
        head = request_bytes("POST", "/register", headers={**JSON, "content-length": str(len(REGISTER))})
        await stream.send_all(head + sent)  # then nothing more: the client stalls, still connected
        with trio.fail_after(20):
            reader = ResponseReader(stream)
            response = await reader.response()
            assert await reader.closed()
    assert response.status == 408 and response.closes, response
    assert response.json() == {"error": "the request body did not arrive within 0.5 s"}
