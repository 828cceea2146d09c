"""Discovery from a real etcd in Dynamo's layout: workers written as Dynamo writes them join the catalog, a deleted
key or an expired lease (kill -9) removes them, the watch resumes after an etcd restart without losing a change,
an outage keeps the catalog and says so, a restart of kvrouter reconciles its journaled catalog, and a discovered
worker cannot be edited over HTTP."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.fleet.options import FleetOptions
from kvrouter.api.process.main import ServiceHandle, ServiceOptions, run_service, select_service_builder
from kvrouter.api.routes.selection import SELECTION_BODY_LIMIT
from kvrouter.journal.store import Durability
from tests.support.dynamo_keys import instance_key, worker_keys
from tests.support.fleet_servers import EtcdServer, require_etcd

pytestmark = pytest.mark.slow

WORKER_A, PUBLISHER_A = 0x7A00000000000A01, 0x7A000000000000A1
WORKER_B, PUBLISHER_B = 0x7B00000000000B01, 0x7B000000000000B1
WAIT = 30  # seconds any one condition may take before the test fails (a bound, not a measurement)


@pytest.fixture
async def etcd(tmp_path: Path) -> Any:
    require_etcd()
    server = EtcdServer(tmp_path)
    await server.start()
    yield server
    await server.stop()


async def start_selector(nursery: trio.Nursery, data_dir: Path, etcd: EtcdServer) -> ServiceHandle:
    options = ServiceOptions(port=0, data_dir=data_dir, durability=Durability.ALWAYS, body_limit=SELECTION_BODY_LIMIT)
    fleet = FleetOptions(discovery_backend="etcd", etcd_endpoints=(etcd.url,), event_plane=None)
    # Without an event plane nothing feeds the workers' KV events: they are scored on their bookings.
    config = RouterConfig(use_kv_events=False)
    handle: ServiceHandle = await nursery.start(
        run_service, "selection service", options, select_service_builder(config, fleet=fleet)
    )
    return handle


async def write_worker(etcd: EtcdServer, worker: int, publisher: int, lease: int | None = None) -> None:
    for key, value in worker_keys(worker, publisher).items():
        await etcd.put(key, value, lease)


async def eventually(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll ``check`` until it holds; fail after ``WAIT`` seconds (a bound on a hang, not a timing assertion)."""
    with trio.fail_after(WAIT):
        while True:
            if await check():
                return
            await trio.sleep(0.05)


async def worker_ids(http: httpx.AsyncClient) -> set[int]:
    return {row["worker_id"] for row in (await http.get("/workers")).json()}


async def test_workers_in_dynamos_layout_join_and_leave(
    etcd: EtcdServer, nursery: trio.Nursery, tmp_path: Path
) -> None:
    await write_worker(etcd, WORKER_A, PUBLISHER_A)
    handle = await start_selector(nursery, tmp_path / "data", etcd)
    async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
        (row,) = (await http.get("/workers")).json()  # the first list is in the catalog before the port opens
        assert row["worker_id"] == WORKER_A
        assert (row["model_name"], row["block_size"], row["discovered_by"]) == ("tiny", 16, "etcd")
        assert row["total_kv_blocks"] == 1024
        # kill -9 of a worker: its keys stay until its lease expires, then etcd deletes them
        lease = await etcd.grant(2)
        await write_worker(etcd, WORKER_B, PUBLISHER_B, lease)

        async def b_joined() -> bool:
            return WORKER_B in await worker_ids(http)

        async def b_left() -> bool:
            return WORKER_B not in await worker_ids(http)

        await eventually(b_joined)
        await eventually(b_left)  # nobody keeps the lease alive
        # a clean stop deletes the keys
        await etcd.delete(instance_key(WORKER_A))

        async def none_left() -> bool:
            return await worker_ids(http) == set()

        await eventually(none_left)
    handle.stop()


async def test_a_discovered_worker_cannot_be_edited_over_http(
    etcd: EtcdServer, nursery: trio.Nursery, tmp_path: Path
) -> None:
    await write_worker(etcd, WORKER_A, PUBLISHER_A)
    handle = await start_selector(nursery, tmp_path / "data", etcd)
    async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
        body = {"worker_id": WORKER_A, "model_name": "tiny", "endpoint": "http://x", "block_size": 16}
        for response in (
            await http.post("/workers", json=body),
            await http.patch(f"/workers/{WORKER_A}", json={"block_size": 32}),
            await http.delete(f"/workers/{WORKER_A}"),
        ):
            assert response.status_code == 409, response.text
            assert "discovered from etcd" in response.json()["error"]
        (row,) = (await http.get("/workers")).json()
        assert row["block_size"] == 16  # unchanged
        # a worker registered over HTTP works beside it
        other = {"worker_id": 5, "model_name": "tiny", "endpoint": "http://y", "block_size": 16}
        assert (await http.post("/workers", json=other)).status_code == 201
        assert await worker_ids(http) == {WORKER_A, 5}
    handle.stop()


