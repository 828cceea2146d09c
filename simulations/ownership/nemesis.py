"""The nemesis: kills replicas (and restarts them empty), pauses them (SIGSTOP, resumed later with a stale
view), partitions any two sets of replicas and services, and takes stream nodes down, at seeded times; at
``end`` it heals everything. Every fault and every repair goes into the history."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import attrs

from kvrouter.simulations.ownership.history import History
from kvrouter.simulations.ownership.kernel import MS, SECOND, Kernel
from kvrouter.simulations.ownership.messages import Tick
from kvrouter.simulations.ownership.services import COORDINATOR, STREAM, STREAM_NODES, Stream

NEMESIS = "nemesis"
KINDS = ("kill", "pause", "partition", "stream-node")


@attrs.frozen
class NemesisOptions:
    start_ns: int = 1 * SECOND
    gap_ms: tuple[int, int] = (300, 2_500)
    kill_ms: tuple[int, int] = (300, 4_000)  # down time before the restart
    pause_ms: tuple[int, int] = (300, 6_000)
    partition_ms: tuple[int, int] = (300, 5_000)
    stream_node_ms: tuple[int, int] = (300, 4_000)


class Nemesis:
    def __init__(
        self,
        kernel: Kernel,
        history: History,
        seed: int,
        replicas: tuple[str, ...],
        stream: Stream,
        restart: Callable[[str], None],
        options: NemesisOptions,
        end: int,
    ) -> None:
        self.kernel = kernel
        self.history = history
        self.rng = random.Random(f"{seed}:nemesis")
        self.replicas = replicas
        self.stream = stream
        self.restart = restart
        self.options = options
        self.end = end
        self.faulted: set[str] = set()  # replicas killed or paused now
        self.partitioned = False
        self.counts = dict.fromkeys(KINDS, 0)
        kernel.timer(NEMESIS, options.start_ns, Tick("fault"))
        kernel.timer(NEMESIS, end, Tick("heal-all"))

    def handle(self, src: str, message: Any) -> None:
        what, data = message.what, message.data
        if what == "fault" and self.kernel.now < self.end:
            self.inject()
            self.kernel.timer(NEMESIS, self.rng.randint(*self.options.gap_ms) * MS, Tick("fault"))
        elif what == "undo":
            self.undo(*data)
        elif what == "heal-all":
            self.heal_all()

    def _log(self, f: str, value: Any) -> None:
        self.history.add({"t": self.kernel.now, "process": NEMESIS, "type": "info", "f": f, "value": value})

    def inject(self) -> None:
        rng = self.rng
        kind = rng.choice(KINDS)
        healthy = [r for r in self.replicas if r not in self.faulted]
        if kind in ("kill", "pause") and healthy:
            replica = rng.choice(healthy)
            self.faulted.add(replica)
            if kind == "kill":
                self.kernel.kill(replica)
            else:
                self.kernel.pause(replica)
            self._after(getattr(self.options, f"{kind}_ms"), kind, replica)
        elif kind == "partition" and not self.partitioned:
            nodes = [*self.replicas, COORDINATOR, STREAM]
            while True:
                side = tuple(n for n in nodes if rng.random() < 0.5)
                if 0 < len(side) < len(nodes):
                    break
            other = tuple(n for n in nodes if n not in side)
            self.kernel.partition(side, other)
            self.partitioned = True
            self._after(self.options.partition_ms, kind, [list(side), list(other)])
        elif kind == "stream-node":
            up = [n for n in range(STREAM_NODES) if n not in self.stream.nodes_down]
            node = rng.choice(up) if up else None
            if node is None:
                return
            self.stream.nodes_down.add(node)
            self._after(self.options.stream_node_ms, kind, node)
        else:
            return
        self.counts[kind] += 1

    def _after(self, span_ms: tuple[int, int], kind: str, value: Any) -> None:
        self._log(kind, value)
        self.kernel.timer(NEMESIS, self.rng.randint(*span_ms) * MS, Tick("undo", (kind, value)))

    def undo(self, kind: str, value: Any) -> None:
        if kind == "kill" and value in self.faulted:
            self.restart(value)
        elif kind == "pause" and value in self.faulted:
            self.kernel.resume(value)
        elif kind == "partition" and self.partitioned:
            self.kernel.heal()
            self.partitioned = False
        elif kind == "stream-node" and value in self.stream.nodes_down:
            self.stream.nodes_down.discard(value)
        else:
            return
        if isinstance(value, str):
            self.faulted.discard(value)
        self._log(f"end-{kind}", value)

    def heal_all(self) -> None:
        for replica in sorted(self.faulted):
            if self.kernel.paused(replica):
                self.kernel.resume(replica)
            else:
                self.restart(replica)
        self.faulted.clear()
        self.kernel.heal()
        self.kernel.calm()
        self.partitioned = False
        self.stream.nodes_down.clear()
        self._log("heal-all", None)
