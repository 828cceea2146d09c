"""Which service kind and journal format a cluster holds: checked before a replica joins.

The first replica of cluster NAME writes ``kvrouter/cluster/NAME/service`` (no lease: it outlives every replica)
naming its service kind (``slot-tracker``, ``select-service``) and the JetStream journal's layout version, in a
create-if-absent transaction; every later replica reads it back and is refused (``ClusterMismatch``) unless it is
the same. So a selection service never recovers a slot tracker's scopes, nor a build that writes another journal
layout joins replicas that could not read it, even while no member is live.
"""

from __future__ import annotations

from typing import Any

import orjson

from kvrouter.actors.cluster import ClusterMismatch, ClusterUnreachable
from kvrouter.actors.fleet.etcd import EtcdClient, EtcdUnavailable
from kvrouter.journal.jetstream_batch import FORMAT


def service_key(prefix: str) -> str:
    return f"{prefix}service"


async def check_kind(etcd: EtcdClient, cluster: str, prefix: str, service: str) -> None:
    """Claim cluster ``cluster`` for ``service`` if nobody has, else check it is the one it holds."""
    mine = {"service": service, "journal": FORMAT}
    try:
        created, held, _ = await etcd.create_if_absent(service_key(prefix), orjson.dumps(mine), 0)
    except EtcdUnavailable as exc:
        raise ClusterUnreachable(
            f"cannot reach etcd at {etcd.endpoint} for cluster {cluster} ({exc}); start etcd or fix --etcd-endpoints"
        ) from None
    if created or held is None:
        return
    try:
        theirs: Any = orjson.loads(held)
    except orjson.JSONDecodeError:
        theirs = {}
    if not isinstance(theirs, dict) or theirs != mine:
        service_held = theirs.get("service") if isinstance(theirs, dict) else None
        journal_held = theirs.get("journal") if isinstance(theirs, dict) else None
        raise ClusterMismatch(
            f"cluster {cluster} is a {service_held} cluster with journal format {journal_held}; this replica is a "
            f"{service} with journal format {FORMAT}: give it another --cluster name"
        )