async def test_the_watch_resumes_after_an_etcd_restart_without_losing_a_change(
    etcd: EtcdServer, nursery: trio.Nursery, tmp_path: Path
) -> None:
    await write_worker(etcd, WORKER_A, PUBLISHER_A)
    handle = await start_selector(nursery, tmp_path / "data", etcd)
    async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
        assert (await http.get("/ready")).json()["discovery"]["state"] == "synced"
        await etcd.stop()

        async def says_unreachable() -> bool:
            return (await http.get("/ready")).json()["discovery"]["state"] == "unreachable"

        await eventually(says_unreachable)
        ready = (await http.get("/ready")).json()
        assert ready["ready"] is True  # the last known catalog is kept
        assert [row["worker_id"] for row in ready["workers"]] == [WORKER_A]
        metrics = (await http.get("/metrics")).text
        assert 'kvrouter_discovery_up{backend="etcd"} 0.0' in metrics
        await etcd.start()
        # changed at once: before kvrouter's next retry, so only a watch resumed from its revision sees it
        await write_worker(etcd, WORKER_B, PUBLISHER_B)
        await etcd.delete(instance_key(WORKER_A))

        async def caught_up() -> bool:
            return await worker_ids(http) == {WORKER_B}

        await eventually(caught_up)
        assert (await http.get("/ready")).json()["discovery"]["state"] == "synced"
        assert 'kvrouter_discovery_outages_total{backend="etcd"} 1.0' in (await http.get("/metrics")).text
    handle.stop()


async def test_an_outage_is_one_outage_until_etcd_answers_again(
    etcd: EtcdServer, nursery: trio.Nursery, tmp_path: Path
) -> None:
    # Retrying the watch must not count as etcd being back: the state stays unreachable, one outage is counted and
    # the retries slow down (0.5, 1, 2, 4 s...), until a request to etcd has succeeded.
    await write_worker(etcd, WORKER_A, PUBLISHER_A)
    handle = await start_selector(nursery, tmp_path / "data", etcd)
    async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
        await etcd.stop()

        async def says_unreachable() -> bool:
            return (await http.get("/ready")).json()["discovery"]["state"] == "unreachable"

        await eventually(says_unreachable)
        states = set()
        for _ in range(20):  # 4 s of the outage
            states.add((await http.get("/ready")).json()["discovery"]["state"])
            await trio.sleep(0.2)
        assert states == {"unreachable"}
        assert 'kvrouter_discovery_outages_total{backend="etcd"} 1.0' in (await http.get("/metrics")).text
        await etcd.start()

        async def says_synced() -> bool:
            return (await http.get("/ready")).json()["discovery"]["state"] == "synced"

        await eventually(says_synced)
        assert 'kvrouter_discovery_outages_total{backend="etcd"} 1.0' in (await http.get("/metrics")).text
        await write_worker(etcd, WORKER_B, PUBLISHER_B)

        async def both() -> bool:
            return await worker_ids(http) == {WORKER_A, WORKER_B}

        await eventually(both)
    handle.stop()


async def test_a_restarted_service_reconciles_its_journaled_catalog(etcd: EtcdServer, tmp_path: Path) -> None:
    await write_worker(etcd, WORKER_A, PUBLISHER_A)
    async with trio.open_nursery() as nursery:  # the first run ends (journal closed) with this block
        handle = await start_selector(nursery, tmp_path / "data", etcd)
        async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
            assert await worker_ids(http) == {WORKER_A}
        handle.stop()
    # while kvrouter was away: A stopped, B started
    await etcd.delete(instance_key(WORKER_A))
    await write_worker(etcd, WORKER_B, PUBLISHER_B)
    async with trio.open_nursery() as nursery:
        handle = await start_selector(nursery, tmp_path / "data", etcd)
        async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
            assert await worker_ids(http) == {WORKER_B}
        handle.stop()
