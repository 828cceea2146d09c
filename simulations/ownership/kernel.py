"""The discrete-event kernel: virtual time, a seeded network, and process faults (kill, pause, partition).

Deliveries and timers sit in one heap ordered by (time, sequence number), so equal times keep the order they
were scheduled in and a run is a function of its seed. A paused node (SIGSTOP) keeps everything addressed to it,
timers included, and gets it all, in order, when resumed: it then acts on the view it had before the pause. A
killed node loses its timers and messages; restarting it starts a new incarnation with empty memory.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from typing import Any, Protocol

import attrs

MS = 1_000_000  # ns
SECOND = 1_000 * MS


class Node(Protocol):
    def handle(self, src: str, message: Any) -> None: ...


@attrs.frozen
class NetOptions:
    loss: float = 0.005  # chance a message is lost
    slow: float = 0.02  # chance a message is delayed (a retransmission, a congested link)
    delay_ms: tuple[int, int] = (1, 6)
    slow_delay_ms: tuple[int, int] = (150, 1_500)


@attrs.define
class NetStats:
    sent: int = 0
    lost: int = 0
    cut: int = 0  # dropped by a partition or a dead receiver
    slowed: int = 0


class Kernel:
    def __init__(self, seed: int, net: NetOptions) -> None:
        self.now = 0
        self.net = net
        self.stats = NetStats()
        self._rng = random.Random(f"{seed}:network")
        self._heap: list[tuple[int, int, str, int, str, Any]] = []  # (at, seq, dst, incarnation or -1, src, msg)
        self._seq = 0
        self.nodes: dict[str, Node] = {}
        self.incarnation: dict[str, int] = {}
        self.down: set[str] = set()
        self._paused: dict[str, list[tuple[int, str, Any]]] = {}
        self._blocked: set[tuple[str, str]] = set()

    # -- nodes ------------------------------------------------------------------------------------------

    def add(self, name: str, node: Node) -> None:
        self.nodes[name] = node
        self.incarnation[name] = self.incarnation.get(name, -1) + 1
        self.down.discard(name)

    def kill(self, name: str) -> None:
        self.down.add(name)
        self._paused.pop(name, None)

    def pause(self, name: str) -> None:
        self._paused.setdefault(name, [])

    def resume(self, name: str) -> None:
        for incarnation, src, message in self._paused.pop(name, []):
            self._push(self.now, name, incarnation, src, message)

    def paused(self, name: str) -> bool:
        return name in self._paused

    # -- network ----------------------------------------------------------------------------------------

    def partition(self, side: tuple[str, ...], other: tuple[str, ...]) -> None:
        for a in side:
            for b in other:
                self._blocked.add((a, b))
                self._blocked.add((b, a))

    def heal(self) -> None:
        self._blocked.clear()

    def calm(self) -> None:
        """From now on no message is lost or slowed (the last fault healed)."""
        self.net = attrs.evolve(self.net, loss=0.0, slow=0.0)

    def send(self, src: str, dst: str, message: Any) -> None:
        self.stats.sent += 1
        if (src, dst) in self._blocked:
            self.stats.cut += 1
            return
        rng = self._rng
        if rng.random() < self.net.loss:
            self.stats.lost += 1
            return
        if rng.random() < self.net.slow:
            self.stats.slowed += 1
            low, high = self.net.slow_delay_ms
        else:
            low, high = self.net.delay_ms
        self._push(self.now + rng.randint(low, high) * MS, dst, -1, src, message)

    def timer(self, node: str, after_ns: int, message: Any) -> None:
        self._push(self.now + after_ns, node, self.incarnation[node], node, message)

    def _push(self, at: int, dst: str, incarnation: int, src: str, message: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, dst, incarnation, src, message))

    # -- running ----------------------------------------------------------------------------------------

    def run_until(self, end_ns: int, after_each: Callable[[], None] | None = None) -> None:
        heap = self._heap
        while heap and heap[0][0] <= end_ns:
            at, _, dst, incarnation, src, message = heapq.heappop(heap)
            self.now = at
            if dst in self.down or (incarnation >= 0 and incarnation != self.incarnation[dst]):
                continue
            if incarnation < 0 and (src, dst) in self._blocked:  # the link went down while it was in flight
                self.stats.cut += 1
                continue
            buffered = self._paused.get(dst)
            if buffered is not None:
                buffered.append((incarnation, src, message))
                continue
            self.nodes[dst].handle(src, message)
            if after_each is not None:
                after_each()
        self.now = max(self.now, end_ns)
