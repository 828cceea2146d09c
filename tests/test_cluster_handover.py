"""A replica stopped with SIGTERM hands its scopes over before it stops listening (real etcd, a real nats-server
with JetStream, three ``--cluster`` replicas, all on free loopback ports and stopped by PID): while clients write
through all three replicas, every answer is a success (no 503), and every acknowledged booking is in ``/loads``
afterwards. A client whose replica has stopped listening (its connection refused or cut) sends the same request,
same request id, to another replica: a booking that had landed is then answered 200 ("already there")."""

from __future__ import annotations

import re
import signal

import httpx
import pytest
import trio

from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.ownership.fencing import scope_token
from kvrouter.actors.core.ownership.placement import preferred_owner
from tests.support.cluster import wait_for_members
from tests.support.fleet_servers import etcd_and_nats, servers
from tests.support.replicas import AUTH, Replica, replicas

pytestmark = pytest.mark.slow

__all__ = ["etcd_and_nats", "replicas", "servers"]  # fixtures (tests/support)


class Clients:
    """Clients booking requests on every model until ``done``, one per replica; an answer must be 2xx."""

    def __init__(self, models: list[str], replicas: list[Replica]) -> None:
        self.models = models
        self.replicas = replicas
        self.acknowledged = dict.fromkeys(models, 0)
        self.answers: list[tuple[int, str]] = []  # every answer that was not 2xx
        self.moved = 0  # requests sent again elsewhere because their replica stopped listening
        self.done = trio.Event()

    async def through(self, first: int, name: str) -> None:
        at = first
        async with httpx.AsyncClient(timeout=15, trust_env=False, headers=AUTH) as http:
            n = 0
            while not self.done.is_set():
                for model in self.models:
                    at = await self.add(http, at, model, f"{name}-{n}")
                n += 1

    async def add(self, http: httpx.AsyncClient, at: int, model: str, request_id: str) -> int:
        body = {"model_name": model, "request_id": request_id, "worker_id": 1, "dp_rank": 0,
                "sequence_hashes": [3], "new_isl_tokens": 10}  # fmt: skip
        with trio.fail_after(15):  # never a hang
            while True:
                try:
                    response = await http.post(self.replicas[at].url + "/add", json=body)
                    break
                except httpx.TransportError:  # that replica stopped listening: the same request elsewhere
                    self.moved += 1
                    at = (at + 1) % len(self.replicas)
        if response.status_code in (200, 201):
            self.acknowledged[model] += 1
        else:
            self.answers.append((response.status_code, response.text))
        return at


async def test_a_replica_stopped_with_sigterm_hands_its_scopes_over_with_no_error_to_clients(
    replicas: list[Replica],
) -> None:
    a, b, c = replicas
    three = sorted(replica.url for replica in replicas)
    tokens = {f"m{n}": scope_token(ScopeKey(f"m{n}", "default")) for n in range(200)}
    leaving = [model for model, token in tokens.items() if preferred_owner(token, three) == c.url][:3]
    staying = [model for model, token in tokens.items() if preferred_owner(token, three) != c.url][:3]
    models = leaving + staying
    clients = Clients(models, replicas)
    async with httpx.AsyncClient(base_url=a.url, timeout=15, trust_env=False, headers=AUTH) as on_a:
        await wait_for_members(on_a, 3)
        for model in models:
            register = {"model_name": model, "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}
            assert (await on_a.post("/register", json=register)).status_code == 201
        owners = {row["model_name"]: row["owner"] for row in (await on_a.get("/cluster")).json()["scopes"]}
        assert all(owners[model] == c.url for model in leaving), owners
        assert c.process is not None
        async with trio.open_nursery() as nursery:
            for index, name in enumerate("abc"):
                nursery.start_soon(clients.through, index, name)
            await trio.sleep(1.0)
            before = dict(clients.acknowledged)
            c.process.send_signal(signal.SIGTERM)
            with trio.fail_after(30):
                assert await c.process.wait() == 0
            await trio.sleep(1.0)  # writes go on through A and B, to the scopes' new owners
            clients.done.set()
        view = (await on_a.get("/cluster")).json()
    assert clients.answers == []  # no 503, nor any other refusal
    assert all(clients.acknowledged[model] > before[model] for model in models), (before, clients.acknowledged)
    assert view["members"] == sorted([a.url, b.url])
    new_owners = {row["model_name"]: row["owner"] for row in view["scopes"]}
    assert all(new_owners[model] in (a.url, b.url) for model in leaving), new_owners
    assert all(new_owners[model] == owners[model] for model in staying), new_owners
    for replica in (a, b):
        async with httpx.AsyncClient(base_url=replica.url, timeout=15, trust_env=False, headers=AUTH) as http:
            for model in models:
                rows = (await http.get("/loads", params={"model_name": model})).json()
                assert [row["active_prefill_tokens"] for row in rows] == [10 * clients.acknowledged[model]], model
    log = c.log.read_text()
    assert log.count("handed over (claim released)") == len(leaving), log
    took = re.search(r"scopes handed over in ([0-9.]+) s", log)
    assert took is not None, log
    print(f"handed over in {took[1]} s; acknowledged {sum(clients.acknowledged.values())}; moved {clients.moved}")
