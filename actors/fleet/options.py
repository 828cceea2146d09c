"""What the fleet side is told to do (``--discovery-backend`` and the flags around it): plain data, cheap to import,
so the command line and the composition read it without loading the NATS or etcd clients."""

from __future__ import annotations

import hashlib
import secrets
import socket
from pathlib import Path
from typing import Final

import attrs

DISCOVERY_BACKENDS: Final = ("etcd", "file")
EVENT_PLANES: Final = ("nats", "zmq")
DEFAULT_ETCD: Final = "http://127.0.0.1:2379"
DEFAULT_NATS: Final = "nats://127.0.0.1:4222"
DEFAULT_NAMESPACE: Final = "dynamo"


@attrs.frozen
class JetStreamSettings:
    enabled: bool = True  # use JetStream when the server has it
    max_age_secs: float = 3600.0
    max_bytes: int = 1024 * 1024 * 1024
    durable: str = "kvrouter"


@attrs.frozen
class FleetOptions:
    discovery_backend: str | None = None  # None: workers register over HTTP only
    etcd_endpoints: tuple[str, ...] = (DEFAULT_ETCD,)
    namespace: str = DEFAULT_NAMESPACE
    discovery_file: Path | None = None
    event_plane: str | None = None  # with etcd: "nats" or "zmq"
    nats_servers: tuple[str, ...] = (DEFAULT_NATS,)
    jetstream: JetStreamSettings = attrs.Factory(JetStreamSettings)
    # "blake3:<hex>" of --model-path's tokenizer.json: discovered model cards are compared with it
    # (actors/fleet/tokenizer_check.py); None: no local tokenizer file to compare with.
    tokenizer_checksum: str | None = None

    @property
    def enabled(self) -> bool:
        return self.discovery_backend is not None


def durable_name(identity: str) -> str:
    """The JetStream consumer name of one kvrouter (``identity``: its data directory), stable across restarts."""
    return "kvrouter-" + hashlib.sha256(identity.encode()).hexdigest()[:16]


def default_durable(data_dir: Path | None) -> str:
    """The JetStream consumer of a service: one per data directory (stable across restarts); a journal kept in
    memory gets one of its own per process (the server forgets it a day after it was last used)."""
    if data_dir is None:
        return durable_name(f"memory:{socket.gethostname()}:{secrets.token_hex(8)}")
    return durable_name(f"{socket.gethostname()}:{data_dir.resolve()}")
