"""From parsed command-line flags (kept as text) and the environment to what a service starts with.

Every value is checked before anything is opened or bound, with the rules ``DYN_*`` variables go through
(:mod:`kvrouter.actors.core.router_config`): finite numbers within bounds, whole numbers for counts and ports.
All problems are reported together, each naming its flag or variable; the caller prints them as one line and
exits 2. Flags of 1.6.1 that kvrouter accepts but does not act on yield one warning each, so a launch script
written for the reference starts kvrouter without hiding what it ignores.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

import attrs

from kvrouter.actors.core.limits import MAX_INDEX_BLOCKS_PER_SCOPE
from kvrouter.actors.core.router_config import (
    InvalidSettings,
    RouterConfig,
    Setting,
    env_settings,
    parse_float,
    parse_int,
    resolve,
)
from kvrouter.actors.core.worker_endpoints import parse_http_endpoint, service_url_problem
from kvrouter.actors.fleet.options import FleetOptions
from kvrouter.actors.peers.replicator import validate_endpoint
from kvrouter.api.cli.dynamo_flags import (
    SELECT_SERVICE_INERT,
    SLOT_TRACKER_INERT,
    http_host,
    http_port,
    inert_warnings,
)
from kvrouter.api.cli.fleet_flags import fleet_options, nats_servers, worker_file_parser
from kvrouter.api.cli.http_flags import check_exposure, http_options
from kvrouter.api.cli.replica import replica_security_from
from kvrouter.api.process.cluster_options import CLUSTER_NAME, DEFAULT_LEASE_TTL_SECONDS, ClusterOptions
from kvrouter.api.process.exposure import worker_endpoint_allow
from kvrouter.api.process.fronts import MAX_FRONTS, ProcessRole, parse_role
from kvrouter.api.process.journal_backend import (
    MAX_JETSTREAM_REPLICAS,
    JetStreamJournalOptions,
    default_stream,
    stream_problem,
)
from kvrouter.api.process.main import SLOT_TRACKER_BODY_LIMIT, ServiceOptions
from kvrouter.api.routes.selection import SELECTION_BODY_LIMIT
from kvrouter.api.streams.answer_budget import DEFAULT_BUDGETS, AnswerBudgets
from kvrouter.api.streams.live import DEFAULT_STREAMS, StreamSettings
from kvrouter.journal.layout import is_journal_file
from kvrouter.journal.store import Durability

SLOT_TRACKER = "slot-tracker"
SELECT_SERVICE = "select-service"
DEFAULT_PORTS = {SLOT_TRACKER: 8091, SELECT_SERVICE: 8092}
DEFAULT_FRONTS = 0  # --fronts; 0: one process
DATA_ROOT = Path("kvrouter-data")  # each service defaults to its own subdirectory
U64_MAX = 2**64 - 1
# What replica sync takes (the flags' destinations): a --cluster replica refuses each (the cluster replaces it).
REPLICA_SYNC_FLAGS = (
    "replica_sync_port",
    "replica_sync_peers",
    "replica_curve_secret_key_file",
    "replica_curve_peer_keys_dir",
    "replica_max_peers",
    "replica_max_message_bytes",
    "replica_peer_max_rate",
)
MAX_STREAM_SUBSCRIBERS = 100_000  # --stream-max-subscribers (the HTTP connection cap bounds it too)
# --max-batch-answer-bytes and the streams' budgets: a refusal (~200 bytes) must fit; far beyond any memory above
MIN_ANSWER_BUDGET, MAX_ANSWER_BUDGET = 1024, 2**40
MAX_INDEX_BLOCKS_FLAG = 2**40  # --max-index-blocks-per-scope: far beyond any memory, so only a typo is refused

SELECTION_CACHE_TTL_SECS = 120.0
SELECTION_CACHE_MAX_ENTRIES = 4096
SELECTION_CACHE_MAX_BYTES = 256 * 1024 * 1024  # 1.6.1's default
SESSION_AFFINITY_TTL_BOUNDS = (1.0, 31_536_000.0)  # 1.6.1's: one second to one year
TRACKING_HASHES = ("public-xxh3-v1", "keyed-xxh3-v1")
TRACKING_KEY_BYTES = 32

# flag dest -> RouterConfig field (``overlap_score_weight`` is the deprecated alias resolve() folds in)
_ROUTER_NUMBER_FLAGS = (
    "router_mode",  # not a number: resolve() checks it as DYN_ROUTER_MODE
    "overlap_score_credit",
    "overlap_score_weight",
    "prefill_load_scale",
    "router_temperature",
    "host_cache_hit_weight",
    "disk_cache_hit_weight",
    "router_ttl_secs",
    "router_max_tree_size",
    "router_prune_target_ratio",
    "active_decode_blocks_threshold",
    "active_prefill_tokens_threshold",
    "active_prefill_tokens_threshold_frac",
    "router_queue_threshold",
    "router_queue_policy",
    "kv_events_stale_secs",
    "kv_events_timeout_secs",
)
_ROUTER_BOOL_FLAGS = ("use_kv_events", "router_assume_kv_reuse")


@attrs.frozen
class Launch:
    """A validated service launch."""

    service: str  # SLOT_TRACKER or SELECT_SERVICE
    options: ServiceOptions
    router: RouterConfig | None = None  # the selection service's knobs
    indexer_peers: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    fronts: int = 0  # HTTP front processes; 0: one process (api/process/fronts.py)
    role: ProcessRole | None = None  # a child of a --fronts supervisor
    fleet: FleetOptions = attrs.Factory(FleetOptions)  # discovery and Dynamo's event plane (selection service)


def settings_from(args: argparse.Namespace, env: Mapping[str, str]) -> Launch:
    """The launch ``args`` describe; raises :class:`InvalidSettings` naming every bad flag or variable."""
    problems: list[str] = []
    warnings: list[str] = []
    service = args.service
    raw_port, port_name = http_port(args.port, env)
    port = parse_int(port_name, raw_port, 0, 65535, problems) if raw_port is not None else DEFAULT_PORTS[service]
    args.host = http_host(args.host, env, "127.0.0.1")  # DYN_HTTP_HOST without --host/--http-host
    warnings.extend(inert_warnings(args, SLOT_TRACKER_INERT if service == SLOT_TRACKER else SELECT_SERVICE_INERT))
    replica_port = _int(args, "replica_sync_port", 1, 65535, problems)
    if args.host == "":
        problems.append("--host='' is empty; pass an address or a name (0.0.0.0 serves a cluster)")
    peers = _replica_peers(args, replica_port, problems)
    replica_security = replica_security_from(args, replica_port, peers, problems, warnings)
    data_dir = _data_dir(args, problems)
    http, auth = http_options(args, env, problems, warnings)
    role = parse_role(args.process_role) if getattr(args, "process_role", None) else None
    if args.host:
        # The children of a --fronts supervisor repeat its command line: its warning is enough.
        check_exposure(args.host, auth, args, problems, warnings if role is None else [])
    fronts = _int(args, "fronts", 0, MAX_FRONTS, problems, default=DEFAULT_FRONTS)
    subscribers = _int(args, "stream_max_subscribers", 1, MAX_STREAM_SUBSCRIBERS, problems, default=None)
    streams = StreamSettings(
        max_subscribers=DEFAULT_STREAMS.max_subscribers if subscribers is None else subscribers,
        answers=_answer_budgets(args, problems),
    )
    cluster = _cluster(args, env, problems, warnings)
    launch = Launch(
        service,
        ServiceOptions(
            host=args.host,
            port=port if port is not None else 0,
            data_dir=data_dir,
            durability=Durability(args.durability or Durability.ALWAYS.value),
            jetstream_journal=_jetstream_journal(args, env, problems, warnings) if cluster is None else None,
            cluster=cluster,
            fresh=args.fresh,
            body_limit=SLOT_TRACKER_BODY_LIMIT,
            replica_sync_port=replica_port,
            replica_sync_peers=peers,
            replica_security=replica_security,
            http=http,
            auth=auth,
            streams=streams,
        ),
        fronts=fronts or 0,
        role=role,
    )
    if service == SELECT_SERVICE:
        launch = _select_service(launch, args, env, problems, warnings)
    if problems:
        raise InvalidSettings(problems)
    return attrs.evolve(launch, warnings=tuple(warnings))


def _select_service(
    launch: Launch, args: argparse.Namespace, env: Mapping[str, str], problems: list[str], warnings: list[str]
) -> Launch:
    ttl = _float(args, "selection_cache_ttl_secs", 0.0, None, problems, default=SELECTION_CACHE_TTL_SECS)
    entries = _int(args, "selection_cache_max_entries", 0, U64_MAX, problems, default=SELECTION_CACHE_MAX_ENTRIES)
    max_bytes = _int(args, "selection_cache_max_bytes", 0, U64_MAX, problems, default=SELECTION_CACHE_MAX_BYTES)
    seed = _int(args, "seed", 0, U64_MAX, problems)
    index_blocks = _int(
        args, "max_index_blocks_per_scope", 1, MAX_INDEX_BLOCKS_FLAG, problems, default=MAX_INDEX_BLOCKS_PER_SCOPE
    )
    threads = _int(args, "threads", 0, U64_MAX, problems)
    affinity = _float(args, "session_affinity_ttl_secs", *SESSION_AFFINITY_TTL_BOUNDS, problems)
    router = _router_config(args, env, problems)
    allow = worker_endpoint_allow(args.worker_endpoint_allow, problems)
    if router is not None and allow is not None:
        router = attrs.evolve(router, worker_endpoint_allow=allow)
    _check_tracking_key(args, problems)

    if threads is not None:
        warnings.append(f"--threads {args.threads} has no effect: kvrouter's index runs on the service's one thread")
    if affinity is not None and router is not None:
        router = attrs.evolve(router, session_affinity_ttl_secs=affinity)
    if router is not None and not router.router_assume_kv_reuse:
        source = "--no-router-assume-kv-reuse" if args.router_assume_kv_reuse is False else _env_source(env)
        warnings.append(
            f"{source} is ignored: kvrouter always books a request's own sequence hashes (it assumes KV reuse)"
        )
    if args.router_tracking_hash == "keyed-xxh3-v1":
        warnings.append(
            "--router-tracking-hash keyed-xxh3-v1 is ignored: keyed hashing is not implemented yet, active-sequence "
            "identities use the public xxh3 hash"
        )
        if args.router_tracking_key_file is not None:
            warnings.append("--router-tracking-key-file is ignored (the key was read and checked, and is not used)")
        if args.router_tracking_key_id:
            warnings.append(f"--router-tracking-key-id {args.router_tracking_key_id} is ignored")
    indexer_peers = tuple(url.strip() for url in (args.indexer_peers or "").split(",") if url.strip())
    fleet = fleet_options(
        args, env, problems, warnings, data_dir=launch.options.data_dir, file_parser=worker_file_parser()
    )
    if launch.options.cluster is not None:
        problems.extend(cluster_select_problems(indexer_peers, fleet))
    options = attrs.evolve(
        launch.options,
        body_limit=SELECTION_BODY_LIMIT,
        seed=seed,
        selection_cache_ttl_secs=ttl if ttl is not None else SELECTION_CACHE_TTL_SECS,
        selection_cache_max_entries=entries if entries is not None else SELECTION_CACHE_MAX_ENTRIES,
        selection_cache_max_bytes=max_bytes if max_bytes is not None else SELECTION_CACHE_MAX_BYTES,
        max_index_blocks_per_scope=index_blocks if index_blocks is not None else MAX_INDEX_BLOCKS_PER_SCOPE,
    )
    return attrs.evolve(
        launch,
        options=options,
        router=router,
        indexer_peers=indexer_peers,
        fleet=fleet,
    )


def cluster_select_problems(indexer_peers: tuple[str, ...], fleet: FleetOptions) -> list[str]:
    """What a selection-service replica of a cluster cannot run with (docs/operations/cluster.md): a scope's KV
    index is written by its owner alone, from its workers' ZMQ KV events, which the owner subscribes to."""
    problems = []
    if indexer_peers:
        problems.append(
            "--cluster does not take --indexer-peers: each scope's owner restores its index from the stream"
        )
    if fleet.enabled:
        problems.append(
            "--cluster does not run with discovery or Dynamo's event plane yet (--discovery-backend, "
            "--discovery-file, --event-plane): register workers with POST /workers, their KV events on ZMQ"
        )
    return problems


