"""The ``kvrouter`` command line: one subcommand per service."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from functools import partial
from typing import Any

import attrs
import trio

from kvrouter import __version__
from kvrouter.actors.core.limits import MAX_INDEX_BLOCKS_PER_SCOPE
from kvrouter.actors.core.router_config import ROUTER_MODES, InvalidSettings
from kvrouter.actors.select_service import SelectService
from kvrouter.actors.slot_service import SlotService
from kvrouter.actors.system import ActorSystem
from kvrouter.api.cli.dynamo_flags import (
    HTTP_HOST_ENV,
    HTTP_PORT_ENV,
    SELECT_SERVICE_INERT,
    SLOT_TRACKER_INERT,
    add_inert_flags,
)
from kvrouter.api.cli.fleet_flags import add_fleet_flags, add_nats_server_flag
from kvrouter.api.cli.http_flags import add_http_flags
from kvrouter.api.cli.one_line_parser import OneLineParser
from kvrouter.api.cli.replica import KEYS, add_keys_command, add_replica_security_flags, run_keys
from kvrouter.api.cli.settings import (
    DATA_ROOT,
    DEFAULT_FRONTS,
    DEFAULT_PORTS,
    SELECT_SERVICE,
    SELECTION_CACHE_MAX_BYTES,
    SELECTION_CACHE_MAX_ENTRIES,
    SELECTION_CACHE_TTL_SECS,
    SLOT_TRACKER,
    TRACKING_HASHES,
    Launch,
    settings_from,
)
from kvrouter.api.http import Route
from kvrouter.api.process import log_setup
from kvrouter.api.process.cluster_options import DEFAULT_LEASE_TTL_SECONDS
from kvrouter.api.process.exit_reasons import BAD_CONFIGURATION, ServiceContext, explain
from kvrouter.api.process.exposure import add_worker_endpoint_flag
from kvrouter.api.process.fronts import (
    MAX_FRONTS,
    ServiceKind,
    become_child,
    run_actor_process,
    run_front_process,
    supervise,
)
from kvrouter.api.process.journal_backend import JOURNAL_BACKENDS, MAX_JETSTREAM_REPLICAS, default_stream
from kvrouter.api.process.main import (
    RouteBuilder,
    ServiceOptions,
    run_until_signal,
    select_objects_builder,
    select_service_builder,
    select_service_routes_of,
    slot_tracker_app,
    slot_tracker_objects,
    slot_tracker_routes_of,
)
from kvrouter.api.streams.answer_budget import DEFAULT_BUDGETS
from kvrouter.api.streams.live import DEFAULT_MAX_SUBSCRIBERS
from kvrouter.journal.store import Durability

log = logging.getLogger("kvrouter")

VERSION = f"kvrouter {__version__}"


def _common_flags(parser: argparse.ArgumentParser, service: str) -> None:
    port = DEFAULT_PORTS[service]
    parser.add_argument("--version", action="version", version=VERSION, help="print the version and exit")
    parser.add_argument(
        "--port", "--http-port", metavar="PORT", help=f"HTTP port, 0 for any free one ({HTTP_PORT_ENV}; default {port})"
    )
    parser.add_argument(
        "--host",
        "--http-host",
        help=f"address to bind ({HTTP_HOST_ENV}; default 127.0.0.1; 0.0.0.0 serves a cluster, and then needs "
        "--auth-token-file or --insecure-no-auth)",
    )
    parser.add_argument(
        "--data-dir",
        metavar="DIR",
        help=f"journal and snapshots, one service per directory (default ./{DATA_ROOT / service})",
    )
    parser.add_argument(
        "--durability",
        choices=[d.value for d in Durability],
        help="the file journal's: always: reply after fsync (default); batch: fsync every few ms; off: never fsync",
    )
    parser.add_argument("--fresh", action="store_true", help="start empty, discarding the journal")
    _journal_flags(parser, service)
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="least severe messages logged (default info); debug also prints tracebacks inline",
    )
    parser.add_argument(
        "--replica-sync-port",
        metavar="PORT",
        help="bind a ZMQ PUB on this port (1-65535, on --host) for replica sync; default: replica sync off",
    )
    parser.add_argument(
        "--replica-sync-peers",
        metavar="ENDPOINTS",
        help="comma-separated ZMQ PUB endpoints of peer replicas (requires --replica-sync-port)",
    )
    add_replica_security_flags(parser)
    add_http_flags(parser)
    parser.add_argument(
        "--fronts",
        metavar="N",
        help=f"HTTP front processes on the one port, 0-{MAX_FRONTS} (default {DEFAULT_FRONTS}; 0: one process "
        "serves HTTP and owns the state; see README, Process layout and fronts)",
    )
    parser.add_argument(
        "--stream-max-subscribers",
        metavar="N",
        help=f"subscribers of each live stream (/ws/loads, /ws/decisions) per process; more are closed with 1013 "
        f"(default {DEFAULT_MAX_SUBSCRIBERS})",
    )
    budgets = DEFAULT_BUDGETS
    parser.add_argument(
        "--max-batch-answer-bytes",
        metavar="N",
        help=f"a POST /batch answer's size; past it the batch's remaining commands are not run and answer 413 "
        f"(default {budgets.batch_answer_bytes}; see docs/running-safely.md, Answer and stream budgets)",
    )
    parser.add_argument(
        "--max-stream-unsent-bytes",
        metavar="N",
        help=f"unsent answers of one /ws/commands connection; past it the service stops reading its commands "
        f"until the client takes them (default {budgets.stream_unsent_bytes})",
    )
    parser.add_argument(
        "--max-unsent-bytes",
        metavar="N",
        help=f"unsent answers of every /ws/commands connection of a process together; past it only connections "
        f"with nothing unsent go on (default {budgets.unsent_bytes})",
    )
    parser.add_argument("--process-role", help=argparse.SUPPRESS)  # a child of a --fronts supervisor


def _journal_flags(parser: argparse.ArgumentParser, service: str) -> None:
    """Where the journal lives (see docs/operations/cluster.md); the selection service's ``--nats-server`` comes
    with its fleet flags, the slot tracker's here (one definition: ``add_nats_server_flag``)."""
    group = parser.add_argument_group("journal backend (see docs/operations/cluster.md)")
    group.add_argument(
        "--journal",
        choices=JOURNAL_BACKENDS,
        help="file: segment files in --data-dir (default); jetstream: a NATS JetStream stream, so another machine "
        "can recover it (a --cluster replica's journals are always on JetStream)",
    )
    group.add_argument(
        "--jetstream-stream",
        metavar="NAME",
        help=f"with --journal jetstream: the stream (default {default_stream(service)}); one writer per stream",
    )
    group.add_argument(
        "--jetstream-replicas",
        metavar="N",
        help=f"with --journal jetstream or --cluster: the stream's replica count, 1-{MAX_JETSTREAM_REPLICAS} "
        "(default 1); the NATS servers given must be a cluster of at least N with JetStream; a stream that exists "
        "with another count is refused",
    )
    if service != SELECT_SERVICE:
        add_nats_server_flag(group)
    _cluster_flags(parser, with_etcd=service != SELECT_SERVICE)


