"""The client library given a cluster's replicas (``ReplicaClient``, and ``BlockingClient`` with a list of URLs), on
three slot-tracker replicas over a real etcd and a real nats-server, all on free loopback ports and stopped by PID:

* a URL where nothing listens is skipped when connecting;
* the replica the client's stream is on, which also owns the scope, is killed with kill -9: reads go on at once
  through the next replica (sent again on a 503 while the scope has no owner), and writes go on once a survivor
  serves the scope (each refused "not applied" is sent again), every acknowledged booking in ``/loads``;
* a write in flight when its replica dies raises ``OutcomeUnknown`` and is not sent again by the client; sent again
  by the caller with the same request id, it is applied once.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import trio

from kvrouter.client import BlockingClient, CommandError, NoReplica, OutcomeUnknown, ReplicaClient
from kvrouter.client.operations import Op, Reply
from kvrouter.client.replicas import not_applied, replica_urls, send_again
from kvrouter.client.table import BY_NAME
from tests.support.cluster import model_owned_by
from tests.support.fleet_servers import etcd_and_nats, servers
from tests.support.processes import free_port
from tests.support.replicas import TOKEN, Replica, replicas

__all__ = ["etcd_and_nats", "replicas", "servers"]  # fixtures (tests/support)

ADDED_TOKENS = 10


def nowhere() -> str:
    """A loopback URL where nothing listens."""
    return f"http://127.0.0.1:{free_port()}"


async def add(client: ReplicaClient, model: str, request_id: str) -> bool:
    created = await client.add(request_id, 1, [1, 2, 3], dp_rank=1, new_isl_tokens=ADDED_TOKENS, model_name=model)
    return bool(created)


async def add_once(client: ReplicaClient, model: str, request_id: str) -> bool:
    """``add`` until its outcome is known: an unknown outcome (the stream closed, or 504) is sent again with the same
    request id, and 409 "already exists" then means the first attempt landed."""
    while True:
        try:
            return await add(client, model, request_id)
        except OutcomeUnknown:
            continue
        except CommandError as refused:
            if refused.status == 504:
                continue
            if refused.status == 409 and "already" in refused.message:
                return True
            raise


async def prefill_on_rank_1(client: ReplicaClient, model: str) -> int:
    reply = await client.call("GET", f"/loads?model_name={model}")
    assert reply.status == 200, reply
    return sum(row["active_prefill_tokens"] for row in reply.body if row["dp_rank"] == 1)


async def test_the_client_goes_on_through_the_next_replica_when_its_replica_is_killed(
    replicas: list[Replica],
) -> None:
    a, b, c = replicas
    urls = [a.url, b.url, c.url]
    model = model_owned_by(a.url, urls)
    async with ReplicaClient.connect([nowhere(), *urls], token=TOKEN) as client:
        assert client.url == a.url  # the URL where nothing listens was skipped
        await wait_for_members_of(client, 3)
        assert await client.register(1, block_size=16, dp_size=2, model_name=model)
        acknowledged = [f"r{n}" for n in range(5) if await add_once(client, model, f"r{n}")]
        assert len(acknowledged) == 5

        await a.kill9()  # the client's replica and the scope's owner
        killed = trio.current_time()
        assert await prefill_on_rank_1(client, model) == ADDED_TOKENS * 5  # a 503 (no owner yet) is read again
        assert client.url in (b.url, c.url)
        for n in range(5, 10):
            assert await add_once(client, model, f"r{n}")  # refused "not applied" until a survivor serves it
            acknowledged.append(f"r{n}")
        took = trio.current_time() - killed
        assert took < 10, took
        assert await prefill_on_rank_1(client, model) == ADDED_TOKENS * len(acknowledged)
        assert client.connects >= 2 and client.sent_again >= 1  # each refusal "not applied": the next replica

    def through_threads() -> Any:
        with BlockingClient(f"{nowhere()},{c.url}", token=TOKEN) as blocking:
            return blocking.call("GET", f"/loads?model_name={model}").body

    rows = await trio.to_thread.run_sync(through_threads)
    assert sum(row["active_prefill_tokens"] for row in rows) == ADDED_TOKENS * len(acknowledged)


async def wait_for_members_of(client: ReplicaClient, count: int) -> None:
    with trio.fail_after(10):
        while True:
            if len((await client.call("GET", "/cluster")).body["members"]) == count:
                return
            await trio.sleep(0.05)


async def test_a_write_in_flight_when_its_replica_dies_is_unknown_and_not_sent_again(
    replicas: list[Replica],
) -> None:
    a, b, c = replicas
    model = model_owned_by(b.url, [a.url, b.url, c.url])
    async with ReplicaClient.connect([c.url, b.url], token=TOKEN) as client:
        await wait_for_members_of(client, 3)
        assert await client.register(1, block_size=16, dp_size=2, model_name=model)
        assert c.process is not None
        os.kill(c.process.pid, signal.SIGSTOP)  # the write waits in c's socket, unread
        outcome: list[BaseException | bool] = []

        async def write() -> None:
            try:
                outcome.append(await add(client, model, "x"))
            except OutcomeUnknown as unknown:
                outcome.append(unknown)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(write)
            await trio.sleep(0.3)
            await c.kill9()
        assert len(outcome) == 1 and isinstance(outcome[0], OutcomeUnknown), outcome
        assert client.sent_again == 0
        assert await add_once(client, model, "x")  # the caller's retry, same request id
        assert client.url == b.url
        assert await prefill_on_rank_1(client, model) == ADDED_TOKENS  # applied once


async def test_connecting_to_replicas_where_nothing_listens_names_each() -> None:
    dead = [nowhere(), nowhere()]
    with pytest.raises(NoReplica) as refused:
        async with ReplicaClient.connect(dead, connect_timeout=2):
            pass
    assert all(url in str(refused.value) for url in dead), refused.value


def test_replica_urls_are_checked_before_connecting() -> None:
    assert replica_urls(" http://a:1, http://b:2 ") == ("http://a:1", "http://b:2")
    assert replica_urls(["http://a:1"]) == ("http://a:1",)
    with pytest.raises(ValueError, match="at least one"):
        replica_urls(" , ")
    with pytest.raises(ValueError, match="https"):
        replica_urls(["http://a:1", "https://b:2"])


def test_only_a_refusal_saying_not_applied_or_a_reads_503_is_sent_again() -> None:
    add, loads = BY_NAME["add"], BY_NAME["loads"]

    def reply(status: int, message: str) -> Reply:
        return Reply(status, {"error": message})

    refused = reply(503, "scope llama has no owner now; not applied, safe to retry")
    assert not_applied(refused)
    assert not not_applied(reply(504, "the owner of llama: it left; the outcome is unknown"))
    assert not not_applied(reply(504, "no durable decision within the reply deadline"))
    assert not not_applied(reply(409, "request already exists (not applied)"))
    write, read = Op(add.method, add.path, {}, str), Op(loads.method, loads.path, {}, str)
    assert send_again(write, refused) and send_again(read, refused)
    assert send_again(read, reply(503, "no live replica owns 1 scope(s) right now; retry shortly"))
    assert not send_again(write, reply(503, "the journal failed; it may or may not have landed"))
