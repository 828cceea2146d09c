"""Who can reach a service, and where it may send prompts: the flags that close both, checked before anything binds.

* A service bound to an address other than loopback, without a bearer token, lets anyone who reaches its port
  register workers (and so choose where prompts go), read every catalog and load, and drive every lifecycle. It
  starts like that only when the operator says so (``--insecure-no-auth``), with one warning line.
* ``--worker-endpoint-allow`` names the hosts and networks worker endpoints may name
  (``actors/core/worker_endpoints.py``); without it, any host is allowed.

See docs/running-safely.md, "Worker endpoints and exposure".
"""

from __future__ import annotations

import ipaddress
from typing import Any, Protocol

from kvrouter.actors.core.worker_endpoints import EndpointAllowList, parse_allow_list

INSECURE_NO_AUTH = "--insecure-no-auth"
WORKER_ENDPOINT_ALLOW = "--worker-endpoint-allow"
LOOPBACK_NAMES = frozenset({"localhost"})


class ArgumentHolder(Protocol):
    """A parser or an argument group."""

    def add_argument(self, *args: Any, **kwargs: Any) -> Any: ...


def add_insecure_flag(parser: ArgumentHolder, what: str) -> None:
    parser.add_argument(
        INSECURE_NO_AUTH,
        action="store_true",
        help=f"serve on a --host other than loopback (127.0.0.1, ::1, localhost) {what}: refused without this "
        "flag, one warning line with it",
    )


def add_worker_endpoint_flag(parser: ArgumentHolder) -> None:
    parser.add_argument(
        WORKER_ENDPOINT_ALLOW,
        metavar="HOST|CIDR[,...]",
        action="append",
        help="the only hosts worker endpoints may name: DNS names (.example.com: any name under it), IP "
        "addresses or CIDR networks, comma-separated or repeated; a registration naming another host is a 400, "
        "and the frontend does not forward to it (default: any host)",
    )


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only: a loopback address, or ``localhost``. Any other name
    counts as reachable from elsewhere (it is not resolved here)."""
    text = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if text.lower().rstrip(".") in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        return False


def exposure_problem(host: str, authenticated: bool, insecure: bool) -> tuple[str | None, str | None]:
    """(a problem that stops the start, a warning to log): a non-loopback bind needs a token or
    ``--insecure-no-auth``."""
    if authenticated or is_loopback(host):
        return None, None
    if insecure:
        return None, (
            f"{INSECURE_NO_AUTH}: serving on --host {host} without authentication: anyone who reaches it can read "
            "and change all its state"
        )
    return (
        f"--host {host} is reachable from other machines and no --auth-token-file (or $KVROUTER_AUTH_TOKEN_FILE) "
        "is set: anyone reaching it could read and change all its state (on a selection service or frontend, "
        "register workers and so choose where prompts go); give a token file, bind 127.0.0.1, or pass "
        f"{INSECURE_NO_AUTH} to serve without authentication"
    ), None


def worker_endpoint_allow(values: list[str] | None, problems: list[str]) -> EndpointAllowList | None:
    """The allow-list the ``--worker-endpoint-allow`` values give (None: none given, any host); a bad entry goes
    to ``problems``."""
    if not values:
        return None
    try:
        return parse_allow_list(values)
    except ValueError as exc:
        problems.append(f"{WORKER_ENDPOINT_ALLOW}: {exc}")
        return None
