"""The fleet flags shared by ``kvrouter select-service`` and ``kvrouter frontend``: discovery and Dynamo's event plane,
spelled as Dynamo spells them (``--discovery-backend``, ``--etcd-endpoints``, ``--namespace``, ``--event-plane``,
``--nats-server``) and read from Dynamo's environment (``DYN_DISCOVERY_BACKEND``, ``ETCD_ENDPOINTS``,
``DYN_NAMESPACE``, ``DYN_EVENT_PLANE``, ``NATS_SERVER``) when the flag is absent. Every value is checked before the
service opens anything; problems are reported together (exit 2), flags without effect as one warning each.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import attrs

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.worker_endpoints import default_worker_id
from kvrouter.actors.fleet.options import (
    DEFAULT_ETCD,
    DEFAULT_NAMESPACE,
    DEFAULT_NATS,
    DISCOVERY_BACKENDS,
    EVENT_PLANES,
    FleetOptions,
    JetStreamSettings,
    default_durable,
)
from kvrouter.actors.fleet.worker_file import FileParser, read_worker_file
from kvrouter.api.bodies.schemas import parse
from kvrouter.api.bodies.select_schemas import WorkerBody
from kvrouter.api.http import HttpError

MAX_JETSTREAM_AGE_SECS = 365 * 86_400.0
UNSUPPORTED_BACKENDS = {
    "kubernetes": "Kubernetes discovery is not supported yet; use etcd (Dynamo's etcd backend) or file",
    "k8s": "Kubernetes discovery is not supported yet; use etcd (Dynamo's etcd backend) or file",
    "mem": "the in-memory backend serves one process only; use etcd or file",
}


def add_fleet_flags(parser: argparse.ArgumentParser) -> None:
    fleet = parser.add_argument_group("fleet: discovery and Dynamo's event plane (see docs/fleet.md)")
    fleet.add_argument(
        "--discovery-backend",
        metavar="etcd|file",
        help="discover workers (DYN_DISCOVERY_BACKEND): etcd in Dynamo's layout, or a watched --discovery-file; "
        "default: none, workers register over HTTP",
    )
    fleet.add_argument(
        "--etcd-endpoints",
        metavar="URLS",
        help=f"comma-separated etcd client URLs (ETCD_ENDPOINTS; {DEFAULT_ETCD}): discovery's, and --cluster's",
    )
    fleet.add_argument(
        "--namespace", metavar="NS", help=f"the Dynamo namespace whose workers are discovered ({DEFAULT_NAMESPACE})"
    )
    fleet.add_argument(
        "--discovery-file",
        metavar="FILE",
        help="with --discovery-backend file: a JSON or YAML list of POST /workers bodies, re-read when it changes",
    )
    fleet.add_argument(
        "--event-plane",
        metavar="nats|zmq",
        help="with etcd discovery: where the workers' KV events are read (DYN_EVENT_PLANE; default zmq, as Dynamo)",
    )
    add_nats_server_flag(fleet)
    fleet.add_argument(
        "--jetstream",
        action=argparse.BooleanOptionalAction,
        help="with --event-plane nats: keep kvrouter's JetStream stream of the KV events when the server has "
        "JetStream, so a restart catches up (default on)",
    )
    fleet.add_argument(
        "--jetstream-max-age-secs", metavar="S", help="how long the stream keeps an event (default 3600; oldest first)"
    )
    fleet.add_argument(
        "--jetstream-max-bytes", metavar="N", help="the stream's size bound (default 1073741824; oldest dropped first)"
    )


class AddsArguments(Protocol):
    """A parser or one of its argument groups."""

    def add_argument(self, *names: str, **options: Any) -> Any: ...


def add_nats_server_flag(group: AddsArguments) -> None:
    """``--nats-server``, defined once: the event plane's (here) and the JetStream journal's (``--journal
    jetstream``: the slot tracker, which has no fleet flags, takes it with the journal flags)."""
    group.add_argument(
        "--nats-server",
        metavar="URLS",
        help=f"NATS server URL(s) (NATS_SERVER; {DEFAULT_NATS}): the event plane's, --journal jetstream's and "
        "--cluster's",
    )


def nats_servers(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[str, ...]:
    """The NATS URLs ``--nats-server`` or ``NATS_SERVER`` name, else the default."""
    nats, _ = _pick(args.nats_server, env, "NATS_SERVER")
    return tuple(_urls(nats or DEFAULT_NATS, "nats"))


def _pick(flag: str | None, env: Mapping[str, str], name: str) -> tuple[str | None, str]:
    """The flag's value, else the environment's; and where it came from (for messages)."""
    if flag is not None:
        return flag, ""
    value = env.get(name)
    return (value, f" (from {name})") if value else (None, "")


def _urls(raw: str, default_scheme: str) -> list[str]:
    urls = []
    for part in raw.split(","):
        part = part.strip()
        if part:
            urls.append(part if "://" in part else f"{default_scheme}://{part}")
    return urls


def fleet_options(
    args: argparse.Namespace,
    env: Mapping[str, str],
    problems: list[str],
    warnings: list[str],
    *,
    data_dir: Path | None,
    file_parser: FileParser,
) -> FleetOptions:
    """The fleet options ``args`` and ``env`` describe (disabled without a discovery backend)."""
    backend, backend_from = _pick(args.discovery_backend, env, "DYN_DISCOVERY_BACKEND")
    plane, plane_from = _pick(args.event_plane, env, "DYN_EVENT_PLANE")
    namespace, _ = _pick(args.namespace, env, "DYN_NAMESPACE")
    etcd, _ = _pick(args.etcd_endpoints, env, "ETCD_ENDPOINTS")
    nats, _ = _pick(args.nats_server, env, "NATS_SERVER")
    backend = backend.strip().lower() if backend else None
    if backend in UNSUPPORTED_BACKENDS:
        problems.append(f"--discovery-backend={backend}{backend_from}: {UNSUPPORTED_BACKENDS[backend]}")
        return FleetOptions()
    if backend is not None and backend not in DISCOVERY_BACKENDS:
        problems.append(f"--discovery-backend={backend!r}{backend_from} is not one of {', '.join(DISCOVERY_BACKENDS)}")
        return FleetOptions()
    plane = plane.strip().lower() if plane else None
    if plane is not None and plane not in EVENT_PLANES:
        problems.append(f"--event-plane={plane!r}{plane_from} is not one of {', '.join(EVENT_PLANES)}")
        plane = None
    if namespace is not None and (not namespace or any(c in namespace for c in "./*> ")):
        problems.append(f"--namespace={namespace!r} must be a non-empty name without '.', '/', '*', '>' or spaces")
    jetstream = _jetstream(args, problems, data_dir)
    if backend != "etcd":
        journal_nats = getattr(args, "journal", None) == "jetstream" or getattr(args, "cluster", None) is not None
        nats_flag = None if journal_nats else args.nats_server  # the journal's, or the cluster's
        for given, flag in ((args.event_plane, "--event-plane"), (nats_flag, "--nats-server")):
            if given is not None:
                warnings.append(
                    f"{flag} has no effect without --discovery-backend etcd (it reads the channels etcd names)"
                )
    if backend != "file" and args.discovery_file is not None:
        warnings.append("--discovery-file has no effect without --discovery-backend file")
    if backend is None:
        return FleetOptions()
    discovery_file = None
    if backend == "file":
        discovery_file = _discovery_file(args.discovery_file, file_parser, problems)
    return FleetOptions(
        discovery_backend=backend,
        etcd_endpoints=tuple(_urls(etcd or DEFAULT_ETCD, "http")),
        namespace=namespace or DEFAULT_NAMESPACE,
        discovery_file=discovery_file,
        event_plane=(plane or "zmq") if backend == "etcd" else None,
        nats_servers=tuple(_urls(nats or DEFAULT_NATS, "nats")),
        jetstream=jetstream,
    )


def _jetstream(args: argparse.Namespace, problems: list[str], data_dir: Path | None) -> JetStreamSettings:
    settings = JetStreamSettings(durable=default_durable(data_dir))
    if args.jetstream is False:
        settings = attrs.evolve(settings, enabled=False)
    if args.jetstream_max_age_secs is not None:
        try:
            age = float(args.jetstream_max_age_secs)
        except ValueError:
            age = -1.0
        if not 1.0 <= age <= MAX_JETSTREAM_AGE_SECS:
            problems.append(
                f"--jetstream-max-age-secs={args.jetstream_max_age_secs!r} must be 1 to {MAX_JETSTREAM_AGE_SECS:g}"
            )
        else:
            settings = attrs.evolve(settings, max_age_secs=age)
    if args.jetstream_max_bytes is not None:
        raw = args.jetstream_max_bytes
        if not raw.isdigit() or not 1024 * 1024 <= int(raw) <= 1 << 50:
            problems.append(f"--jetstream-max-bytes={raw!r} must be a whole number of bytes, 1 MiB to 1 PiB")
        else:
            settings = attrs.evolve(settings, max_bytes=int(raw))
    return settings


def _discovery_file(raw: str | None, parser: FileParser, problems: list[str]) -> Path | None:
    if not raw:
        problems.append("--discovery-backend file needs --discovery-file FILE")
        return None
    path = Path(raw)
    try:
        read_worker_file(path, parser)
    except OSError as exc:
        problems.append(f"--discovery-file {raw}: {exc.strerror or exc}")
    except ValueError as exc:
        problems.append(f"--discovery-file: {exc}")
    return path


def worker_file_parser(defaults: Mapping[str, Any] | None = None) -> FileParser:
    """Reads a discovery file's entries as ``POST /workers`` bodies, with ``defaults`` for fields an entry leaves
    out; an entry without ``worker_id`` gets the id a self-registering mock worker derives from its endpoint."""
    base = dict(defaults or {})

    def parse_entries(entries: list[Any]) -> list[WorkerRecord]:
        records = []
        for index, entry in enumerate(entries):
            if not isinstance(entry, dict):
                raise ValueError(f"entry {index} is not an object")
            body = {**base, **entry}
            if "worker_id" not in body and isinstance(body.get("endpoint"), str):
                body["worker_id"] = default_worker_id(body["endpoint"].rstrip("/"))
            try:
                records.append(parse(WorkerBody, body).to_record())
            except HttpError as exc:
                raise ValueError(f"entry {index}: {exc.message}") from None
        return records

    return parse_entries


ParserFactory = Callable[[Mapping[str, Any] | None], FileParser]
