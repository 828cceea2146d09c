"""Dynamo's NATS event plane against a real nats-server and etcd: envelopes published as Dynamo's workers publish
them reach the index (a /select for the same tokens shows the overlap), a sequence gap is counted on the worker,
and with JetStream a restarted kvrouter catches up on what was published while it was down."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
import trio

from kvrouter.actors.core.hashing import block_hashes
from kvrouter.actors.core.kv_wire import HashedBlocksStored
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.fleet.asyncio_bridge import AsyncioThread
from kvrouter.actors.fleet.dynamo_events import encode_envelope, encode_router_events
from kvrouter.actors.fleet.options import FleetOptions, JetStreamSettings
from kvrouter.api.process.main import ServiceHandle, ServiceOptions, run_service, select_service_builder
from kvrouter.api.routes.selection import SELECTION_BODY_LIMIT
from kvrouter.journal.store import Durability
from tests.support.dynamo_keys import NS, worker_keys
from tests.support.fleet_servers import EtcdServer, NatsServer, require_etcd, require_nats

pytestmark = pytest.mark.slow

WORKER, PUBLISHER = 0x5100000000000001, 0x51000000000000A1
SUBJECT = f"namespace.{NS}.component.backend.endpoint.generate.kv-events"
BLOCK = 16  # the card's kv_cache_block_size
TOKENS = list(range(1000, 1000 + 6 * BLOCK))
LOCAL = block_hashes(TOKENS, BLOCK)
WAIT = 30


@pytest.fixture
async def etcd(tmp_path: Path) -> AsyncIterator[EtcdServer]:
    require_etcd()
    server = EtcdServer(tmp_path)
    await server.start()
    for key, value in worker_keys(WORKER, PUBLISHER).items():
        await server.put(key, value)
    yield server
    await server.stop()


class Publisher:
    """Dynamo's publisher, as a test drives it: one envelope per call, numbered from ``sequence``."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._thread = AsyncioThread("test-nats-publisher")
        self._nc: Any = None

    async def __aenter__(self) -> Publisher:
        await self._thread.start()
        self._nc = await self._thread.call(nats.connect, self._url)
        return self

    async def __aexit__(self, *_: object) -> None:
        await self._thread.stop(self._nc.close)

    async def store(self, sequence: int, first: int, count: int) -> None:
        """Envelope ``sequence`` storing blocks ``first .. first + count - 1`` of ``TOKENS``."""
        parent = None if first == 0 else 0xE000 + first - 1
        pairs = tuple((0xE000 + i, LOCAL[i]) for i in range(first, first + count))
        payload = encode_router_events([(WORKER, 0, HashedBlocksStored(parent, pairs))])
        await self._thread.call(self._nc.publish, SUBJECT, encode_envelope(PUBLISHER, sequence, payload))
        await self._thread.call(self._nc.flush)


async def start_selector(
    nursery: trio.Nursery, data_dir: Path, etcd: EtcdServer, nats_server: NatsServer
) -> ServiceHandle:
    options = ServiceOptions(port=0, data_dir=data_dir, durability=Durability.ALWAYS, body_limit=SELECTION_BODY_LIMIT)
    fleet = FleetOptions(
        discovery_backend="etcd",
        etcd_endpoints=(etcd.url,),
        event_plane="nats",
        nats_servers=(nats_server.url,),
        jetstream=JetStreamSettings(durable="kvrouter-test"),
    )
    handle: ServiceHandle = await nursery.start(
        run_service, "selection service", options, select_service_builder(RouterConfig(), fleet=fleet)
    )
    return handle


