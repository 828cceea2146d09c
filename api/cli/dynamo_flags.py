"""The flags and environment a Dynamo 1.6.1 launch script brings, for ``kvrouter frontend``, ``select-service`` and
``slot-tracker``: each maps to the kvrouter setting of the same job (an alias on that setting's one definition), or,
where kvrouter has nothing doing that job, is accepted and named in one warning line saying it has no effect. The
table of what maps where is in ``docs/fleet.md#dynamos-flags-and-environment``.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

import attrs

HTTP_HOST_ENV = "DYN_HTTP_HOST"
HTTP_PORT_ENV = "DYN_HTTP_PORT"
REPLICA_SYNC_REASON = (
    "kvrouter replicas share their bookings over ZeroMQ: give --replica-sync-port and --replica-sync-peers "
    "(docs/operations/replicas.md)"
)


@attrs.frozen
class InertFlag:
    """A Dynamo flag accepted where kvrouter has nothing doing its job: ``reason`` says so in the warning."""

    flag: str
    reason: str
    boolean: bool = False  # ``--flag/--no-flag``; otherwise it takes a value

    @property
    def dest(self) -> str:
        return "dynamo_" + self.flag.removeprefix("--").replace("-", "_")


REQUEST_PLANE = InertFlag(
    "--request-plane", "kvrouter reaches workers over HTTP (the frontend) or does not call them (the services)"
)
FRONTEND_INERT = (InertFlag("--router-replica-sync", REPLICA_SYNC_REASON, boolean=True), REQUEST_PLANE)
SELECT_SERVICE_INERT = (
    InertFlag("--router-replica-sync", REPLICA_SYNC_REASON, boolean=True),
    InertFlag(
        "--kv-cache-block-size",
        "the selection service takes each worker's block size from its registration or its model card",
    ),
    REQUEST_PLANE,
)
_SLOT = "the slot tracker keeps active-request accounting only"
SLOT_TRACKER_INERT = (
    InertFlag("--router-replica-sync", REPLICA_SYNC_REASON, boolean=True),
    InertFlag("--router-mode", f"{_SLOT}: it does not route"),
    InertFlag("--kv-cache-block-size", f"{_SLOT}: block sizes come with each request"),
    InertFlag("--router-kv-events", f"{_SLOT}: it reads no KV events", boolean=True),
    InertFlag("--namespace", f"{_SLOT}: it discovers no workers"),
    InertFlag("--discovery-backend", f"{_SLOT}: it discovers no workers"),
    InertFlag("--event-plane", f"{_SLOT}: it reads no KV events"),
    REQUEST_PLANE,
)


def add_inert_flags(parser: argparse.ArgumentParser, flags: tuple[InertFlag, ...]) -> None:
    group = parser.add_argument_group("accepted from Dynamo's command line, without effect here (a warning says so)")
    for inert in flags:
        if inert.boolean:
            group.add_argument(inert.flag, dest=inert.dest, action=argparse.BooleanOptionalAction, help=inert.reason)
        else:
            group.add_argument(inert.flag, dest=inert.dest, metavar="X", help=inert.reason)


def inert_warnings(args: argparse.Namespace, flags: tuple[InertFlag, ...]) -> list[str]:
    """One line per inert flag given."""
    warnings = []
    for inert in flags:
        value = getattr(args, inert.dest, None)
        if value is None:
            continue
        given = (inert.flag if value else "--no-" + inert.flag[2:]) if inert.boolean else f"{inert.flag} {value}"
        warnings.append(f"{given} has no effect: {inert.reason}")
    return warnings


def http_host(raw: str | None, env: Mapping[str, str], default: str) -> str:
    """``--host``/``--http-host``, else ``DYN_HTTP_HOST``, else ``default`` (loopback: unlike Dynamo's 0.0.0.0, a
    wider bind is asked for, and then needs a token or ``--insecure-no-auth``)."""
    if raw is not None:
        return raw
    return env.get(HTTP_HOST_ENV) or default


def http_port(raw: str | None, env: Mapping[str, str]) -> tuple[str | None, str]:
    """``--port``/``--http-port``, else ``DYN_HTTP_PORT``; and the name to put in a message about it."""
    if raw is not None:
        return raw, "--port"
    value = env.get(HTTP_PORT_ENV)
    return (value, HTTP_PORT_ENV) if value else (None, "--port")