def _router_config(args: argparse.Namespace, env: Mapping[str, str], problems: list[str]) -> RouterConfig | None:
    """The ``DYN_*`` environment, then the flags (which win), through the same rules."""
    flags: dict[str, Setting] = {}
    for dest in _ROUTER_NUMBER_FLAGS:
        raw = getattr(args, dest)
        if raw is not None:
            flags[dest] = (_flag(dest), raw)
    for dest in _ROUTER_BOOL_FLAGS:
        value = getattr(args, dest)
        if value is not None:
            flags[dest] = (_flag(dest) if value else _flag("no_" + dest), "true" if value else "false")
    try:
        return resolve(env_settings(env), flags)
    except InvalidSettings as exc:
        problems.extend(exc.problems)
        return None


def _env_source(env: Mapping[str, str]) -> str:
    name, raw = env_settings(env)["router_assume_kv_reuse"]
    return f"{name}={raw}"


def _check_tracking_key(args: argparse.Namespace, problems: list[str]) -> None:
    """1.6.1's rules for the keyed tracking hash, so a launch it refuses is refused here too."""
    keyed = args.router_tracking_hash == "keyed-xxh3-v1"
    key_file, key_id = args.router_tracking_key_file, args.router_tracking_key_id
    if not keyed:
        if key_file is not None or key_id is not None:
            problems.append(
                "--router-tracking-key-file and --router-tracking-key-id require --router-tracking-hash keyed-xxh3-v1"
            )
        return
    if key_file is None:
        problems.append("--router-tracking-hash keyed-xxh3-v1 requires --router-tracking-key-file")
    if not key_id:
        problems.append("--router-tracking-hash keyed-xxh3-v1 requires a non-empty --router-tracking-key-id")
    if key_file is not None:
        try:
            with open(key_file, "rb") as key:
                size = len(key.read(TRACKING_KEY_BYTES + 1))
        except OSError as exc:
            problems.append(f"--router-tracking-key-file={key_file!r} cannot be read ({exc.strerror or exc})")
            return
        if size != TRACKING_KEY_BYTES:
            found = size if size <= TRACKING_KEY_BYTES else f"more than {TRACKING_KEY_BYTES}"
            problems.append(
                f"--router-tracking-key-file={key_file!r} must hold exactly {TRACKING_KEY_BYTES} raw bytes; "
                f"found {found}"
            )


