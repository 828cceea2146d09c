"""Clients: each registers workers and books, completes and frees requests, one operation at a time, through a
random replica each attempt.

An attempt refused with 503 was not applied, so it is retried elsewhere; one with no answer (or 504) may have
been applied, and is retried too, with the same request id: the system must then answer "already exists", never
book the id a second time. A client gives up after ``max_attempts``.
"""

from __future__ import annotations

import random
from typing import Any

import attrs

from kvrouter.actors.core.commands import AddRequest, Command, CompletePrefill, FreeRequest, RegisterWorker
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.simulations.ownership.history import History
from kvrouter.simulations.ownership.kernel import MS, Kernel
from kvrouter.simulations.ownership.messages import Answer, Call, Tick

BLOCK_SIZE = 16
DP_SIZE = 2


@attrs.frozen
class ClientOptions:
    think_ms: tuple[int, int] = (5, 150)
    call_timeout_ns: int = 1_500 * MS
    retry_ms: tuple[int, int] = (20, 300)
    max_attempts: int = 6
    workers_per_scope: int = 3


@attrs.frozen
class Op:
    f: str  # register, book, complete, free
    subject: str
    command: Command
    value: str | int  # the request id, or the worker id


class Client:
    def __init__(
        self,
        name: str,
        kernel: Kernel,
        history: History,
        seed: int,
        replicas: tuple[str, ...],
        scopes: dict[str, ScopeKey],
        options: ClientOptions,
        stop_at: int,
    ) -> None:
        self.name = name
        self.kernel = kernel
        self.history = history
        self.rng = random.Random(f"{seed}:{name}")
        self.replicas = replicas
        self.subjects = tuple(scopes)
        self.options = options
        self.stop_at = stop_at
        self.workers: dict[str, list[int]] = {s: [] for s in self.subjects}
        self.live: dict[str, list[str]] = {s: [] for s in self.subjects}
        self.op: Op | None = None
        self.attempt = 0
        self.call = 0
        self.booked = 0
        kernel.timer(name, self.rng.randint(1, 500) * MS, Tick("next"))

    def handle(self, src: str, message: Any) -> None:
        if isinstance(message, Answer):
            if self.op is not None and message.call == self.call:
                self.complete(message.outcome, message.detail)
        elif message.what == "next":
            self.start()
        elif message.what == "retry":
            self.send()
        elif message.what == "timeout" and self.op is not None and message.data == self.call:
            self.complete("unknown", "no answer in time")

    def start(self) -> None:
        if self.kernel.now >= self.stop_at:
            return
        self.op = self.choose()
        self.attempt = 0
        self.send()

    def choose(self) -> Op:
        rng = self.rng
        subject = rng.choice(self.subjects)
        known = self.workers[subject]
        live = self.live[subject]
        roll = rng.random()
        if not known or roll < 0.08:
            worker = rng.randint(1, self.options.workers_per_scope)
            return Op("register", subject, RegisterWorker(worker, BLOCK_SIZE, 0, DP_SIZE), worker)
        if live and roll < 0.30:
            request_id = rng.choice(live)
            return Op("complete", subject, CompletePrefill(request_id), request_id)
        if live and roll < 0.55:
            request_id = live[0]
            return Op("free", subject, FreeRequest(request_id), request_id)
        self.booked += 1
        request_id = f"{self.name}-{self.booked}"
        hashes = tuple(rng.randint(1, 12) for _ in range(rng.randint(1, 4)))
        command = AddRequest(request_id, rng.choice(known), rng.randrange(DP_SIZE), hashes, BLOCK_SIZE * len(hashes))
        return Op("book", subject, command, request_id)

    def send(self) -> None:
        op = self.op
        assert op is not None
        self.attempt += 1
        self.call += 1
        replica = self.rng.choice(self.replicas)
        self.history.add(
            {"t": self.kernel.now, "process": self.name, "type": "invoke", "f": op.f, "scope": op.subject,
             "value": op.value, "replica": replica, "call": self.call, **_extra(op.command)}
        )  # fmt: skip
        self.kernel.send(self.name, replica, Call(self.call, self.name, op.subject, op.command))
        self.kernel.timer(self.name, self.options.call_timeout_ns, Tick("timeout", self.call))

    def complete(self, outcome: str, detail: str) -> None:
        op = self.op
        assert op is not None
        kind = {"ok": "ok", "fail": "fail", "unavailable": "fail", "unknown": "info"}[outcome]
        self.history.add(
            {"t": self.kernel.now, "process": self.name, "type": kind, "f": op.f, "scope": op.subject,
             "value": op.value, "call": self.call, "detail": detail or outcome}
        )  # fmt: skip
        self.call += 1  # a late answer to this attempt is no longer awaited
        if outcome in ("unavailable", "unknown") and self.attempt < self.options.max_attempts:
            self.kernel.timer(self.name, self.rng.randint(*self.options.retry_ms) * MS, Tick("retry"))
            return
        self.settle(op, outcome, detail)
        self.op = None
        self.kernel.timer(self.name, self.rng.randint(*self.options.think_ms) * MS, Tick("next"))

    def settle(self, op: Op, outcome: str, detail: str) -> None:
        """What the client believes after the operation's last attempt."""
        if op.f == "register" and (outcome == "ok" or detail == "conflict"):
            if op.value not in self.workers[op.subject]:
                self.workers[op.subject].append(int(op.value))
        elif op.f == "book" and (outcome in ("ok", "unknown") or detail == "conflict"):
            self.live[op.subject].append(str(op.value))  # maybe booked: free it later all the same
        elif op.f == "free" and op.value in self.live[op.subject]:
            self.live[op.subject].remove(str(op.value))


def _extra(command: Command) -> dict[str, Any]:
    if isinstance(command, AddRequest):
        return {"worker": command.worker_id, "dp_rank": command.dp_rank, "blocks": list(command.sequence_hashes)}
    return {}
