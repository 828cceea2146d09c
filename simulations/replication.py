"""Replica sync between simulated routers: the real Replicator's messages, carried by the simulation.

``SimReplicator`` is ``actors.peers.replicator.Replicator`` without sockets: the same observer turns each
local admission, prefill completion and free into a 1.6.1 wire message (``replica_wire.encode``), and the
same receiving path decodes a peer's message, applies 1.6.1's drop rules and hands the actor a ``remote``
command. Instead of a PUB/SUB pair, the cluster driver takes the encoded frames from the outbox and
delivers them to the other replicas itself, through its seeded fault model (drop, delay, reorder).

It uses the Replicator's internal hooks (``_observe``, ``_seed_requests``, ``_receive`` and the outbox
channel); they are the seams between its transport and its logic.
"""

from __future__ import annotations

import trio

from kvrouter.actors.peers.replicator import Replicator
from kvrouter.actors.system import ActorSystem


class SimReplicator(Replicator):
    def __init__(self, system: ActorSystem, router_id: int) -> None:
        super().__init__(system, port=0, peers=(), router_id=router_id)

    def attach(self) -> None:
        """Start observing the system's decisions (after recovery: its live requests are known)."""
        self._seed_requests()
        self._system.observers.append(self._observe)

    def take_outgoing(self) -> list[list[bytes]]:
        """Every message published since the last call, in publication order."""
        frames = []
        while True:
            try:
                frames.append(self._outbox_receive.receive_nowait())
            except trio.WouldBlock:
                return frames

    async def deliver(self, frames: list[bytes]) -> None:
        """A peer's message arrives (decoded, filtered and applied as the SUB task would)."""
        await self._receive(frames)