def _cluster_flags(parser: argparse.ArgumentParser, *, with_etcd: bool) -> None:
    """A replica of a cluster: one owner per scope under etcd leases, each scope's journal on JetStream (the
    selection service's ``--etcd-endpoints`` and ``--nats-server`` come with its fleet flags)."""
    group = parser.add_argument_group("cluster (see docs/operations/cluster.md)")
    group.add_argument(
        "--cluster",
        metavar="NAME",
        help="run as a replica of cluster NAME (its etcd prefix and JetStream stream); needs --etcd-endpoints, "
        "--nats-server and --advertise-url",
    )
    if with_etcd:
        group.add_argument("--etcd-endpoints", metavar="URLS", help="comma-separated etcd client URLs (ETCD_ENDPOINTS)")
    group.add_argument(
        "--advertise-url", metavar="URL", help="where the other replicas reach this one's HTTP API (http://HOST:PORT)"
    )
    group.add_argument(
        "--cluster-lease-ttl",
        metavar="SECONDS",
        help=f"this replica's etcd lease TTL, 1-60 (default {DEFAULT_LEASE_TTL_SECONDS}): a dead replica's scopes "
        "move after about this long",
    )


def _router_flags(parser: argparse.ArgumentParser) -> None:
    """Router knobs; each overrides the reference's DYN_* environment variable of the same meaning."""
    knobs = parser.add_argument_group(
        "router knobs (default: the DYN_* environment, then 1.6.1's defaults; checked by the same rules)"
    )
    number: dict[str, Any] = {"metavar": "X"}  # add_argument keywords shared by the numeric knobs
    knobs.add_argument(
        "--router-mode",
        metavar="MODE",
        help=f"DYN_ROUTER_MODE: {', '.join(ROUTER_MODES)} (kv; round-robin and round_robin alike)",
    )
    knobs.add_argument("--overlap-score-credit", **number, help="DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT, >= 0 (1.0)")
    knobs.add_argument(
        "--overlap-score-weight",
        "--kv-overlap-score-weight",
        **number,
        help="deprecated DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT: sets the prefill load scale (0 also zeroes the credit)",
    )
    knobs.add_argument("--prefill-load-scale", **number, help="DYN_ROUTER_PREFILL_LOAD_SCALE, >= 0 (1.0)")
    knobs.add_argument("--router-temperature", **number, help="DYN_ROUTER_TEMPERATURE, >= 0 (0.0: pick the cheapest)")
    knobs.add_argument("--host-cache-hit-weight", **number, help="DYN_ROUTER_HOST_CACHE_HIT_WEIGHT, 0-1 (0.75)")
    knobs.add_argument("--disk-cache-hit-weight", **number, help="DYN_ROUTER_DISK_CACHE_HIT_WEIGHT, 0-1 (0.25)")
    knobs.add_argument(
        "--use-kv-events",
        "--router-kv-events",
        action=argparse.BooleanOptionalAction,
        help="DYN_USE_KV_EVENTS (true): index from worker KV events; without, count what selections book",
    )
    knobs.add_argument(
        "--router-ttl-secs", **number, help="DYN_ROUTER_TTL_SECS, >= 0 (120): predicted blocks' lifetime"
    )
    knobs.add_argument(
        "--router-max-tree-size",
        metavar="N",
        help="DYN_ROUTER_MAX_TREE_SIZE (1048576): predicted blocks before pruning",
    )
    knobs.add_argument(
        "--router-prune-target-ratio", **number, help="DYN_ROUTER_PRUNE_TARGET_RATIO, 0-1 (0.8): what a prune keeps"
    )
    knobs.add_argument(
        "--active-decode-blocks-threshold",
        **number,
        help="DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD, 0-1: a rank is busy above this fraction of its total_kv_blocks",
    )
    knobs.add_argument(
        "--active-prefill-tokens-threshold",
        **number,
        help="DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD: a rank is busy above this many active prefill tokens",
    )
    knobs.add_argument(
        "--active-prefill-tokens-threshold-frac",
        **number,
        help="DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD_FRAC: busy above this fraction of its max_num_batched_tokens",
    )
    knobs.add_argument(
        "--router-queue-threshold",
        **number,
        help="DYN_ROUTER_QUEUE_THRESHOLD (off): requests wait while every rank's prefill exceeds X x its "
        "max_num_batched_tokens (or a busy threshold)",
    )
    knobs.add_argument("--router-queue-policy", choices=("fcfs", "lcfs", "wspt"), help="DYN_ROUTER_QUEUE_POLICY (fcfs)")
    knobs.add_argument(
        "--kv-events-stale-secs",
        **number,
        help="score a rank on its bookings while its KV events are absent, or silent this long after a booking "
        "(10; 0: never)",
    )
    knobs.add_argument(
        "--kv-events-timeout-secs",
        **number,
        help="take a rank with a KV listener out of selection, freeing its bookings, when its KV events stay silent "
        "this long after a booking; back when they resume (15; 0: never)",
    )
    knobs.add_argument(
        "--router-assume-kv-reuse",
        action=argparse.BooleanOptionalAction,
        help="DYN_ROUTER_ASSUME_KV_REUSE (true); kvrouter always assumes reuse: the --no- form is ignored, with a "
        "warning",
    )


