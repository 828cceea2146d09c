"""Follower reads on real processes (etcd, a nats-server with JetStream, three slot-tracker replicas with
``--cluster``, all on free loopback ports and stopped by PID):

* a write acknowledged through its owner A carries ``kvrouter-written``; a read through B presenting it
  (``read_after``) sees the write, answered from B's copy of the scope (B's ``/cluster`` lists the copy with the
  sequence it folded and its lag, B's ``/metrics`` counts the read);
* with the owner paused (SIGSTOP), B still answers the scope's reads from its copy, which follows the subject on
  JetStream, not the owner;
* ``ReplicaClient`` sends its writes' tokens with its reads by itself;
* a malformed ``read_after`` is refused with 400 ``{"error"}``.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import httpx
import pytest
import trio

from kvrouter.client import ReplicaClient
from tests.support.cluster import client, model_owned_by, wait_for_members
from tests.support.fleet_servers import etcd_and_nats, servers
from tests.support.replicas import TOKEN, Replica, replicas

pytestmark = pytest.mark.slow

__all__ = ["etcd_and_nats", "replicas", "servers"]  # fixtures (tests/support)


async def add(http: httpx.AsyncClient, model: str, request_id: str, tokens: int) -> str:
    body = {"model_name": model, "request_id": request_id, "worker_id": 1, "dp_rank": 1,
            "sequence_hashes": [1, 2], "new_isl_tokens": tokens}  # fmt: skip
    response = await http.post("/add", json=body)
    assert response.status_code == 201, response.text
    return response.headers["kvrouter-written"]


async def prefill(http: httpx.AsyncClient, model: str, written: str | None = None) -> int:
    params = {"model_name": model, "tenant_id": "default"}
    if written is not None:
        params["read_after"] = written
    response = await http.get("/loads", params=params)
    assert response.status_code == 200, response.text
    return sum(row["active_prefill_tokens"] for row in response.json())


async def follower_reads(http: httpx.AsyncClient) -> float:
    samples = dict(line.rsplit(" ", 1) for line in (await http.get("/metrics")).text.splitlines() if line[:1] != "#")
    return float(samples.get("kvrouter_cluster_follower_reads_total", 0))


async def test_a_read_through_a_follower_sees_the_callers_write_and_survives_a_paused_owner(
    replicas: list[Replica],
) -> None:
    a, b, _ = replicas
    model = model_owned_by(a.url, [r.url for r in replicas])
    async with client(a) as through_a, client(b) as through_b:
        await wait_for_members(through_a, 3)
        register = {"model_name": model, "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 2}
        assert (await through_a.post("/register", json=register)).status_code == 201
        await add(through_a, model, "r0", 10)
        assert await prefill(through_b, model) == 10  # the first read starts B's copy (gathered or from it)

        total = 10
        for n in range(1, 6):  # each write through the owner, read at once through B with its token
            written = await add(through_a, model, f"r{n}", 10)
            total += 10
            assert await prefill(through_b, model, written) == total
        assert await follower_reads(through_b) >= 5
        command = {"model_name": model, "request_id": "batched", "worker_id": 1, "dp_rank": 1,
                   "sequence_hashes": [3], "new_isl_tokens": 10}  # fmt: skip
        answers = (await through_b.post("/batch", json=[{"method": "POST", "path": "/add", "body": command}])).json()
        assert answers[0]["status"] == 201, answers  # forwarded to A, its token carried back with the result
        written = answers[0]["headers"]["kvrouter-written"]
        total += 10
        assert await prefill(through_b, model, written) == total

        view: dict[str, Any] = (await through_b.get("/cluster")).json()
        copies = [row for row in view["followers"] if row["model_name"] == model]
        assert len(copies) == 1, view["followers"]
        assert copies[0]["sequence"] >= int(written.rsplit(":", 1)[1])
        assert copies[0]["lag_seconds"] is not None and copies[0]["lag_seconds"] < 2.0, copies
        metrics = (await through_b.get("/metrics")).text
        assert 'kvrouter_cluster_follower_lag_seconds{model_name="' + model in metrics

        bad = await through_b.get("/loads", params={"model_name": model, "read_after": "not-a-token"})
        assert bad.status_code == 400 and "read_after" in bad.json()["error"], bad.text

        assert a.process is not None
        os.kill(a.process.pid, signal.SIGSTOP)  # the owner answers nothing; its lease runs for 2 s more
        try:
            with trio.fail_after(1.5):  # well within the lease: no other replica has taken the scope over
                assert await prefill(through_b, model) == total  # from the copy, not from the owner
        finally:
            os.kill(a.process.pid, signal.SIGCONT)


async def test_the_replica_client_sends_its_writes_tokens_with_its_reads(replicas: list[Replica]) -> None:
    a, b, c = replicas
    model = model_owned_by(a.url, [r.url for r in replicas])
    async with client(b) as through_b:
        await wait_for_members(through_b, 3)
    async with ReplicaClient.connect([b.url], token=TOKEN) as writer:  # every write forwarded to the owner A
        assert await writer.register(1, block_size=16, dp_size=2, model_name=model)
        async with ReplicaClient.connect([c.url], token=TOKEN) as reader:
            await reader.call("GET", f"/loads?model_name={model}")  # starts C's copy
            for n in range(5):
                assert await writer.add(f"r{n}", 1, [1], dp_rank=1, new_isl_tokens=7, model_name=model)
                seq = writer.written.sequence(model)
                assert seq is not None
                # the writer's own token, carried over to another client's read: C's copy waits for it
                reader.written.note({"kvrouter-written": f"{token_of(writer, model)}:{seq}"})
                rows = await reader.call("GET", f"/loads?model_name={model}")
                assert sum(row["active_prefill_tokens"] for row in rows.body) == 7 * (n + 1)
            reply = await writer.call("GET", f"/workers?model_name={model}")
            assert [row["worker_id"] for row in reply.body] == [1]


def token_of(client: ReplicaClient, model: str) -> str:
    """The scope token the client keeps for ``model`` (default tenant)."""
    path = client.written.read_path("GET", f"/loads?model_name={model}")
    return path.split("read_after=", 1)[1].split(",")[0].rsplit(":", 1)[0]