def _replica_peers(args: argparse.Namespace, replica_port: int | None, problems: list[str]) -> tuple[str, ...]:
    if args.replica_sync_peers is None:
        return ()
    if args.replica_sync_port is None:
        problems.append("--replica-sync-peers requires --replica-sync-port")
    peers = tuple(p.strip() for p in args.replica_sync_peers.split(",") if p.strip())
    for peer in peers:
        reason = validate_endpoint(peer)
        if reason is not None:
            problems.append(f"invalid replica peer endpoint `{peer}`: {reason}")
    return peers


def _data_dir(args: argparse.Namespace, problems: list[str]) -> Path:
    """``--data-dir``, or the service's own default directory.

    Both services used to default to ``./kvrouter-data`` itself. A journal still there belongs to a service
    that would now start empty in its subdirectory, silently setting its state aside: refuse instead.
    """
    if args.data_dir is not None:
        if args.data_dir == "":
            problems.append("--data-dir='' is empty; pass a directory path")
        return Path(args.data_dir)
    default = DATA_ROOT / args.service
    try:
        legacy = DATA_ROOT.is_dir() and any(is_journal_file(entry.name) for entry in DATA_ROOT.iterdir())
    except OSError:
        legacy = False  # unreadable: the service reports it when it opens its own directory
    if legacy:
        problems.append(
            f"./{DATA_ROOT} holds a journal from an earlier kvrouter, which kept both services' journals there; "
            f"this service now defaults to ./{default}: pass --data-dir {DATA_ROOT} to keep using that journal, "
            f"or move its files to ./{default}"
        )
    return default


