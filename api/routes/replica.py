"""Replica sync for both services: starting the replicator and its ``/replica_sync/*`` routes (which call
``PeerService``, never the replicator itself).

Same paths, bodies, statuses and messages as 1.6.1 (docs/slot-tracker.md, docs/operations/replicas.md): without
``--replica-sync-port`` the write routes answer 409 ``replica sync is disabled`` and the peer
list is ``[]``. Dynamic peers are in memory: after a restart only ``--replica-sync-peers`` return.
kvrouter's additions: a registration beyond ``--replica-max-peers`` answers 409, and with CURVE an
endpoint no trusted certificate names answers 400 (see actors/peers/curve.py).
"""

from __future__ import annotations

import trio

from kvrouter.actors.peers.peer_service import PeerService
from kvrouter.actors.peers.replicator import ReplicaSecurity, Replicator, random_router_id
from kvrouter.actors.system import ActorSystem
from kvrouter.api.bodies.schemas import PeerBody, parse
from kvrouter.api.http import Request, Response, Route, json_response
from kvrouter.api.routes.operations import route
from kvrouter.api.routes.support import bound


async def start_replication(
    system: ActorSystem,
    nursery: trio.Nursery,
    *,
    host: str,
    port: int | None,
    peers: tuple[str, ...],
    security: ReplicaSecurity | None = None,
    router_id: int | None = None,
    session_ttl_ns: int = 0,
) -> Replicator | None:
    """``router_id`` defaults to a fresh random one; ``session_ttl_ns`` > 0 also replicates session bindings."""
    if port is None:
        return None
    replicator = Replicator(
        system,
        port=port,
        peers=peers,
        router_id=router_id or random_router_id(),
        host=host,
        security=security,
        session_ttl_ns=session_ttl_ns,
    )
    await nursery.start(replicator.run)
    return replicator


def replica_routes(peers: PeerService) -> list[Route]:
    async def register_peer(service: PeerService, request: Request) -> Response:
        body = parse(PeerBody, request.json())
        added = await service.register_peer(body.endpoint)
        return json_response(201 if added else 200, {"status": "ok"})

    async def deregister_peer(service: PeerService, request: Request) -> Response:
        body = parse(PeerBody, request.json())
        await service.deregister_peer(body.endpoint)
        return json_response(200, {"status": "ok"})

    async def list_peers(service: PeerService, request: Request) -> Response:
        return json_response(200, await service.peers())

    return [
        route("register_peer", bound(peers, register_peer)),
        route("deregister_peer", bound(peers, deregister_peer)),
        route("peers", bound(peers, list_peers)),
    ]