def _affinity_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--session-affinity-ttl-secs",
        metavar="S",
        help="pin each session_id to the worker that served it, until S seconds (1-31536000) after its last "
        "request ends (default: off)",
    )


def _reference_flags(parser: argparse.ArgumentParser) -> None:
    """1.6.1's flags that kvrouter accepts (checked as 1.6.1 checks them) but does not act on yet."""
    compat = parser.add_argument_group("accepted for compatibility with 1.6.1 (a warning says each is ignored)")
    compat.add_argument("--threads", metavar="N", help="indexer threads in 1.6.1; kvrouter indexes on one thread")
    compat.add_argument(
        "--router-tracking-hash",
        choices=TRACKING_HASHES,
        help="hash of active-sequence identities; kvrouter uses public-xxh3-v1 (keyed-xxh3-v1 is checked, ignored)",
    )
    compat.add_argument(
        "--router-tracking-key-file",
        metavar="FILE",
        help="the 32-byte key of keyed-xxh3-v1 (read and checked, not used)",
    )
    compat.add_argument("--router-tracking-key-id", metavar="ID", help="the key's epoch id for keyed-xxh3-v1")


# Subcommands with parsers of their own (``main`` hands them their arguments): name, what it is.
DELEGATED_COMMANDS = (
    ("simulate", "deterministic cluster simulation"),
    ("journal", "inspect or repair a stopped service's journal"),
    ("worker-topology", "publish a worker's topology files and KV-transfer policy"),
    ("mock-worker", "an OpenAI-compatible mock inference worker publishing KV events"),
    ("frontend", "an OpenAI-compatible KV-routing frontend in front of workers"),
    ("demo", "mock workers behind a frontend, kv vs round-robin side by side"),
    ("watch", "follow a service's loads or decisions live"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="kvrouter", description=__doc__)
    parser.add_argument("--version", action="version", version=VERSION, help="print the version and exit")
    services = parser.add_subparsers(
        dest="service",
        required=True,
        metavar="{slot-tracker,select-service,simulate,keys,journal,worker-topology,mock-worker,frontend,demo,watch}",
    )
    slot = services.add_parser(
        SLOT_TRACKER,
        help="active-request accounting service (Dynamo slot tracker)",
        description="Active-request accounting (Dynamo 1.6.1's slot tracker), journaled.",
    )
    _common_flags(slot, SLOT_TRACKER)
    add_inert_flags(slot, SLOT_TRACKER_INERT)
    select = services.add_parser(
        SELECT_SERVICE,
        help="KV-aware worker selection service (Dynamo select_service)",
        description="KV-aware worker selection (Dynamo 1.6.1's select_service), journaled.",
    )
    _common_flags(select, SELECT_SERVICE)
    _selection_flags(select)
    _router_flags(select)
    _affinity_flags(select)
    add_fleet_flags(select)
    _reference_flags(select)
    add_inert_flags(select, SELECT_SERVICE_INERT)
    for name, summary in DELEGATED_COMMANDS:
        services.add_parser(name, help=f"{summary} (see kvrouter {name} --help)", add_help=False)
    for subparser in (slot, select):
        subparser.set_defaults(subparser=subparser)
    add_keys_command(services)
    return parser


def _selection_flags(parser: argparse.ArgumentParser) -> None:
    """The selection service's own: peers to seed from, the pending-selection cache, the index cap, workers, seed."""
    parser.add_argument(
        "--indexer-peers",
        metavar="URLS",
        default="",
        help="comma-separated HTTP URLs: seed the index from the first peer's /dump before serving",
    )
    parser.add_argument(
        "--selection-cache-ttl-secs",
        metavar="S",
        help=f"seconds a /select with a selection_id stays claimable, >= 0 (default {SELECTION_CACHE_TTL_SECS:g})",
    )
    parser.add_argument(
        "--selection-cache-max-entries",
        metavar="N",
        help=f"pending selections kept per scope, oldest evicted first (default {SELECTION_CACHE_MAX_ENTRIES})",
    )
    parser.add_argument(
        "--selection-cache-max-bytes",
        metavar="N",
        help=f"byte budget of pending selections, oldest evicted first (default {SELECTION_CACHE_MAX_BYTES})",
    )
    parser.add_argument(
        "--max-index-blocks-per-scope",
        metavar="N",
        help=f"KV-event index blocks per (model, tenant) scope, every rank and tier (default "
        f"{MAX_INDEX_BLOCKS_PER_SCOPE}); beyond it the ranks holding the most lose their deepest blocks",
    )
    add_worker_endpoint_flag(parser)
    parser.add_argument(
        "--seed",
        metavar="N",
        help="seed (0 to 2**64-1) of the scopes' random sources (tie-breaks, softmax); default: fresh per process",
    )


def parse_arguments(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Like ``parse_args``, but an unknown flag after a subcommand shows that subcommand's usage, and a
    flag before any subcommand is named (argparse would only say a subcommand is required)."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    first = arguments[0] if arguments else ""
    if first.startswith("-") and first.split("=", 1)[0] not in {"-h", "--help", "--version"}:
        parser.error(f"unrecognized argument {first}: the subcommand comes first, e.g. kvrouter select-service {first}")
    args, unknown = parser.parse_known_args(arguments)
    if unknown:
        args.subparser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["simulate"]:
        from kvrouter.simulations.cli import main as simulate

        return simulate(arguments[1:])
    if arguments[:1] == ["journal"]:
        from kvrouter.api.cli.journal import main as journal

        return journal(arguments[1:])
    if arguments[:1] == ["mock-worker"]:
        from kvrouter.api.mock_worker.cli import main as mock_worker

        return mock_worker(arguments[1:])
    if arguments[:1] == ["frontend"]:
        from kvrouter.api.frontend.cli import main as frontend

        return frontend(arguments[1:])
    if arguments[:1] == ["demo"]:
        from kvrouter.api.cli.demo import main as demo

        return demo(arguments[1:])
    if arguments[:1] == ["watch"]:
        from kvrouter.api.cli.watch import main as watch

        return watch(arguments[1:])
    if arguments[:1] == ["worker-topology"]:
        from kvrouter.api.cli.worker_topology import main as worker_topology

        return worker_topology(arguments[1:])
    parser = build_parser()
    args = parse_arguments(parser, argv)
    if args.service == KEYS:
        return run_keys(args)
    log_setup.configure(args.log_level, args.service)
    try:
        launch = settings_from(args, os.environ)
    except InvalidSettings as exc:
        log.error("cannot start: %s", "; ".join(exc.problems))
        return BAD_CONFIGURATION
    for warning in launch.warnings:
        log.warning("%s", warning)
    return run(launch, arguments)


@attrs.define
class _Progress:
    journal_open: bool = False


def service_kind(launch: Launch) -> ServiceKind:
    if launch.service == SLOT_TRACKER:
        return ServiceKind("slot tracker", SlotService, slot_tracker_objects, slot_tracker_routes_of)
    assert launch.router is not None
    build = select_objects_builder(launch.router, launch.indexer_peers, fleet=launch.fleet)
    return ServiceKind("selection service", SelectService, build, select_service_routes_of)


def cluster_kind(launch: Launch) -> Any:
    """The service kind a ``--cluster`` replica runs (``api/process/cluster.py``)."""
    from kvrouter.api.process.cluster import SLOT_TRACKER_KIND

    if launch.service == SLOT_TRACKER:
        return SLOT_TRACKER_KIND
    from kvrouter.api.process.cluster_select import select_service_kind

    assert launch.router is not None
    return select_service_kind(launch.router)


def run(launch: Launch, argv: Sequence[str] = ()) -> int:
    """Serve until SIGINT/SIGTERM (status 0); on failure log one line and return its status.

    ``argv``: the command line, which a ``--fronts`` supervisor repeats for its children."""
    build: RouteBuilder
    if launch.service == SLOT_TRACKER:
        name, build = "slot tracker", slot_tracker_app
    else:
        assert launch.router is not None
        name, build = (
            "selection service",
            select_service_builder(launch.router, launch.indexer_peers, fleet=launch.fleet),
        )
    progress = _Progress()
    options = launch.options
    role = launch.role
    try:
        if role is not None:
            become_child(role)
            if role.kind == "actor":
                trio.run(run_actor_process, service_kind(launch), options, role, partial(_note_open, progress))
            else:
                trio.run(run_front_process, service_kind(launch), options, role)
        elif launch.fronts > 0:
            return trio.run(supervise, name, options, list(argv), launch.fronts)
        elif options.cluster is not None:
            from kvrouter.api.process.cluster import run_cluster_until_signal  # etcd and NATS load only for a cluster

            trio.run(run_cluster_until_signal, name, options, cluster_kind(launch))
        else:
            trio.run(partial(run_until_signal, name, options, _noting_open_journal(build, progress)))
    except SystemExit:
        raise
    except BaseException as exc:
        context = ServiceContext(options.host, options.port, options.data_dir, options.replica_sync_port)
        reason = explain(exc, context, journal_open=progress.journal_open)
        log.error("%s", reason.message, exc_info=exc if reason.unexpected else None)
        return reason.status
    return 0


def _note_open(progress: _Progress) -> None:
    progress.journal_open = True


def _noting_open_journal(build: RouteBuilder, progress: _Progress) -> RouteBuilder:
    """``build``, noting when it is called: by then the journal is open and recovered (api.main)."""

    async def build_routes(options: ServiceOptions, system: ActorSystem, nursery: trio.Nursery) -> list[Route]:
        progress.journal_open = True
        return await build(options, system, nursery)

    return build_routes


if __name__ == "__main__":
    sys.exit(main())