async def eventually(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll ``check`` until it holds; fail after ``WAIT`` seconds (a bound on a hang, not a timing assertion)."""
    with trio.fail_after(WAIT):
        while True:
            if await check():
                return
            await trio.sleep(0.05)


async def reading(http: httpx.AsyncClient) -> bool:
    plane = (await http.get("/ready")).json().get("event_plane", {})
    return plane.get("state") == "connected" and bool(plane.get("subjects"))


async def overlap_blocks(http: httpx.AsyncClient) -> int:
    """The device blocks ``/select`` finds cached for ``TOKENS`` on the worker."""
    response = await http.post("/select", json={"model_name": "tiny", "token_ids": TOKENS})
    if response.status_code != 200:
        return 0  # no worker discovered yet
    answer = response.json()
    assert answer["worker_id"] == WORKER, answer
    return int(answer["overlap"]["dp"].get("0", 0)) // BLOCK


async def stream_status(http: httpx.AsyncClient) -> dict[str, Any]:
    (row,) = (await http.get("/workers")).json()
    status: dict[str, Any] = row["kv_listeners"]["0"]
    return status


async def test_core_nats_events_reach_the_index_and_gaps_are_counted(tmp_path: Path, etcd: EtcdServer) -> None:
    require_nats()
    server = NatsServer(tmp_path, jetstream=False)
    await server.start()
    try:
        async with trio.open_nursery() as nursery, Publisher(server.url) as publisher:
            handle = await start_selector(nursery, tmp_path / "data", etcd, server)
            async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
                await eventually(lambda: reading(http))
                assert (await http.get("/ready")).json()["event_plane"]["jetstream"] is False
                await publisher.store(0, 0, 2)
                await publisher.store(1, 2, 2)

                async def four() -> bool:
                    return await overlap_blocks(http) == 4

                await eventually(four)
                await publisher.store(3, 4, 2)  # envelope 2 never comes: a gap nothing can fill

                async def six() -> bool:
                    return await overlap_blocks(http) == 6

                await eventually(six)
                status = await stream_status(http)
                assert (status["plane"], status["last_seq"], status["gaps"], status["lost_batches"]) == (
                    "nats",
                    3,
                    1,
                    1,
                )
                metrics = (await http.get("/metrics")).text
                assert f'kvrouter_event_plane_lost_total{{dp_rank="0",worker_id="{WORKER}"}} 1.0' in metrics
            handle.stop()
    finally:
        await server.stop()


async def test_a_restart_catches_up_through_jetstream(tmp_path: Path, etcd: EtcdServer) -> None:
    require_nats()
    server = NatsServer(tmp_path, jetstream=True)
    await server.start()
    try:
        async with Publisher(server.url) as publisher:
            async with trio.open_nursery() as nursery:
                handle = await start_selector(nursery, tmp_path / "data", etcd, server)
                async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
                    await eventually(lambda: reading(http))
                    plane = (await http.get("/ready")).json()["event_plane"]
                    assert (plane["jetstream"], plane["stream"]) == (True, "KVROUTER_DYNAMO_KV_EVENTS")
                    await publisher.store(0, 0, 2)

                    async def two() -> bool:
                        return await overlap_blocks(http) == 2

                    await eventually(two)
                handle.stop()
            # kvrouter is down: the stream keeps what the worker publishes
            await publisher.store(1, 2, 2)
            await publisher.store(2, 4, 2)
            async with trio.open_nursery() as nursery:
                handle = await start_selector(nursery, tmp_path / "data", etcd, server)
                async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:

                    async def six() -> bool:
                        return await overlap_blocks(http) == 6

                    await eventually(six)
                    status = await stream_status(http)
                    assert (status["plane"], status["last_seq"], status["gaps"], status["lost_batches"]) == (
                        "jetstream",
                        2,
                        0,
                        0,
                    )
                handle.stop()
    finally:
        await server.stop()


async def test_envelopes_before_discovery_are_held_until_the_worker_is_discovered(tmp_path: Path) -> None:
    """A worker publishes from its first step; its keys may reach kvrouter's watch after its first envelopes."""
    require_etcd()
    require_nats()
    etcd = EtcdServer(tmp_path)
    server = NatsServer(tmp_path, jetstream=False)
    await etcd.start()
    await server.start()
    try:
        async with trio.open_nursery() as nursery, Publisher(server.url) as publisher:
            handle = await start_selector(nursery, tmp_path / "data", etcd, server)
            async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
                await eventually(lambda: reading(http))
                await publisher.store(0, 0, 2)  # nobody knows this publisher yet
                for key, value in worker_keys(WORKER, PUBLISHER).items():
                    await etcd.put(key, value)

                async def two() -> bool:
                    return await overlap_blocks(http) == 2

                await eventually(two)
                status = await stream_status(http)
                assert (status["last_seq"], status["lost_batches"]) == (0, 0)
            handle.stop()
    finally:
        await server.stop()
        await etcd.stop()
