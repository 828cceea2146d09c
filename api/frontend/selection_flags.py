"""``kvrouter frontend --selection-url URL[,URL...]``: the flag, and the flags it does not combine with (each
configures the selection that the frontend then leaves to the service: they are set on the service instead)."""

from __future__ import annotations

import argparse

from kvrouter.actors.core.worker_endpoints import HTTP_SCHEMES, service_url_problem
from kvrouter.actors.fleet.options import FleetOptions

# (the namespace's attribute, the flag): set, each is refused with --selection-url.
SELECTION_ONLY = (
    ("data_dir", "--data-dir"),
    ("fresh", "--fresh"),
    ("workers", "--workers"),
    ("seed", "--seed"),
    ("router_mode", "--router-mode"),
    ("kv_overlap_score_weight", "--kv-overlap-score-weight"),
    ("router_temperature", "--router-temperature"),
    ("kv_events", "--router-kv-events"),
    ("busy_threshold", "--busy-threshold"),
)
# (the namespace's attribute, the flag, its default): given another value, each is refused with --selection-url.
WORKER_DEFAULTS = (("model_name", "--model-name", "mock"), ("block_size", "--block-size", "16"))


def add_selection_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--selection-url",
        metavar="URL[,URL...]",
        help="route through a kvrouter select-service (or the replicas of a select-service --cluster) over HTTP "
        "instead of a selection core in this process: the frontend keeps no routing state, any number of them "
        "share the service's",
    )


def selection_urls(args: argparse.Namespace, fleet: FleetOptions, problems: list[str]) -> tuple[str, ...]:
    """The ``--selection-url`` list (empty without the flag); a bad URL or a refused combination in ``problems``."""
    if args.selection_url is None:
        return ()
    parts = [part.strip() for part in args.selection_url.split(",")]
    urls = tuple(part.rstrip("/") for part in parts if part)
    if not urls:
        problems.append("--selection-url is empty; give the selection service's URL(s), http://HOST:PORT[,...]")
    elif len(urls) < len(parts):
        problems.append(
            f"--selection-url={args.selection_url!r} has an empty item; give http://HOST:PORT[,http://HOST:PORT...]"
        )
    for url in urls:
        problem = service_url_problem(url, schemes=HTTP_SCHEMES, port_required=False)
        if problem is not None:
            problems.append(f"--selection-url: {problem}; expected http://HOST:PORT")
    given = [flag for name, flag in SELECTION_ONLY if getattr(args, name) not in (None, False, "")]
    # The model and block size of the --workers: the service's catalog names each worker's (default: not given).
    given.extend(flag for name, flag, default in WORKER_DEFAULTS if getattr(args, name) != default)
    if fleet.enabled:
        given.append("--discovery-backend")
    for flag in given:
        problems.append(
            f"--selection-url does not take {flag}: the selection service chooses the workers (set it there)"
        )
    return urls
