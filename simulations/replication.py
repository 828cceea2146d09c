"""Replica sync between simulated routers: the real Replicator's messages, carried by the simulation.

A ``SimReplicator`` is ``actors.peers.replicator.Replicator`` started without sockets
(``start_without_sockets``): the same observer turns each local admission, prefill completion and free
into a 1.6.1 wire message (``replica_wire.encode``), and the same receiving path (``receive``) decodes a
peer's message, applies 1.6.1's drop rules and hands the actor a ``remote`` command. Instead of a
PUB/SUB pair, the cluster driver takes the encoded frames (``take_published``) and delivers them to the
other replicas itself, through its seeded fault model (drop, delay, reorder).
"""

from __future__ import annotations

from kvrouter.actors.peers.replicator import Replicator
from kvrouter.actors.system import ActorSystem


class SimReplicator(Replicator):
    """A replicator with no sockets, observing ``system`` from construction on (after recovery: its
    live requests are known)."""

    def __init__(self, system: ActorSystem, router_id: int) -> None:
        super().__init__(system, port=0, peers=(), router_id=router_id)
        self.start_without_sockets()
