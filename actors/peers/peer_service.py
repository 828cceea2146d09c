"""PeerService: replica peer management (``/replica_sync/*``) as a service object with plain data.

What the replica routes call instead of the ``Replicator`` itself, so that they, like every other route,
talk to the actor side only through plain arguments and results (a front process forwards them). Failures
are ``Refused`` with 1.6.1's messages: replica sync off is a conflict, an invalid endpoint is invalid, a
registration beyond ``--replica-max-peers`` is a conflict, an unknown peer is not found.
"""

from __future__ import annotations

from kvrouter.actors.core.decisions import Reason
from kvrouter.actors.metric_families import Family
from kvrouter.actors.peers.replicator import PeerLimitError, Replicator
from kvrouter.actors.service_metrics import replica_families
from kvrouter.actors.service_support import Refused

REPLICA_SYNC_DISABLED = "replica sync is disabled"


class PeerService:
    def __init__(self, replicator: Replicator | None) -> None:
        self.replicator = replicator  # None: replica sync is off

    def _enabled(self) -> Replicator:
        if self.replicator is None:
            raise Refused(Reason.CONFLICT, REPLICA_SYNC_DISABLED)
        return self.replicator

    async def register_peer(self, endpoint: str) -> bool:
        """True if newly added, False if it was already a peer."""
        replicator = self._enabled()
        try:
            return replicator.register_peer(endpoint)
        except ValueError as exc:
            raise Refused(Reason.INVALID, str(exc)) from None
        except PeerLimitError as exc:
            raise Refused(Reason.CONFLICT, str(exc)) from None

    async def deregister_peer(self, endpoint: str) -> None:
        replicator = self._enabled()
        try:
            removed = replicator.deregister_peer(endpoint)
        except ValueError as exc:
            raise Refused(Reason.INVALID, str(exc)) from None
        if not removed:
            raise Refused(Reason.NOT_FOUND, "peer not found")

    async def peers(self) -> list[str]:
        """The peer endpoints, sorted; none while replica sync is off."""
        return self.replicator.peers() if self.replicator is not None else []

    async def metrics(self) -> list[Family]:
        """Replica sync's figures for ``GET /metrics`` (see ``actors/service_metrics.py``)."""
        return replica_families(self.replicator)
