"""A client that sends requests but never reads the answers: real hypercorn on 127.0.0.1, a raw socket with a tiny
receive buffer. Hypercorn's send has no timeout (and is shielded from cancellation), so such a connection used to
hold its connection slot, and the answers it had asked for, for ever; --http-write-timeout-secs closes it.

Bounds are asserted as "it happens", under a generous ``trio.fail_after`` that only a regression would hit.
"""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import trio

from kvrouter.api.http.server import HttpSettings
from kvrouter.api.process.main import ServiceHandle, ServiceOptions, run_service, slot_tracker_app
from tests.support.raw_http import ResponseReader, address, connect, request_bytes

LOADS = request_bytes("GET", "/loads")
PIPELINED = 16  # /loads of 8,192 ranks is ~1 MiB: 16 of them are more than the kernel's buffers hold


async def start(nursery: trio.Nursery, tmp_path: Path) -> ServiceHandle:
    settings = HttpSettings(max_connections=1, write_timeout=0.5)
    options = ServiceOptions(port=0, data_dir=tmp_path / "data", http=settings)
    handle: ServiceHandle = await nursery.start(run_service, "slot tracker", options, slot_tracker_app)
    return handle


async def health(url: str) -> int:
    """The status of GET /health on a new connection (503 while the one connection slot is taken)."""
    stream = await connect(url)
    async with stream:
        await stream.send_all(request_bytes("GET", "/health"))
        return (await ResponseReader(stream).response()).status


async def until_health_is(url: str, status: int) -> None:
    while await health(url) != status:  # noqa: ASYNC110 - polling over HTTP, no event to wait on
        await trio.sleep(0.05)


async def non_reader(url: str) -> trio.SocketStream:
    """A connection holding the one slot (answered once, so it was accepted), with a 4 KiB receive buffer."""
    while True:
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: the window stays small
        await sock.connect(address(url))
        stream = trio.SocketStream(sock)
        await stream.send_all(request_bytes("GET", "/health"))
        if (await ResponseReader(stream).response()).status == 200:
            return stream
        await stream.aclose()  # refused: the previous connection's slot was not released yet
        await trio.sleep(0.05)


async def test_a_client_that_never_reads_its_answers_is_closed(nursery: trio.Nursery, tmp_path: Path) -> None:
    service = await start(nursery, tmp_path)
    url = service.urls[0]
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        for worker_id in (1, 2):
            body = {"worker_id": worker_id, "model_name": "m", "block_size": 4, "dp_start": 0, "dp_size": 4096}
            assert (await http.post("/register", json=body)).status_code == 201
    with trio.fail_after(20):
        stream = await non_reader(url)
        async with stream, trio.open_nursery() as sending:
            sending.start_soon(stream.send_all, LOADS * PIPELINED)  # may block: the server stops reading too
            await until_health_is(url, 503)  # the non-reader holds the only slot
            await until_health_is(url, 200)  # ... until the write timeout closes it
            sending.cancel_scope.cancel()
            # What the server had written before it gave up arrives, then the end: never all the answers.
            reader, answers = ResponseReader(stream), 0
            try:
                while answers < PIPELINED:
                    await reader.response()
                    answers += 1
            except (EOFError, trio.BrokenResourceError):
                pass
            assert answers < PIPELINED
