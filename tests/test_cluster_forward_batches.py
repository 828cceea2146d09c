"""Forwarded writes travel in batches (``actors/cluster/forward_batches.py``).

On real processes (etcd, a nats-server with JetStream, two slot-tracker replicas with ``--cluster``, on free
loopback ports, stopped by PID): a ``/batch`` sent to the replica that does not own its scope reaches the owner as
one request and is answered command by command exactly as the owner answers the same batch; concurrent single
writes through it share requests; a ``/batch`` that arrives forwarded at a replica that does not serve its scope is
refused, not forwarded again. Without servers: the per-owner queue's bound and its overflow policy, and a waiting
caller that gives up takes its writes out of the queue.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio
import trio.testing

from kvrouter.actors.cluster.forward_batches import ForwardBatches, command
from kvrouter.actors.cluster.forwarder import OwnerUnreachable, Relayed
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.ownership.fencing import scope_token
from kvrouter.actors.core.ownership.forwarding import FORWARDED_HEADER
from kvrouter.actors.core.ownership.placement import preferred_owner
from tests.support.cluster import client, figures, model_owned_by, wait_for_members
from tests.support.fleet_servers import etcd_and_nats, servers
from tests.support.replicas import AUTH, Replica, pair

__all__ = ["etcd_and_nats", "pair", "servers"]  # fixtures (tests/support)


def lifecycle(model: str) -> list[dict[str, Any]]:
    """A batch whose answers differ command by command: created, done, conflict, not found (a request, a rank), a
    bad body (refused where it arrives, never forwarded)."""
    add = {"model_name": model, "request_id": "r1", "worker_id": 1, "dp_rank": 0, "sequence_hashes": [1, 2]}
    return [
        {"method": "POST", "path": "/register",
         "body": {"model_name": model, "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}},
        {"method": "POST", "path": "/add", "body": add},
        {"method": "POST", "path": "/add", "body": add},
        {"method": "POST", "path": "/prefill_complete", "body": {"model_name": model, "request_id": "ghost"}},
        {"method": "POST", "path": "/prefill_complete", "body": {"model_name": model, "request_id": "r1"}},
        {"method": "POST", "path": "/add", "body": {**add, "request_id": "r2", "dp_rank": 7}},
        {"method": "POST", "path": "/free", "body": {"model_name": model, "request_id": "r1"}},
        {"method": "POST", "path": "/add", "body": {**add, "request_id": "r3"}},
        {"method": "POST", "path": "/add", "body": {**add, "request_id": "r4", "worker_id": "one"}},
    ]  # fmt: skip


def placed_on(owner: str, members: list[str], prefix: str) -> str:
    """A model name (``prefix-N``) whose scope placement gives to ``owner`` among ``members``."""
    return next(
        f"{prefix}-{n}"
        for n in range(1000)
        if preferred_owner(scope_token(ScopeKey(f"{prefix}-{n}", "default")), sorted(members)) == owner
    )


def without_model(answers: list[dict[str, Any]], model: str) -> str:
    """The answers with the model's name and each success's ``kvrouter-written`` token (its scope and sequence)
    left out, once checked present."""
    plain = []
    for answer in answers:
        headers = dict(answer.get("headers", {}))
        assert ("kvrouter-written" in headers) == (answer["status"] in (200, 201)), answer
        headers.pop("kvrouter-written", None)
        plain.append({**answer, "headers": headers})
    return str(plain).replace(model, "M")


@pytest.mark.slow
async def test_a_batch_through_a_non_owner_is_one_request_answered_as_the_owner_answers(pair: list[Replica]) -> None:
    a, b = pair
    urls = [a.url, b.url]
    forwarded_model = placed_on(a.url, urls, "through")
    direct_model = placed_on(a.url, urls, "direct")
    async with client(a) as to_a, client(b) as to_b:
        await wait_for_members(to_b, 2)
        direct = (await to_a.post("/batch", json=lifecycle(direct_model))).json()
        before = await figures(to_b)
        through = (await to_b.post("/batch", json=lifecycle(forwarded_model))).json()
        after = await figures(to_b)
        owner = (await to_a.get("/cluster")).json()
    assert [answer["status"] for answer in through] == [201, 201, 409, 404, 200, 404, 200, 201, 422], through
    assert without_model(through, forwarded_model) == without_model(direct, direct_model)
    assert after["kvrouter_cluster_forward_batches_total"] - before["kvrouter_cluster_forward_batches_total"] == 1
    assert (
        after["kvrouter_cluster_forward_batched_writes_total"] - before["kvrouter_cluster_forward_batched_writes_total"]
        == len(through) - 1
    )  # all but the bad body, refused on B
    served = {row["model_name"]: row["served_here"] for row in owner["scopes"]}
    assert served[forwarded_model] and served[direct_model]  # both applied on the owner, A


@pytest.mark.slow
async def test_concurrent_single_writes_through_a_non_owner_share_requests(pair: list[Replica]) -> None:
    a, b = pair
    model = model_owned_by(a.url, [a.url, b.url])
    writes = 300
    statuses: list[int] = []
    limits = httpx.Limits(max_connections=64)
    async with (
        client(b) as to_b,
        httpx.AsyncClient(base_url=b.url, timeout=30, trust_env=False, headers=AUTH, limits=limits) as many,
    ):
        await wait_for_members(to_b, 2)
        register = {"model_name": model, "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}
        assert (await to_b.post("/register", json=register)).status_code == 201
        before = await figures(to_b)

        async def add(n: int) -> None:
            body = {"model_name": model, "request_id": f"r{n}", "worker_id": 1, "dp_rank": 0,
                    "sequence_hashes": [n], "new_isl_tokens": 1}  # fmt: skip
            statuses.append((await many.post("/add", json=body)).status_code)

        async with trio.open_nursery() as nursery:
            for n in range(writes):
                nursery.start_soon(add, n)
        after = await figures(to_b)
        loads = (await to_b.get("/loads", params={"model_name": model})).json()
    assert statuses == [201] * writes
    batches = after["kvrouter_cluster_forward_batches_total"] - before["kvrouter_cluster_forward_batches_total"]
    carried = (
        after["kvrouter_cluster_forward_batched_writes_total"] - before["kvrouter_cluster_forward_batched_writes_total"]
    )
    assert carried == writes
    assert batches < writes, batches  # 64 clients at once: writes waiting for a slot left together
    assert after["kvrouter_cluster_forward_queued_writes"] == 0
    assert [row["active_prefill_tokens"] for row in loads] == [writes]


@pytest.mark.slow
async def test_a_forwarded_batch_is_never_forwarded_again(pair: list[Replica]) -> None:
    a, b = pair
    model = model_owned_by(a.url, [a.url, b.url])
    register = {"model_name": model, "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}
    async with client(b) as to_b:
        await wait_for_members(to_b, 2)
        batch = [{"method": "POST", "path": "/register", "body": register}]
        # as if another replica had sent it on to B, which does not own the scope: refused, not applied
        answers = (await to_b.post("/batch", json=batch, headers={FORWARDED_HEADER: a.url})).json()
        assert answers[0]["status"] == 503, answers
        assert "moved while the command was forwarded" in answers[0]["body"]["error"]
        assert (await to_b.get("/workers", params={"model_name": model})).json() == []
        answers = (await to_b.post("/batch", json=batch)).json()  # sent by a client: forwarded to A
        assert answers[0]["status"] == 201, answers


class Owner:
    """A relay held until released: the batches posted to it, and how many are in flight."""

    def __init__(self) -> None:
        self.posted: list[bytes] = []
        self.release = trio.Event()

    async def relay(self, owner: str, method: str, path: str, query: bytes, body: bytes) -> Relayed:
        self.posted.append(body)
        await self.release.wait()
        count = body.count(b'"method"')
        return Relayed(200, b"[" + b",".join([b'{"status":201,"body":{"status":"ok"}}'] * count) + b"]", None)


async def test_a_full_queue_refuses_new_writes_and_a_caller_that_gives_up_leaves_it() -> None:
    owner = Owner()
    batches = ForwardBatches(owner.relay, max_commands=2, max_in_flight=1, max_queued_commands=3)
    one = command("POST", "/free", b'{"model_name":"m","request_id":"r"}')
    results: dict[str, list[Any]] = {}
    third = trio.CancelScope()

    async def send(name: str, count: int, scope: trio.CancelScope | None = None) -> None:
        with scope or trio.CancelScope():
            results[name] = await batches.send("http://owner", [one] * count)

    async with trio.open_nursery() as nursery:
        await nursery.start(batches.run)
        nursery.start_soon(send, "first", 2)
        await trio.testing.wait_all_tasks_blocked()
        assert len(owner.posted) == 1 and batches.queued() == 0  # in flight: the only slot is taken
        nursery.start_soon(send, "second", 2)
        nursery.start_soon(send, "third", 1, third)
        await trio.testing.wait_all_tasks_blocked()
        assert batches.queued() == 3  # the bound
        await send("refused", 1)  # refused at once, not applied; nothing queued is dropped
        assert batches.queued() == 3
        third.cancel()  # gives up while its write still waits: it leaves the queue, never sent
        await trio.testing.wait_all_tasks_blocked()
        assert batches.queued() == 2
        owner.release.set()
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    [refused] = results["refused"]
    assert isinstance(refused, OwnerUnreachable) and not refused.unknown and "queue full" in str(refused)
    assert "third" not in results
    assert [r.status for r in results["first"] + results["second"]] == [201] * 4
    assert [body.count(b'"method"') for body in owner.posted] == [2, 2]
    assert batches.figures.refused == 1 and batches.figures.commands == 4
