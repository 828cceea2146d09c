"""The ``kvrouter`` command line: one subcommand per service."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import trio

from api.main import ServiceOptions, run_until_signal
from api.routes import slot_tracker_routes
from journal.store import CorruptJournal, Durability


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrouter", description=__doc__)
    services = parser.add_subparsers(dest="service", required=True)
    slot = services.add_parser("slot-tracker", help="active-request accounting service (Dynamo slot tracker)")
    _common_flags(slot, 8091)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    options = ServiceOptions(
        host=args.host,
        port=args.port,
        data_dir=args.data_dir,
        durability=Durability(args.durability),
        fresh=args.fresh,
    )
    status = 0
    try:
        trio.run(partial(run_until_signal, "slot tracker", options, slot_tracker_routes))
    except* CorruptJournal as group:
        for exc in group.exceptions:
            logging.getLogger("kvrouter").error("cannot start: %s", exc)
        status = 2
    return status


if __name__ == "__main__":
    sys.exit(main())
