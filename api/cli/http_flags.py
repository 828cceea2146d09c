"""Command-line flags of the HTTP front, shared by the services and the frontend: authentication (and serving
without it), client limits, shutdown."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

from kvrouter.actors.core.router_config import parse_float, parse_int
from kvrouter.api.http.auth import TOKEN_FILE_ENV, BearerToken, TokenFileError, readable_by_others
from kvrouter.api.http.server import HttpSettings
from kvrouter.api.process.exposure import add_insecure_flag, exposure_problem

DEFAULTS = HttpSettings()
MIN_SECONDS = 0.001
MAX_SECONDS = 86_400.0
MAX_CONNECTIONS = 1_000_000


def add_http_flags(parser: argparse.ArgumentParser) -> None:
    front = parser.add_argument_group("HTTP front (see README, Running it safely)")
    front.add_argument(
        "--auth-token-file",
        metavar="FILE",
        help=f"require `Authorization: Bearer <token>` on every route but GET /health, the token being this "
        f"file's text (default: ${TOKEN_FILE_ENV}, else no authentication)",
    )
    add_insecure_flag(front, "without --auth-token-file")
    front.add_argument(
        "--http-idle-timeout-secs",
        metavar="S",
        help=f"close a connection that has not sent a complete request head S seconds after it opened or after "
        f"its last response: slow headers and idle keep-alive (default {DEFAULTS.idle_timeout:g})",
    )
    front.add_argument(
        "--http-body-timeout-secs",
        metavar="S",
        help=f"a request body must arrive within S seconds (408 otherwise), and a connection silent for S seconds "
        f"is closed (default {DEFAULTS.body_timeout:g})",
    )
    front.add_argument(
        "--http-write-timeout-secs",
        metavar="S",
        help=f"close a connection whose client takes no bytes of its response for S seconds: a client that "
        f"sends requests but does not read the answers (default {DEFAULTS.write_timeout:g})",
    )
    front.add_argument(
        "--http-max-connections",
        metavar="N",
        help=f"open HTTP connections; newer ones get 503 and are closed (default {DEFAULTS.max_connections})",
    )
    front.add_argument(
        "--shutdown-grace-secs",
        metavar="S",
        help=f"on SIGTERM/SIGINT, time in-flight requests get to be answered before they are cut "
        f"(default {DEFAULTS.shutdown_grace:g})",
    )


def http_options(
    args: argparse.Namespace, env: Mapping[str, str], problems: list[str], warnings: list[str]
) -> tuple[HttpSettings, BearerToken | None]:
    """The front's settings from ``args`` (and the token file from ``env``); bad values go to ``problems``."""
    settings = HttpSettings(
        idle_timeout=_seconds(args.http_idle_timeout_secs, "--http-idle-timeout-secs", DEFAULTS.idle_timeout, problems),
        body_timeout=_seconds(args.http_body_timeout_secs, "--http-body-timeout-secs", DEFAULTS.body_timeout, problems),
        max_connections=_count(args.http_max_connections, "--http-max-connections", problems),
        write_timeout=_seconds(
            args.http_write_timeout_secs, "--http-write-timeout-secs", DEFAULTS.write_timeout, problems
        ),
        shutdown_grace=_seconds(args.shutdown_grace_secs, "--shutdown-grace-secs", DEFAULTS.shutdown_grace, problems),
    )
    return settings, _token(args, env, problems, warnings)


def check_exposure(
    host: str, auth: BearerToken | None, args: argparse.Namespace, problems: list[str], warnings: list[str]
) -> None:
    """A bind other than loopback without a token needs ``--insecure-no-auth`` (then one warning)."""
    problem, warning = exposure_problem(host, auth is not None, bool(args.insecure_no_auth))
    if problem is not None:
        problems.append(problem)
    if warning is not None:
        warnings.append(warning)


def _seconds(raw: str | None, flag: str, default: float, problems: list[str]) -> float:
    if raw is None:
        return default
    value = parse_float(flag, raw, MIN_SECONDS, MAX_SECONDS, problems)
    return value if value is not None else default


def _count(raw: str | None, flag: str, problems: list[str]) -> int:
    if raw is None:
        return DEFAULTS.max_connections
    value = parse_int(flag, raw, 1, MAX_CONNECTIONS, problems)
    return value if value is not None else DEFAULTS.max_connections


def _token(
    args: argparse.Namespace, env: Mapping[str, str], problems: list[str], warnings: list[str]
) -> BearerToken | None:
    if args.auth_token_file is not None:
        raw, source = args.auth_token_file, "--auth-token-file"
    elif env.get(TOKEN_FILE_ENV):
        raw, source = env[TOKEN_FILE_ENV], TOKEN_FILE_ENV
    else:
        return None
    if raw == "":
        problems.append(f"{source}='' is empty; pass the path of a file holding the token")
        return None
    path = Path(raw)
    try:
        token = BearerToken.from_file(path, source)
    except TokenFileError as exc:
        problems.append(str(exc))
        return None
    if readable_by_others(path):
        warnings.append(f"{source}={raw!r} is readable by other users; restrict it (chmod 600 {raw})")
    return token
