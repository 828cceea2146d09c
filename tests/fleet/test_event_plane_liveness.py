"""A rank fed by Dynamo's event plane is watched for stopped KV events as a KV listener's is: two discovered
workers (etcd), their envelopes published on a real nats-server or on ZMQ PUB sockets as Dynamo's publishers do; a
booking on one that its events leave unanswered takes it out of selection within ``--kv-events-timeout-secs`` (its
bookings freed, ``/workers`` says why, ``/metrics`` counts it), and its next envelope brings it back; on NATS, so
does kvrouter's connection coming back after an outage. The two planes share the rule (``EventPlaneIngest`` is
one more feed of ``KvHealth``) and differ only in what "read now" means, so one scenario runs on both."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
import trio
import zmq

from kvrouter.actors.core.hashing import block_hashes
from kvrouter.actors.core.kv_wire import HashedBlocksStored
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.fleet.asyncio_bridge import AsyncioThread
from kvrouter.actors.fleet.dynamo_events import encode_envelope, encode_router_events, zmq_frames
from kvrouter.actors.fleet.options import FleetOptions
from kvrouter.actors.transport.zmq_socket import TrioZmqSocket, open_socket
from kvrouter.api.process.main import ServiceHandle, ServiceOptions, run_service, select_service_builder
from kvrouter.api.routes.selection import SELECTION_BODY_LIMIT
from kvrouter.journal.store import Durability
from tests.support.dynamo_keys import NS, worker_keys, zmq_channel_value
from tests.support.fleet_servers import EtcdServer, NatsServer, require_etcd, require_nats
from tests.support.processes import free_port

pytestmark = pytest.mark.slow

QUIET, OTHER = 0x7100000000000001, 0x7100000000000002  # the worker whose events stop, and one that stays in
PUBLISHERS = {QUIET: 0x71000000000000A1, OTHER: 0x71000000000000A2}
SUBJECT = f"namespace.{NS}.component.backend.endpoint.generate.kv-events"
BLOCK = 16
TOKENS = list(range(3000, 3000 + 4 * BLOCK))
LOCAL = block_hashes(TOKENS, BLOCK)
TIMEOUT_SECS = 1.0  # --kv-events-timeout-secs
CHECK_PERIOD_SECS = TIMEOUT_SECS / 4  # how often the service checks (select_service._follow_kv_liveness)
MARGIN_SECS = 1.0  # the polls, the journaled free and a loaded 2-core machine
WAIT = 30


def payload(worker: int, first: int, count: int) -> bytes:
    """Router events storing blocks ``first .. first + count - 1`` of ``TOKENS`` on ``worker``'s rank 0."""
    parent = None if first == 0 else 0xC000 + first - 1
    pairs = tuple((0xC000 + i, LOCAL[i]) for i in range(first, first + count))
    return encode_router_events([(worker, 0, HashedBlocksStored(parent, pairs))])


class NatsPublishers:
    """Both workers' publishers on core NATS: every envelope on the namespace's ``kv-events`` subject."""

    def __init__(self, url: str) -> None:
        self._thread = AsyncioThread("test-nats-publisher")
        self._url = url
        self._nc: Any = None

    async def __aenter__(self) -> NatsPublishers:
        await self._thread.start()
        self._nc = await self._thread.call(nats.connect, self._url)
        return self

    async def __aexit__(self, *_: object) -> None:
        await self._thread.stop(self._nc.close)

    async def send(self, worker: int, sequence: int, body: bytes) -> None:
        envelope = encode_envelope(PUBLISHERS[worker], sequence, body)
        await self._thread.call(self._nc.publish, SUBJECT, envelope)
        await self._thread.call(self._nc.flush)


class ZmqPublishers:
    """Both workers' publishers on ZMQ: a PUB socket each, at the endpoint its event channel names."""

    def __init__(self) -> None:
        self.endpoints = {worker: f"tcp://127.0.0.1:{free_port()}" for worker in PUBLISHERS}
        self._sockets: dict[int, TrioZmqSocket] = {}
        self._stack = AsyncExitStack()

    async def __aenter__(self) -> ZmqPublishers:
        for worker, endpoint in self.endpoints.items():
            pub = self._stack.enter_context(open_socket(zmq.PUB))
            pub.socket.bind(endpoint)
            self._sockets[worker] = pub
        return self

    async def __aexit__(self, *_: object) -> None:
        await self._stack.aclose()

    async def send(self, worker: int, sequence: int, body: bytes) -> None:
        publisher = PUBLISHERS[worker]
        self._sockets[worker].try_send_multipart(
            zmq_frames(encode_envelope(publisher, sequence, body), publisher, sequence)
        )