def _jetstream_journal(
    args: argparse.Namespace, env: Mapping[str, str], problems: list[str], warnings: list[str]
) -> JetStreamJournalOptions | None:
    """``--journal jetstream``'s stream and servers; None for the file journal (the default)."""
    if args.journal != "jetstream":
        if args.jetstream_stream is not None:
            warnings.append("--jetstream-stream has no effect without --journal jetstream")
        if getattr(args, "jetstream_replicas", None) is not None:
            warnings.append("--jetstream-replicas has no effect without --journal jetstream or --cluster")
        return None
    stream = args.jetstream_stream if args.jetstream_stream is not None else default_stream(args.service)
    problem = stream_problem(stream)
    if problem is not None:
        problems.append(problem)
    return JetStreamJournalOptions(nats_servers(args, env), stream, jetstream_replicas(args, problems))


def jetstream_replicas(args: argparse.Namespace, problems: list[str]) -> int:
    """``--jetstream-replicas``: 1 when absent."""
    return _int(args, "jetstream_replicas", 1, MAX_JETSTREAM_REPLICAS, problems, default=1) or 1


def _cluster(
    args: argparse.Namespace, env: Mapping[str, str], problems: list[str], warnings: list[str]
) -> ClusterOptions | None:
    """``--cluster NAME`` and what it needs (the slot tracker's; None without it)."""
    name = getattr(args, "cluster", None)
    if name is None:
        for flag in ("advertise_url", "cluster_lease_ttl"):
            if getattr(args, flag, None) is not None:
                warnings.append(f"{_flag(flag)} has no effect without --cluster")
        return None
    if not CLUSTER_NAME.fullmatch(name):
        problems.append(f"--cluster={name!r} must be 1-64 letters, digits, '_' or '-'")
    etcd = args.etcd_endpoints or env.get("ETCD_ENDPOINTS")
    if not etcd:
        problems.append("--cluster needs --etcd-endpoints (or ETCD_ENDPOINTS): the etcd that holds the leases")
    if not (args.nats_server or env.get("NATS_SERVER")):
        problems.append("--cluster needs --nats-server (or NATS_SERVER): the JetStream server holding the journals")
    advertise = args.advertise_url
    if not advertise:
        problems.append("--cluster needs --advertise-url http://HOST:PORT: where the other replicas reach this one")
    else:
        problem = advertise_url_problem(advertise)
        if problem is not None:
            problems.append(
                f"--advertise-url: {problem}; expected http://HOST:PORT, where the others reach this replica"
            )
    if getattr(args, "fronts", None) not in (None, "0", 0):
        problems.append("--cluster does not run with --fronts yet; leave --fronts out")
    replica_sync = [_flag(dest) for dest in REPLICA_SYNC_FLAGS if getattr(args, dest, None) not in (None, "")]
    if replica_sync:
        problems.append(f"--cluster replaces replica sync; leave {', '.join(replica_sync)} out")
    problems.extend(_ignored_by_a_replica(args))
    ttl = _int(args, "cluster_lease_ttl", 1, 60, problems, default=DEFAULT_LEASE_TTL_SECONDS)
    urls = tuple(url.strip() for url in (etcd or "").split(",") if url.strip())
    return ClusterOptions(
        name,
        tuple(url if "://" in url else f"http://{url}" for url in urls),
        nats_servers(args, env),
        (advertise or "").rstrip("/"),
        ttl or DEFAULT_LEASE_TTL_SECONDS,
        jetstream_replicas(args, problems),
    )


