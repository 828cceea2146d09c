"""The nemesis: one fault at a time on a random target (a replica or a NATS node), recorded in the history as a
``nemesis`` ``info`` line when it starts and another when it ends. Faults: ``kill`` (SIGKILL, started again after
a while, same data directory and port) and ``pause`` (SIGSTOP, SIGCONT after a while). etcd is left alone. A NATS
node is faulted only while the other two run (the stream keeps its majority)."""

from __future__ import annotations

import random
import signal
from collections.abc import Callable

import attrs
import httpx
import trio

from kvrouter.simulations.ownership.history import History
from kvrouter.simulations.process_faults.clients import Clock
from kvrouter.simulations.process_faults.replicas import Replica
from kvrouter.simulations.process_faults.servers import NatsNode


@attrs.frozen
class NemesisOptions:
    gap_seconds: tuple[float, float] = (0.5, 2.5)  # between the end of one fault and the next
    fault_seconds: tuple[float, float] = (1.0, 4.0)  # how long a target stays dead or paused


@attrs.define
class Target:
    name: str
    kill: Callable[[], None]
    restart: Callable[[], None]
    pause: Callable[[], None]
    resume: Callable[[], None]


def replica_target(replica: Replica) -> Target:
    return Target(
        replica.name,
        replica.kill9,
        replica.relaunch,
        lambda: replica.signal(signal.SIGSTOP),
        lambda: replica.signal(signal.SIGCONT),
    )


def nats_target(node: NatsNode, nats: str) -> Target:
    def signal_node(signum: int) -> None:
        if node.process is not None and node.process.poll() is None:
            node.process.send_signal(signum)

    def kill() -> None:
        if node.process is not None and node.process.poll() is None:
            node.process.kill()
            node.process.wait()

    return Target(
        f"nats-{node.name}",
        kill,
        lambda: node.start(nats),
        lambda: signal_node(signal.SIGSTOP),
        lambda: signal_node(signal.SIGCONT),
    )


class Nemesis:
    def __init__(self, history: History, clock: Clock, seed: int, targets: list[Target]) -> None:
        self.history = history
        self.clock = clock
        self.rng = random.Random(f"{seed}:nemesis")
        self.targets = targets
        self.options = NemesisOptions()
        self.counts: dict[str, int] = {"kill": 0, "pause": 0}
        self.last_fault_ended = 0.0  # trio time

    async def run(self, until: float) -> None:
        while True:
            await trio.sleep(self.rng.uniform(*self.options.gap_seconds))
            if trio.current_time() >= until:
                return
            await self.one_fault()

    async def one_fault(self) -> None:
        target = self.rng.choice(self.targets)
        kind = self.rng.choice(("kill", "pause"))
        lasting = self.rng.uniform(*self.options.fault_seconds)
        self.counts[kind] += 1
        self.note(kind, target.name, "start")
        (target.kill if kind == "kill" else target.pause)()
        try:
            await trio.sleep(lasting)
        finally:
            (target.restart if kind == "kill" else target.resume)()
            self.note(kind, target.name, "end")
            self.last_fault_ended = trio.current_time()

    def note(self, kind: str, target: str, phase: str) -> None:
        self.history.add(
            {"t": self.clock.now(), "process": "nemesis", "type": "info", "f": kind, "value": target, "phase": phase}
        )


async def wait_all_healthy(http: httpx.AsyncClient, replicas: list[Replica]) -> None:
    async with trio.open_nursery() as nursery:
        for replica in replicas:
            nursery.start_soon(replica.wait_healthy, http)