Publishers = NatsPublishers | ZmqPublishers


async def eventually(check: Callable[[], Awaitable[Any]], step: float = 0.05) -> Any:
    """Poll ``check`` until it returns something true; fail after ``WAIT`` seconds (a bound on a hang)."""
    with trio.fail_after(WAIT):
        while True:
            found = await check()
            if found:
                return found
            await trio.sleep(step)


async def start_selector(nursery: trio.Nursery, tmp_path: Path, fleet: FleetOptions) -> ServiceHandle:
    options = ServiceOptions(
        port=0, data_dir=tmp_path / "data", durability=Durability.ALWAYS, body_limit=SELECTION_BODY_LIMIT
    )
    config = RouterConfig(kv_events_timeout_secs=TIMEOUT_SECS)
    handle: ServiceHandle = await nursery.start(
        run_service, "selection service", options, select_service_builder(config, fleet=fleet)
    )
    return handle


async def rows(http: httpx.AsyncClient) -> dict[int, dict[str, Any]]:
    return {row["worker_id"]: row for row in (await http.get("/workers")).json()}


async def selected(http: httpx.AsyncClient) -> int:
    answer = (await http.post("/select", json={"model_name": "tiny", "token_ids": TOKENS})).json()
    worker: int = answer["worker_id"]
    return worker


async def metric(http: httpx.AsyncClient, line_start: str) -> str:
    (line,) = [line for line in (await http.get("/metrics")).text.splitlines() if line.startswith(line_start)]
    return line


async def both_fed(http: httpx.AsyncClient, publishers: Publishers) -> None:
    """Each worker's first envelope until the index holds it (a ZMQ SUB misses what a PUB sent before it joined;
    repeats are dropped as stale): the quiet worker stores all of ``TOKENS``, so ``/select`` prefers it."""

    async def indexed() -> bool:
        await publishers.send(QUIET, 0, payload(QUIET, 0, 4))
        await publishers.send(OTHER, 0, payload(OTHER, 0, 1))
        found = await rows(http)
        return all(found.get(w, {}).get("kv_listeners", {}).get("0", {}).get("last_seq") == 0 for w in PUBLISHERS)

    await eventually(indexed, step=0.1)
    assert await selected(http) == QUIET


async def outage_and_return(http: httpx.AsyncClient, publishers: Publishers) -> None:
    await both_fed(http, publishers)
    booking = {"model_name": "tiny", "reservation_id": "r1", "worker_id": QUIET, "sequence_hashes": [1]}
    assert (await http.post("/reservations", json={**booking, "isl_tokens": 16})).status_code in (200, 201)
    booked = time.monotonic()

    async def out() -> dict[str, Any] | None:
        shown: dict[str, Any] | None = (await rows(http))[QUIET].get("out_of_selection", {}).get("0")
        return shown

    shown = await eventually(out)
    after = time.monotonic() - booked
    print(f"out of selection {after:.2f} s after the booking (timeout {TIMEOUT_SECS} s)")
    assert after <= TIMEOUT_SECS + CHECK_PERIOD_SECS + MARGIN_SECS
    assert shown["reason"] == "kv_events_stopped" and shown["detail"].startswith("no KV events for ")
    assert "out_of_selection" not in (await rows(http))[OTHER]
    assert await metric(http, "kvrouter_kv_stream_outages_total") == (
        'kvrouter_kv_stream_outages_total{reason="kv_events_stopped"} 1.0'
    )
    assert await metric(http, "kvrouter_ranks_out_of_selection") == "kvrouter_ranks_out_of_selection 1.0"
    assert (await http.delete("/reservations/r1")).status_code == 404  # freed with the rank
    assert {await selected(http) for _ in range(5)} == {OTHER}  # it holds the blocks, and is skipped
    # Its events resume: back in selection, and chosen for its blocks again.
    await publishers.send(QUIET, 1, payload(QUIET, 0, 4))

    async def back() -> bool:
        return "out_of_selection" not in (await rows(http))[QUIET]

    await eventually(back)
    assert await metric(http, 'kvrouter_kv_stream_returns_total{cause="kv_events_resumed"}') == (
        'kvrouter_kv_stream_returns_total{cause="kv_events_resumed"} 1.0'
    )
    assert await selected(http) == QUIET