def _ignored_by_a_replica(args: argparse.Namespace) -> list[str]:
    """The journal flags a ``--cluster`` replica would otherwise ignore: it keeps each scope's journal on the
    cluster's JetStream stream (named after the cluster) and answers a write once JetStream acknowledged it.
    ``--journal jetstream`` and ``--durability always`` say just that, and are taken."""
    refused = []
    if args.journal == "file":
        refused.append(
            "--cluster does not take --journal file: a replica keeps each scope's journal on the cluster's "
            "JetStream stream; leave --journal out"
        )
    if args.jetstream_stream is not None:
        refused.append(
            "--cluster does not take --jetstream-stream: the cluster's stream is named after --cluster NAME; "
            "leave --jetstream-stream out"
        )
    if args.durability not in (None, Durability.ALWAYS.value):
        refused.append(
            f"--cluster does not take --durability {args.durability}: a replica answers each write once JetStream "
            "acknowledged it, as under always; leave --durability out"
        )
    if args.fresh:
        refused.append(
            "--cluster does not take --fresh: a replica keeps no journal of its own to discard (the scopes' "
            "journals are the cluster's, on JetStream); to start empty, use a new --cluster NAME"
        )
    return refused


def advertise_url_problem(url: str) -> str | None:
    """Why ``url`` cannot be where the other replicas reach this one: it names this replica in etcd and in every
    command it forwards, so it is exactly ``http://HOST:PORT``, with a host the others can connect to."""
    problem = service_url_problem(url)
    if problem is not None:
        return problem
    address = parse_http_endpoint(url).address
    if address is not None and address.is_unspecified:
        return f"`{url}` names no host the others can reach ({address} is every address of this machine)"
    return None


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _answer_budgets(args: argparse.Namespace, problems: list[str]) -> AnswerBudgets:
    """``--max-batch-answer-bytes``, ``--max-stream-unsent-bytes``, ``--max-unsent-bytes``."""
    found = {
        field: _int(args, dest, MIN_ANSWER_BUDGET, MAX_ANSWER_BUDGET, problems, default=getattr(DEFAULT_BUDGETS, field))
        for field, dest in (
            ("batch_answer_bytes", "max_batch_answer_bytes"),
            ("stream_unsent_bytes", "max_stream_unsent_bytes"),
            ("unsent_bytes", "max_unsent_bytes"),
        )
    }
    return AnswerBudgets(**{field: value for field, value in found.items() if value is not None})


def _int(
    args: argparse.Namespace,
    dest: str,
    low: int,
    high: int,
    problems: list[str],
    *,
    default: int | None = None,
) -> int | None:
    raw = getattr(args, dest)
    if raw is None:
        return default
    return parse_int(_flag(dest), raw, low, high, problems)


def _float(
    args: argparse.Namespace,
    dest: str,
    low: float,
    high: float | None,
    problems: list[str],
    *,
    default: float | None = None,
) -> float | None:
    raw = getattr(args, dest)
    if raw is None:
        return default
    return parse_float(_flag(dest), raw, low, high, problems)
