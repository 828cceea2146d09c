"""Command-line pieces of replica-sync security: the flags both services take, their validation, and
``kvrouter keys generate``.

Kept apart from api/cli/main.py and api/cli/settings.py, which only call in here, so those stay about the
services as a whole.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvrouter.actors.core.router_config import parse_float, parse_int
from kvrouter.actors.peers.curve import CurveConfigError, TrustedPeers, load_identity, write_certificates
from kvrouter.actors.peers.peer_limits import (
    MAX_MESSAGE_BYTES,
    MAX_PEERS,
    MAX_PEERS_LIMIT,
    MESSAGE_BYTES_BOUNDS,
    PEER_RATE,
    PEER_RATE_BOUNDS,
    PeerLimits,
)
from kvrouter.actors.peers.replicator import CurveSettings, ReplicaSecurity, validate_endpoint

KEYS = "keys"


def add_replica_security_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("replica sync security (kvrouter only; README 'Replica sync security')")
    group.add_argument(
        "--replica-curve-secret-key-file",
        metavar="FILE",
        help="this replica's CURVE secret certificate (NAME.key_secret from `kvrouter keys generate`); turns on "
        "CURVE encryption and authentication of replica sync (requires --replica-curve-peer-keys-dir)",
    )
    group.add_argument(
        "--replica-curve-peer-keys-dir",
        metavar="DIR",
        help="public certificates (*.key) of the replicas to trust; each names the endpoint its owner publishes "
        "on. Only these may subscribe to us, and each peer must prove the key of the certificate naming it",
    )
    group.add_argument(
        "--replica-max-peers",
        metavar="N",
        help=f"replica peers at most, 0-{MAX_PEERS_LIMIT} (default {MAX_PEERS}); more answer 409",
    )
    group.add_argument(
        "--replica-max-message-bytes",
        metavar="N",
        help=f"largest replica message accepted, {MESSAGE_BYTES_BOUNDS[0]}-{MESSAGE_BYTES_BOUNDS[1]} "
        f"(default {MAX_MESSAGE_BYTES}); a larger one drops that peer's connection, which then reconnects",
    )
    group.add_argument(
        "--replica-peer-max-rate",
        metavar="N",
        help=f"messages per second accepted from one peer, in bursts of one second's worth (default {PEER_RATE:g}); "
        "the excess is dropped and counted",
    )


def replica_security_from(
    args: argparse.Namespace, replica_port: int | None, peers: tuple[str, ...], problems: list[str], warnings: list[str]
) -> ReplicaSecurity:
    """The checked flags; every problem is appended to ``problems`` (one line each)."""
    max_peers = _int(args.replica_max_peers, "--replica-max-peers", 0, MAX_PEERS_LIMIT, problems, MAX_PEERS)
    max_bytes = _int(
        args.replica_max_message_bytes,
        "--replica-max-message-bytes",
        *MESSAGE_BYTES_BOUNDS,
        problems,
        MAX_MESSAGE_BYTES,
    )
    rate = PEER_RATE
    if args.replica_peer_max_rate is not None:
        parsed = parse_float("--replica-peer-max-rate", args.replica_peer_max_rate, *PEER_RATE_BOUNDS, problems)
        rate = parsed if parsed is not None else PEER_RATE
    limits = PeerLimits(max_peers=max_peers, max_message_bytes=max_bytes, rate=rate)
    if len(peers) > max_peers:
        problems.append(f"--replica-sync-peers lists {len(peers)} peers; --replica-max-peers allows {max_peers}")
    key_file, keys_dir = args.replica_curve_secret_key_file, args.replica_curve_peer_keys_dir
    if key_file is None and keys_dir is None:
        return ReplicaSecurity(limits=limits)
    if key_file is None or keys_dir is None:
        problems.append("--replica-curve-secret-key-file and --replica-curve-peer-keys-dir go together: pass both")
        return ReplicaSecurity(limits=limits)
    if replica_port is None:
        problems.append("--replica-curve-secret-key-file requires --replica-sync-port")
    try:
        identity = load_identity(Path(key_file))
        trusted = TrustedPeers(Path(keys_dir))
    except CurveConfigError as exc:
        problems.append(str(exc))
        return ReplicaSecurity(limits=limits)
    warnings.extend(identity.warnings)
    if not trusted.keys:
        warnings.append(f"--replica-curve-peer-keys-dir {keys_dir} holds no certificate: no replica can sync with us")
    for peer in peers:
        if validate_endpoint(peer) is None and trusted.server_key_for(peer) is None:
            problems.append(
                f"--replica-sync-peers: no certificate in {keys_dir} names `{peer}` (its public certificate needs "
                f'`endpoint = "{peer}"` in its metadata)'
            )
    return ReplicaSecurity(CurveSettings(identity, trusted), limits)


def _int(raw: str | None, flag: str, low: int, high: int, problems: list[str], default: int) -> int:
    if raw is None:
        return default
    parsed = parse_int(flag, raw, low, high, problems)
    return parsed if parsed is not None else default


# -- kvrouter keys generate -----------------------------------------------------------------------------


def add_keys_command(services: argparse._SubParsersAction[Any]) -> None:
    keys = services.add_parser(
        KEYS,
        help="generate CURVE certificates for replica sync",
        description="CURVE certificates for replica sync (README 'Replica sync security').",
    )
    actions = keys.add_subparsers(dest="keys_action", required=True, metavar="{generate}", help="what to do")
    generate = actions.add_parser(
        "generate",
        help="write NAME.key (public) and NAME.key_secret (secret, mode 600) into --dir",
        description="Write a new CURVE key pair: NAME.key (public: copy it into the peer keys directory of every "
        "replica that should trust this one) and NAME.key_secret (keep it here: --replica-curve-secret-key-file).",
    )
    generate.add_argument("--name", required=True, help="file name stem, e.g. the replica's host name")
    generate.add_argument("--dir", required=True, metavar="DIR", help="where to write the two files (created)")
    generate.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="tcp://host:port where this replica publishes, as its peers register it (repeat for several names)",
    )
    keys.set_defaults(subparser=keys)
    generate.set_defaults(subparser=generate)


def run_keys(args: argparse.Namespace) -> int:
    """``kvrouter keys generate``: 0, or 2 with one line on stderr."""
    for endpoint in args.endpoint:
        problem = validate_endpoint(endpoint)
        if problem is not None:
            print(f"kvrouter keys generate: {problem}", file=sys.stderr)
            return 2
    if not args.name or "/" in args.name or args.name.startswith("."):
        print(f"kvrouter keys generate: --name {args.name!r} must be a plain file name", file=sys.stderr)
        return 2
    try:
        public, secret = write_certificates(Path(args.dir), args.name, args.endpoint)
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"kvrouter keys generate: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2
    print(f"wrote {public} (public: give it to the peers) and {secret} (secret: keep it on this replica)")
    if not args.endpoint:
        print("no --endpoint given: peers cannot subscribe to this replica by its certificate until one is added")
    return 0