@pytest.fixture
async def etcd(tmp_path: Path) -> AsyncIterator[EtcdServer]:
    require_etcd()
    server = EtcdServer(tmp_path)
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def nats_server(tmp_path: Path, etcd: EtcdServer) -> AsyncIterator[NatsServer]:
    """A core NATS server, and both workers' keys in etcd with their channels on it."""
    require_nats()
    for worker, publisher in PUBLISHERS.items():
        for key, value in worker_keys(worker, publisher).items():
            await etcd.put(key, value)
    server = NatsServer(tmp_path, jetstream=False)
    await server.start()
    yield server
    await server.stop()


def nats_fleet(etcd: EtcdServer, server: NatsServer) -> FleetOptions:
    return FleetOptions(
        discovery_backend="etcd", etcd_endpoints=(etcd.url,), event_plane="nats", nats_servers=(server.url,)
    )


async def test_nats_fed_rank_goes_out_when_its_events_stop_and_back_when_they_resume(
    tmp_path: Path, etcd: EtcdServer, nats_server: NatsServer, nursery: trio.Nursery
) -> None:
    handle = await start_selector(nursery, tmp_path, nats_fleet(etcd, nats_server))
    async with NatsPublishers(nats_server.url) as publishers, httpx.AsyncClient(base_url=handle.urls[0]) as http:
        await outage_and_return(http, publishers)
    handle.stop()


async def test_a_rank_out_during_a_nats_outage_comes_back_when_kvrouter_reconnects(
    tmp_path: Path, etcd: EtcdServer, nats_server: NatsServer, nursery: trio.Nursery
) -> None:
    """The rule for a listener that reconnects after it was seen disconnected while out: kvrouter's link to the
    plane is back, so the rank is given its chance again (out again a timeout after its next unanswered booking)."""
    handle = await start_selector(nursery, tmp_path, nats_fleet(etcd, nats_server))
    async with NatsPublishers(nats_server.url) as publishers, httpx.AsyncClient(base_url=handle.urls[0]) as http:
        await both_fed(http, publishers)
        booking = {"model_name": "tiny", "reservation_id": "r1", "worker_id": QUIET, "sequence_hashes": [1]}
        await http.post("/reservations", json={**booking, "isl_tokens": 16})

        async def out() -> bool:
            return "out_of_selection" in (await rows(http))[QUIET]

        await eventually(out)
        await nats_server.stop()

        async def link_down() -> bool:
            return (await http.get("/ready")).json().get("event_plane", {}).get("state") == "disconnected"

        await eventually(link_down)
        await trio.sleep(2 * CHECK_PERIOD_SECS)  # a liveness check sees the rank's publisher not read
        await nats_server.start()

        async def back() -> bool:
            return not await out()

        await eventually(back)
        assert await metric(http, 'kvrouter_kv_stream_returns_total{cause="kv_stream_reconnected"}') == (
            'kvrouter_kv_stream_returns_total{cause="kv_stream_reconnected"} 1.0'
        )
    handle.stop()


async def test_zmq_fed_rank_goes_out_when_its_events_stop_and_back_when_they_resume(
    tmp_path: Path, etcd: EtcdServer, nursery: trio.Nursery
) -> None:
    async with ZmqPublishers() as publishers:
        for worker, publisher in PUBLISHERS.items():
            channel = zmq_channel_value(publisher, publishers.endpoints[worker])
            for key, value in worker_keys(worker, publisher, channel=channel).items():
                await etcd.put(key, value)
        fleet = FleetOptions(discovery_backend="etcd", etcd_endpoints=(etcd.url,), event_plane="zmq")
        handle = await start_selector(nursery, tmp_path, fleet)
        async with httpx.AsyncClient(base_url=handle.urls[0]) as http:
            await outage_and_return(http, publishers)
        handle.stop()
