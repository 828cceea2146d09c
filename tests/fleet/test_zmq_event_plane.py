"""Dynamo's ZMQ event plane: a worker's event channel names its PUB endpoint in etcd; kvrouter connects there and
reads Dynamo's four-frame messages into the index. Router events naming another worker are dropped and counted."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import trio
import zmq

from kvrouter.actors.core.hashing import block_hashes
from kvrouter.actors.core.kv_wire import HashedBlocksStored
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.fleet.dynamo_events import encode_envelope, encode_router_events, zmq_frames
from kvrouter.actors.fleet.options import FleetOptions
from kvrouter.actors.transport.zmq_socket import TrioZmqSocket, open_socket
from kvrouter.api.process.main import ServiceHandle, ServiceOptions, run_service, select_service_builder
from kvrouter.api.routes.selection import SELECTION_BODY_LIMIT
from kvrouter.journal.store import Durability
from tests.support.dynamo_keys import worker_keys, zmq_channel_value
from tests.support.fleet_servers import EtcdServer, require_etcd
from tests.support.processes import free_port

pytestmark = pytest.mark.slow

WORKER, PUBLISHER = 0x6200000000000001, 0x62000000000000A1
BLOCK = 16
TOKENS = list(range(2000, 2000 + 4 * BLOCK))
LOCAL = block_hashes(TOKENS, BLOCK)
WAIT = 30


@pytest.fixture
async def etcd(tmp_path: Path) -> AsyncIterator[EtcdServer]:
    require_etcd()
    server = EtcdServer(tmp_path)
    await server.start()
    yield server
    await server.stop()


def envelope(sequence: int, first: int, count: int, worker: int = WORKER) -> list[bytes]:
    parent = None if first == 0 else 0xD000 + first - 1
    pairs = tuple((0xD000 + i, LOCAL[i]) for i in range(first, first + count))
    payload = encode_router_events([(worker, 0, HashedBlocksStored(parent, pairs))])
    return zmq_frames(encode_envelope(PUBLISHER, sequence, payload), PUBLISHER, sequence)


async def overlap_blocks(http: httpx.AsyncClient) -> int:
    answer = (await http.post("/select", json={"model_name": "tiny", "token_ids": TOKENS})).json()
    return int(answer["overlap"]["dp"].get("0", 0)) // BLOCK


async def publish_until(pub: TrioZmqSocket, frames: list[bytes], http: httpx.AsyncClient, blocks: int) -> None:
    """Publish ``frames`` until the index holds ``blocks`` blocks: a SUB misses what a PUB sent before it joined,
    so the first envelope is repeated until kvrouter has connected (repeats are dropped as stale)."""
    with trio.fail_after(WAIT):
        while True:
            pub.try_send_multipart(frames)
            await trio.sleep(0.05)
            if await overlap_blocks(http) == blocks:
                return


async def test_zmq_channel_events_reach_the_index(etcd: EtcdServer, nursery: trio.Nursery, tmp_path: Path) -> None:
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    for key, value in worker_keys(WORKER, PUBLISHER, channel=zmq_channel_value(WORKER, endpoint)).items():
        await etcd.put(key, value)
    with open_socket(zmq.PUB) as pub:
        pub.socket.bind(endpoint)
        options = ServiceOptions(
            port=0, data_dir=tmp_path / "data", durability=Durability.ALWAYS, body_limit=SELECTION_BODY_LIMIT
        )
        fleet = FleetOptions(discovery_backend="etcd", etcd_endpoints=(etcd.url,), event_plane="zmq")
        handle: ServiceHandle = await nursery.start(
            run_service, "selection service", options, select_service_builder(RouterConfig(), fleet=fleet)
        )
        async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
            await publish_until(pub, envelope(0, 0, 2), http, 2)
            # the next envelope names a worker that is not the publisher's: dropped, counted, watermark moves
            pub.try_send_multipart(envelope(1, 2, 2, worker=0x99))
            await publish_until(pub, envelope(2, 2, 2), http, 4)
            (row,) = (await http.get("/workers")).json()
            status = row["kv_listeners"]["0"]
            assert (status["plane"], status["endpoint"], status["state"]) == ("zmq", endpoint, "active")
            assert (status["last_seq"], status["foreign_events"], status["lost_batches"]) == (2, 1, 0)
            assert status["stale_dropped"] >= 0
        handle.stop()
