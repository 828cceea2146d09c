"""The nemesis: one fault at a time, recorded in the history as a ``nemesis`` ``info`` line when it starts and
another when it ends. Faults on a random target (a replica, a NATS node, or etcd when it is among the targets):
``kill`` (SIGKILL, started again after a while, same data directory and port) and ``pause`` (SIGSTOP, SIGCONT after
a while). With a network of namespaces, also ``partition``: the hosts (replicas, NATS nodes, etcd) split at random
into two sides, every path between the sides cut, and healed after a while (the clients' paths are never cut).
One fault at a time, so a NATS node is killed or paused only while the other two run (the stream keeps its
majority), and a partition leaves two of the three NATS nodes on one side."""

from __future__ import annotations

import random
import signal
from collections.abc import Callable

import attrs
import httpx
import trio

from kvrouter.simulations.ownership.history import History
from kvrouter.simulations.process_faults.clients import Clock
from kvrouter.simulations.process_faults.network import Network
from kvrouter.simulations.process_faults.replicas import Replica
from kvrouter.simulations.process_faults.servers import EtcdServer, NatsNode


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


def server_target(name: str, server: NatsNode | EtcdServer, start: Callable[[], None]) -> Target:
    """A server process: killed and paused by its PID, started again by ``start`` (on its data)."""

    def signal_server(signum: int) -> None:
        if server.process is not None and server.process.poll() is None:
            server.process.send_signal(signum)

    def kill() -> None:
        if server.process is not None and server.process.poll() is None:
            server.process.kill()
            server.process.wait()

    return Target(name, kill, start, lambda: signal_server(signal.SIGSTOP), lambda: signal_server(signal.SIGCONT))


def nats_target(node: NatsNode, nats: str) -> Target:
    return server_target(f"nats-{node.name}", node, lambda: node.start(nats))


def etcd_target(server: EtcdServer) -> Target:
    return server_target("etcd", server, server.start)


class Nemesis:
    def __init__(
        self, history: History, clock: Clock, seed: int, targets: list[Target], network: Network | None = None
    ) -> None:
        self.history = history
        self.clock = clock
        self.rng = random.Random(f"{seed}:nemesis")
        self.targets = targets
        self.network = network
        self.kinds = ("kill", "pause") if network is None else ("kill", "pause", "partition", "partition")
        self.options = NemesisOptions()
        self.counts: dict[str, int] = dict.fromkeys(self.kinds, 0)
        self.last_fault_ended = 0.0  # trio time

    async def run(self, until: float) -> None:
        while True:
            await trio.sleep(self.rng.uniform(*self.options.gap_seconds))
            if trio.current_time() >= until:
                return
            await self.one_fault()

    async def one_fault(self) -> None:
        target = self.rng.choice(self.targets)
        kind = self.rng.choice(self.kinds)
        lasting = self.rng.uniform(*self.options.fault_seconds)
        if kind == "partition":
            start, end, name = self.partition()
        elif kind == "kill":
            start, end, name = target.kill, target.restart, target.name
        else:
            start, end, name = target.pause, target.resume, target.name
        self.counts[kind] += 1
        if name == "etcd":
            self.counts[f"{kind} of etcd"] = self.counts.get(f"{kind} of etcd", 0) + 1  # counted in `kind` too
        self.note(kind, name, "start")
        start()
        try:
            await trio.sleep(lasting)
        finally:
            end()
            self.note(kind, name, "end")
            self.last_fault_ended = trio.current_time()

    def partition(self) -> tuple[Callable[[], None], Callable[[], None], str]:
        """Two random sides of the network's hosts (each at least one): cut, heal, and the sides' names."""
        network = self.network
        assert network is not None
        hosts = list(network.names)
        self.rng.shuffle(hosts)
        split = self.rng.randint(1, len(hosts) - 1)
        side, other = sorted(hosts[:split]), sorted(hosts[split:])
        return lambda: network.cut(side, other), network.heal, f"{','.join(side)} | {','.join(other)}"

    def note(self, kind: str, target: str, phase: str) -> None:
        self.history.add(
            {"t": self.clock.now(), "process": "nemesis", "type": "info", "f": kind, "value": target, "phase": phase}
        )


async def wait_all_healthy(http: httpx.AsyncClient, replicas: list[Replica]) -> None:
    async with trio.open_nursery() as nursery:
        for replica in replicas:
            nursery.start_soon(replica.wait_healthy, http)
