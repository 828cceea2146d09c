"""A cluster replica's settings (``--cluster NAME`` and the flags it needs): see ``docs/operations/cluster.md``."""

from __future__ import annotations

import re
from typing import Final

import attrs

CLUSTER_NAME: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")  # also the JetStream stream's name
DEFAULT_LEASE_TTL_SECONDS: Final = 2


@attrs.frozen
class ClusterOptions:
    name: str  # the cluster: its etcd prefix and its JetStream stream
    etcd_endpoints: tuple[str, ...]
    nats_servers: tuple[str, ...]
    advertise_url: str  # where the other replicas reach this one's HTTP API (its member name)
    lease_ttl_seconds: int = DEFAULT_LEASE_TTL_SECONDS
    jetstream_replicas: int = 1  # the stream's replica count (--jetstream-replicas)

    def describe(self) -> str:
        return (
            f"cluster {self.name} as {self.advertise_url} (etcd {','.join(self.etcd_endpoints)}, "
            f"JetStream stream {self.name} on {','.join(self.nats_servers)})"
        )
