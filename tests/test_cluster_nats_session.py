"""What a cluster replica holds open to NATS: one connection and one asyncio thread, whatever the number of scopes
it serves (a real replica, etcd and nats-server on free loopback ports, stopped by PID). Before the shared session
each owned scope's journal had a connection and a thread of its own: 256 scopes, 256 of each."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio

from tests.support.cluster import client, wait_for_members
from tests.support.fleet_servers import EtcdServer, NatsServer, etcd_and_nats
from tests.support.replicas import Replica, running

pytestmark = pytest.mark.slow

__all__ = ["etcd_and_nats"]  # the fixture (tests/support)

SCOPES = 24


def threads_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))


async def kvrouter_connections(nats: NatsServer) -> list[str]:
    """The names of the connections nats-server serves whose name says kvrouter."""
    async with httpx.AsyncClient(trust_env=False) as http:
        connz = (await http.get(nats.monitor_url + "/connz", params={"limit": 1024})).json()
    return [c.get("name", "") for c in connz.get("connections") or [] if c.get("name", "").startswith("kvrouter-")]


async def test_a_replica_serving_many_scopes_holds_one_nats_connection_and_a_bounded_thread_count(
    tmp_path: Path, etcd_and_nats: tuple[EtcdServer, NatsServer]
) -> None:
    etcd, nats = etcd_and_nats
    async with running([Replica(tmp_path, "a", etcd.url, nats.url)]) as [replica], client(replica) as http:
        await wait_for_members(http, 1)
        for n in range(SCOPES):  # each model is a scope of its own, which the only member claims and serves
            register = {"model_name": f"m{n}", "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}
            assert (await http.post("/register", json=register)).status_code == 201
            add = {"model_name": f"m{n}", "request_id": "r", "worker_id": 1, "dp_rank": 0, "sequence_hashes": [n],
                   "new_isl_tokens": 8}  # fmt: skip
            assert (await http.post("/add", json=add)).status_code == 201
        served = [row for row in (await http.get("/cluster")).json()["scopes"] if row["served_here"]]
        assert len(served) == SCOPES
        assert await kvrouter_connections(nats) == [f"kvrouter-replica {replica.url}"]

        assert replica.process is not None
        # trio's worker threads (the journals were opened in them) leave after 10 s idle; the scopes' journals
        # themselves hold no thread of their own.
        with trio.fail_after(30):
            while True:
                threads = threads_of(replica.process.pid)
                if threads < SCOPES // 2:
                    break
                await trio.sleep(0.5)
        rows = (await http.get("/loads", params={"model_name": f"m{SCOPES - 1}"})).json()
        assert [row["active_prefill_tokens"] for row in rows] == [8]  # and the scopes still serve
