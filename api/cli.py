"""The ``kvrouter`` command line: one subcommand per service."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import attrs
import trio

from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.peers.replicator import validate_endpoint
from kvrouter.api.main import SLOT_TRACKER_BODY_LIMIT, ServiceOptions, run_until_signal, slot_tracker_app
from kvrouter.api.select_routes import SELECTION_BODY_LIMIT
from kvrouter.api.select_service import builder as select_service_builder
from kvrouter.journal.store import CorruptJournal, DataDirectoryInUse, Durability


def _common_flags(parser: argparse.ArgumentParser, default_port: int) -> None:
    parser.add_argument("--port", type=int, default=default_port, help=f"HTTP port (default {default_port})")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 serves a cluster)"
    )
    parser.add_argument(
        "--data-dir", type=Path, default=Path("kvrouter-data"), help="journal and snapshots (default ./kvrouter-data)"
    )
    parser.add_argument(
        "--durability",
        choices=[d.value for d in Durability],
        default=Durability.ALWAYS.value,
        help="always: reply after fsync (default); batch: fsync every few ms; off: never fsync",
    )
    parser.add_argument("--fresh", action="store_true", help="start empty, discarding the journal")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--replica-sync-port", type=_port, default=None, help="bind a ZMQ PUB on this port for replica sync (on --host)"
    )
    parser.add_argument(
        "--replica-sync-peers",
        default=None,
        help="comma-separated ZMQ PUB endpoints of peer replicas (requires --replica-sync-port)",
    )


def _port(text: str) -> int:
    port = int(text)
    if not 0 < port <= 65535:
        raise argparse.ArgumentTypeError("port must be greater than zero and at most 65535")
    return port


def _seed_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the scopes' random sources (tie-breaks, softmax); default: fresh per process",
    )


def _router_flags(parser: argparse.ArgumentParser) -> None:
    """Router knobs; each overrides the reference's DYN_* environment variable of the same meaning."""
    knobs = parser.add_argument_group("router knobs (default: the DYN_* environment, then 1.6.1's defaults)")
    knobs.add_argument("--overlap-score-credit", type=float, help="DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT (1.0)")
    knobs.add_argument(
        "--overlap-score-weight",
        type=float,
        help="deprecated DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT: sets the prefill load scale",
    )
    knobs.add_argument("--prefill-load-scale", type=float, help="DYN_ROUTER_PREFILL_LOAD_SCALE (1.0)")
    knobs.add_argument("--router-temperature", type=float, help="DYN_ROUTER_TEMPERATURE (0.0)")
    knobs.add_argument("--host-cache-hit-weight", type=float, help="DYN_ROUTER_HOST_CACHE_HIT_WEIGHT (0.75)")
    knobs.add_argument("--disk-cache-hit-weight", type=float, help="DYN_ROUTER_DISK_CACHE_HIT_WEIGHT (0.25)")
    knobs.add_argument(
        "--use-kv-events",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="DYN_USE_KV_EVENTS (true): index from worker KV events",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrouter", description=__doc__)
    services = parser.add_subparsers(dest="service", required=True)
    slot = services.add_parser("slot-tracker", help="active-request accounting service (Dynamo slot tracker)")
    _common_flags(slot, 8091)
    select = services.add_parser("select-service", help="KV-aware worker selection service (Dynamo select_service)")
    _common_flags(select, 8092)
    select.add_argument("--threads", type=int, default=4, help="accepted for compatibility (single-threaded)")
    select.add_argument("--indexer-peers", default="", help="comma-separated HTTP URLs: recover the index from /dump")
    select.add_argument("--selection-cache-ttl-secs", type=float, default=120.0)
    select.add_argument("--selection-cache-max-entries", type=int, default=4096)
    _seed_flag(select)
    _router_flags(select)
    return parser


def router_config(args: argparse.Namespace) -> RouterConfig:
    """The DYN_* environment first, then flags; fail fast on values that do not parse."""
    config = RouterConfig.from_env(os.environ)
    flags = {
        "overlap_score_credit": args.overlap_score_credit,
        "prefill_load_scale": args.prefill_load_scale,
        "router_temperature": args.router_temperature,
        "host_cache_hit_weight": args.host_cache_hit_weight,
        "disk_cache_hit_weight": args.disk_cache_hit_weight,
        "use_kv_events": args.use_kv_events,
    }
    if args.overlap_score_weight is not None:
        flags["prefill_load_scale"] = args.overlap_score_weight
        if args.overlap_score_weight == 0:
            flags["overlap_score_credit"] = 0.0
    return attrs.evolve(config, **{k: v for k, v in flags.items() if v is not None})


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    peers = tuple(p.strip() for p in (args.replica_sync_peers or "").split(",") if p.strip())
    if args.replica_sync_peers is not None and args.replica_sync_port is None:
        parser.error("--replica-sync-peers requires --replica-sync-port")
    for peer in peers:
        if validate_endpoint(peer) is not None:
            parser.error(f"invalid replica peer endpoint `{peer}`: {validate_endpoint(peer)}")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    options = ServiceOptions(
        host=args.host,
        port=args.port,
        data_dir=args.data_dir,
        durability=Durability(args.durability),
        fresh=args.fresh,
        body_limit=SLOT_TRACKER_BODY_LIMIT if args.service == "slot-tracker" else SELECTION_BODY_LIMIT,
        seed=getattr(args, "seed", None),
        selection_cache_ttl_secs=getattr(args, "selection_cache_ttl_secs", 120.0),
        selection_cache_max_entries=getattr(args, "selection_cache_max_entries", 4096),
        replica_sync_port=args.replica_sync_port,
        replica_sync_peers=peers,
    )
    if args.service == "slot-tracker":
        name, build = "slot tracker", slot_tracker_app
    else:
        try:
            config = router_config(args)
        except ValueError as exc:
            parser.error(str(exc))
        peers = [url.strip() for url in args.indexer_peers.split(",") if url.strip()]
        name, build = "selection service", select_service_builder(config, peers)
    status = 0
    try:
        trio.run(partial(run_until_signal, name, options, build))
    except* (CorruptJournal, DataDirectoryInUse) as group:
        for exc in group.exceptions:
            logging.getLogger("kvrouter").error("cannot start: %s", exc)
        status = 2
    return status


if __name__ == "__main__":
    sys.exit(main())
