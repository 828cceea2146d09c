"""Turn a configured ZMQ connect endpoint into one zmq can connect to without asking DNS.

Given ``tcp://host:port``, libzmq resolves ``host`` itself, in its one I/O thread (which serves
every socket of the process), on every reconnect attempt: every 50 ms for a listener, and a name
that does not resolve just retries silently forever. So we resolve here, in a worker thread, and
hand zmq the numeric address: a resolver failure becomes an error the listener can report, and a
slow DNS server stalls one listener instead of all zmq traffic.

Endpoints that need no resolving (numeric hosts, ``ipc://``, ``inproc://``, zmq's
``tcp://source;destination`` form) are passed through unchanged.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Awaitable, Callable
from typing import Final

import attrs
import trio

from kvrouter.actors.core.endpoints import InvalidEndpoint, parse_zmq_endpoint

# Lookups in flight at once, process-wide: their own limiter, so a slow resolver can never occupy
# trio's default thread pool (the journal's fsyncs run there).
RESOLVER_THREADS: Final = 4

_LIMITER: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("kv_resolver_limiter")

# (host, port) -> getaddrinfo-style results; injectable so tests can make a name fail, then resolve.
Resolver = Callable[[str, int], Awaitable[list[tuple[int, str]]]]


class EndpointError(InvalidEndpoint):
    """The endpoint can never work (malformed); retrying will not help."""


class ResolveError(Exception):
    """The host did not resolve now; it may later (DNS not yet updated, host not yet up)."""


@attrs.frozen
class ConnectTarget:
    """A connect endpoint split for resolving: ``host`` is None when there is nothing to resolve."""

    endpoint: str
    host: str | None = None
    port: int = 0


@attrs.frozen
class Resolved:
    """What to pass to ``connect``; ``ipv6`` says the socket needs ``zmq.IPV6`` set first."""

    endpoint: str
    ipv6: bool = False


def parse_connect_endpoint(endpoint: str) -> ConnectTarget:
    """Split ``tcp://host:port``; raise EndpointError for an endpoint zmq could never connect to.

    The catalog refuses such endpoints when a worker registers (``actors/core/endpoints.py``); this
    check is for endpoints from elsewhere (tests, a journal written before that check existed).
    """
    try:
        parsed = parse_zmq_endpoint(endpoint)
    except InvalidEndpoint as exc:
        raise EndpointError(str(exc)) from None
    if parsed.host is None or ";" in endpoint:
        return ConnectTarget(endpoint)  # ipc, inproc, or zmq's tcp://source;destination: left to zmq
    try:
        ipaddress.ip_address(parsed.host)
    except ValueError:
        return ConnectTarget(endpoint, parsed.host, parsed.port or 0)
    return ConnectTarget(endpoint)  # numeric already


async def resolve(target: ConnectTarget, resolver: Resolver | None = None) -> Resolved:
    """The endpoint with its host replaced by an address (IPv4 preferred, as zmq does by default).

    Raises ResolveError, with the resolver's reason, when the name does not resolve now.
    """
    if target.host is None:
        return Resolved(target.endpoint, ipv6=target.endpoint.startswith("tcp://["))
    try:
        addresses = await (resolver or _system_resolver)(target.host, target.port)
    except OSError as exc:
        raise ResolveError(f"cannot resolve host `{target.host}`: {exc.strerror or exc}") from None
    for family in (socket.AF_INET, socket.AF_INET6):
        for found_family, address in addresses:
            if found_family == family:
                if family == socket.AF_INET6:
                    return Resolved(f"tcp://[{address}]:{target.port}", ipv6=True)
                return Resolved(f"tcp://{address}:{target.port}")
    raise ResolveError(f"cannot resolve host `{target.host}`: no IPv4 or IPv6 address")


async def _system_resolver(host: str, port: int) -> list[tuple[int, str]]:
    """getaddrinfo in a worker thread of our own limiter (abandoned, not waited for, on cancel)."""
    infos = await trio.to_thread.run_sync(
        socket.getaddrinfo, host, port, 0, socket.SOCK_STREAM, limiter=_limiter(), abandon_on_cancel=True
    )
    return [(int(family), str(sockaddr[0])) for family, _type, _proto, _name, sockaddr in infos]


def _limiter() -> trio.CapacityLimiter:
    try:
        return _LIMITER.get()
    except LookupError:
        limiter = trio.CapacityLimiter(RESOLVER_THREADS)
        _LIMITER.set(limiter)
        return limiter
