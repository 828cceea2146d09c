"""Clients of a real cluster: each registers workers and books, completes and frees requests, one operation at a
time, each attempt through a random replica, recording a history in the simulation's vocabulary
(``simulations/ownership/history``): ``invoke``, then ``ok``, ``fail`` (not applied: 503, refused, no connection)
or ``info`` (unknown: 504, or no answer in time).

A 503 or a refused connection was not applied: retried through another replica. An unknown outcome may have been
applied: retried with the same request id, so "already exists" then means the first attempt landed.
"""

from __future__ import annotations

import random
import time
from typing import Any

import attrs
import httpx
import trio

from kvrouter.simulations.ownership.history import History

BLOCK_SIZE = 16
DP_SIZE = 2


@attrs.frozen
class ClientOptions:
    call_timeout_seconds: float = 5.0
    max_attempts: int = 8
    workers_per_scope: int = 3
    think_seconds: tuple[float, float] = (0.005, 0.05)


@attrs.frozen
class Op:
    f: str  # register, book, complete, free
    scope: str  # the model name (tenant: default)
    path: str
    body: dict[str, Any]
    value: str | int  # the request id, or the worker id


class Clock:
    """Nanoseconds since the run began: the history's ``t``."""

    def __init__(self) -> None:
        self.start = time.monotonic_ns()

    def now(self) -> int:
        return time.monotonic_ns() - self.start


class Client:
    def __init__(
        self, name: str, history: History, clock: Clock, seed: int, replicas: list[str], scopes: list[str]
    ) -> None:
        self.name = name
        self.history = history
        self.clock = clock
        self.rng = random.Random(f"{seed}:{name}")
        self.replicas = replicas
        self.scopes = scopes
        self.options = ClientOptions()
        self.workers: dict[str, list[int]] = {s: [] for s in scopes}
        self.live: dict[str, list[str]] = {s: [] for s in scopes}
        self.call = 0
        self.booked = 0

    async def run(self, http: httpx.AsyncClient, until: float) -> None:
        while trio.current_time() < until:
            await self.perform(http, self.choose())
            await trio.sleep(self.rng.uniform(*self.options.think_seconds))

    def choose(self) -> Op:
        rng = self.rng
        scope = rng.choice(self.scopes)
        known, live = self.workers[scope], self.live[scope]
        roll = rng.random()
        if not known or roll < 0.05:
            worker = rng.randint(1, self.options.workers_per_scope)
            body = {"model_name": scope, "worker_id": worker, "block_size": BLOCK_SIZE, "dp_start": 0}
            return Op("register", scope, "/register", {**body, "dp_size": DP_SIZE}, worker)
        if live and roll < 0.30:
            request_id = rng.choice(live)
            return Op(
                "complete", scope, "/prefill_complete", {"model_name": scope, "request_id": request_id}, request_id
            )
        if live and roll < 0.55:
            request_id = live[0]
            return Op("free", scope, "/free", {"model_name": scope, "request_id": request_id}, request_id)
        self.booked += 1
        request_id = f"{self.name}-{self.booked}"
        hashes = [rng.randint(1, 12) for _ in range(rng.randint(1, 4))]
        body = {"model_name": scope, "request_id": request_id, "worker_id": rng.choice(known)}
        body |= {
            "dp_rank": rng.randrange(DP_SIZE),
            "sequence_hashes": hashes,
            "new_isl_tokens": BLOCK_SIZE * len(hashes),
        }
        return Op("book", scope, "/add", body, request_id)

    async def perform(self, http: httpx.AsyncClient, op: Op) -> None:
        outcome, detail = "fail", ""
        for _ in range(self.options.max_attempts):
            outcome, detail = await self.attempt(http, op)
            if outcome == "ok" or (outcome == "fail" and detail not in ("unavailable", "no connection")):
                break
            await trio.sleep(self.rng.uniform(0.02, 0.3))
        self.settle(op, outcome, detail)

    async def attempt(self, http: httpx.AsyncClient, op: Op) -> tuple[str, str]:
        self.call += 1
        replica = self.rng.choice(self.replicas)
        extra = {"worker": op.body["worker_id"], "dp_rank": op.body["dp_rank"]} if op.f == "book" else {}
        self.history.add(
            {"t": self.clock.now(), "process": self.name, "type": "invoke", "f": op.f, "scope": op.scope,
             "value": op.value, "replica": replica, "call": self.call, **extra}
        )  # fmt: skip
        outcome, detail = await self.send(http, replica, op)
        self.history.add(
            {"t": self.clock.now(), "process": self.name, "type": outcome, "f": op.f, "scope": op.scope,
             "value": op.value, "call": self.call, "detail": detail}
        )  # fmt: skip
        return outcome, detail

    async def send(self, http: httpx.AsyncClient, replica: str, op: Op) -> tuple[str, str]:
        try:
            answer = await http.post(replica + op.path, json=op.body, timeout=self.options.call_timeout_seconds)
        except httpx.ConnectError:
            return "fail", "no connection"
        except httpx.TransportError as exc:  # sent, no answer in time (or the connection dropped): unknown
            return "info", type(exc).__name__
        if answer.status_code < 300:
            return "ok", str(answer.status_code)
        if answer.status_code == 503:
            return "fail", "unavailable"
        if answer.status_code == 504:
            return "info", "504"
        text = answer.text
        conflict = answer.status_code == 409 and "already" in text  # exists (a request), registered (a worker)
        return "fail", "conflict" if conflict else f"{answer.status_code} {text[:120]}"

    def settle(self, op: Op, outcome: str, detail: str) -> None:
        """What the client believes after the operation's last attempt."""
        if op.f == "register" and (outcome == "ok" or detail == "conflict") and op.value not in self.workers[op.scope]:
            self.workers[op.scope].append(int(op.value))
        elif op.f == "book" and (outcome in ("ok", "info") or detail == "conflict"):
            self.live[op.scope].append(str(op.value))  # maybe booked: freed later all the same
        elif op.f == "free" and op.value in self.live[op.scope] and (outcome == "ok" or "404" in detail):
            self.live[op.scope].remove(str(op.value))
