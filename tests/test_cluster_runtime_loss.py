"""Two slot-tracker replicas (``--cluster``), each owning a scope, on a real etcd and a real nats-server, all on
free loopback ports and stopped by PID. etcd or NATS lost *after* start-up: every write through either replica is
acknowledged (201) or refused with 503 and an ``{"error"}`` naming what is missing (etcd, or NATS/JetStream) —
never a 500, never a hang past a bounded time; once the server is back, writes are acknowledged again without
restarting the replicas, and every acknowledged booking is in the loads."""

from __future__ import annotations

import os
import signal
from collections.abc import Awaitable, Callable

import httpx
import pytest
import trio

from tests.support.cluster import model_owned_by, scope_row, wait_for_members
from tests.support.fleet_servers import EtcdServer, NatsServer, etcd_and_nats, servers
from tests.support.replicas import AUTH, Replica, pair

pytestmark = pytest.mark.slow

__all__ = ["etcd_and_nats", "pair", "servers"]  # fixtures (tests/support)

ANSWER_BOUND_SECONDS = 8  # no write waits longer than this for its answer, whatever is down
RESUME_BOUND_SECONDS = 15  # writes are acknowledged again this soon after the server is back
ISL = 10


class Writes:
    """Writes to two scopes (one owned by each replica) through both replicas; counts what was acknowledged."""

    def __init__(self, replicas: list[Replica], expected_error: tuple[str, ...]) -> None:
        self.replicas = replicas
        self.models = [model_owned_by(r.url, [r.url for r in replicas]) for r in replicas]
        self.expected_error = expected_error
        self.acknowledged = dict.fromkeys(self.models, 0)
        self.unknown = dict.fromkeys(self.models, 0)  # answered "outcome unknown": may or may not have landed
        self.refusals: list[str] = []
        self.n = 0

    async def one(self, replica: Replica, model: str) -> int:
        self.n += 1
        body = {"model_name": model, "request_id": f"w{self.n}", "worker_id": 1, "dp_rank": 0,
                "sequence_hashes": [self.n], "new_isl_tokens": ISL}  # fmt: skip
        async with httpx.AsyncClient(base_url=replica.url, timeout=30, trust_env=False, headers=AUTH) as http:
            with trio.fail_after(ANSWER_BOUND_SECONDS):
                response = await http.post("/add", json=body)
        if response.status_code == 201:
            self.acknowledged[model] += 1
        else:
            assert response.status_code in (503, 504), response.text
            error = response.json()["error"]
            self.refusals.append(error)
            if response.status_code == 504 or "unknown" in error or "may or may not" in error:
                self.unknown[model] += 1
        return response.status_code

    async def round(self) -> list[int]:
        return [await self.one(replica, model) for replica in self.replicas for model in self.models]

    async def until_all_acknowledged(self) -> float:
        started = trio.current_time()
        with trio.fail_after(RESUME_BOUND_SECONDS):
            for _ in range(1000):
                if await self.round() == [201] * 4:
                    break
                await trio.sleep(0.1)
        return trio.current_time() - started

    async def check_loads(self) -> None:
        for replica in self.replicas:
            async with httpx.AsyncClient(base_url=replica.url, timeout=15, trust_env=False, headers=AUTH) as http:
                for model in self.models:
                    loads = (await http.get("/loads", params={"model_name": model})).json()
                    [tokens] = [row["active_prefill_tokens"] for row in loads]
                    low, high = self.acknowledged[model], self.acknowledged[model] + self.unknown[model]
                    assert ISL * low <= tokens <= ISL * high, (model, tokens, low, high)

    def refusals_name(self) -> bool:
        """Whether every refusal names what is missing (or says the outcome is unknown)."""
        return all(any(word in error.lower() for word in self.expected_error) for error in self.refusals)


async def two_replicas(replicas: list[Replica], expected_error: tuple[str, ...]) -> Writes:
    """Writes through both replicas, each owning one of the two scopes, once every write is acknowledged."""
    writes = Writes(replicas, expected_error)
    async with httpx.AsyncClient(base_url=replicas[0].url, timeout=15, trust_env=False, headers=AUTH) as http:
        await wait_for_members(http, 2)
        for model in writes.models:
            register = {"model_name": model, "worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}
            assert (await http.post("/register", json=register)).status_code == 201
        for model, replica in zip(writes.models, replicas, strict=True):
            assert (await scope_row(http, model))["owner"] == replica.url
    assert await writes.round() == [201] * 4
    return writes


async def outage(writes: Writes, lose: Callable[[], Awaitable[None]], restore: Callable[[], Awaitable[None]]) -> float:
    """Lose the server, write through both replicas for a while (past the lease TTL), restore it; the time writes
    took to be acknowledged again."""
    await lose()
    lost_until = trio.current_time() + 4  # each write answered (within ANSWER_BOUND_SECONDS), none cut short
    while trio.current_time() < lost_until:
        await writes.round()
        await trio.sleep(0.1)
    await restore()
    return await writes.until_all_acknowledged()


async def test_etcd_paused_then_resumed(pair: list[Replica], etcd_and_nats: tuple[EtcdServer, NatsServer]) -> None:
    etcd, _ = etcd_and_nats
    writes = await two_replicas(pair, ("etcd",))
    assert etcd.process is not None
    pid = etcd.process.pid
    resumed = await outage(writes, partial_kill(pid, signal.SIGSTOP), partial_kill(pid, signal.SIGCONT))
    assert writes.refusals and writes.refusals_name(), writes.refusals
    assert resumed < RESUME_BOUND_SECONDS
    await writes.check_loads()


async def test_etcd_killed_then_restarted_on_its_data(
    pair: list[Replica], etcd_and_nats: tuple[EtcdServer, NatsServer]
) -> None:
    etcd, _ = etcd_and_nats
    writes = await two_replicas(pair, ("etcd",))
    await outage(writes, killed(etcd), etcd.start)
    assert writes.refusals and writes.refusals_name(), writes.refusals
    await writes.check_loads()


async def test_nats_killed_then_restarted_on_its_store(
    pair: list[Replica], etcd_and_nats: tuple[EtcdServer, NatsServer]
) -> None:
    _, nats = etcd_and_nats
    writes = await two_replicas(pair, ("nats", "jetstream", "outcome is unknown"))
    await outage(writes, killed(nats), nats.start)
    assert writes.refusals and writes.refusals_name(), writes.refusals
    await writes.check_loads()


def killed(server: EtcdServer | NatsServer) -> Callable[[], Awaitable[None]]:
    """What ``outage`` calls to lose the server: SIGKILL by its PID (its data stays for ``start``), then reaped."""

    async def kill() -> None:
        assert server.process is not None
        server.process.kill()
        await server.process.wait()

    return kill


def partial_kill(pid: int, sig: signal.Signals) -> Callable[[], Awaitable[None]]:
    async def send() -> None:
        os.kill(pid, sig)

    return send
