"""ZMQ connect endpoints, TCP ports and decimal keys, checked once where they enter. Pure.

A worker's KV-event and replay endpoints are client input that the service hands to libzmq on every
start. One that can never work must be refused when it arrives, not discovered at each restart:
``"²".isdigit()`` is true but ``int("²")`` raises, so "digits" here means ASCII digits only.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Final

import attrs

SCHEMES: Final = ("tcp", "ipc", "inproc")
MAX_PORT: Final = 65535
# A host name as zmq's resolver takes it: letters, digits, dots, hyphens, underscores.
_HOST_NAME: Final = re.compile(r"[A-Za-z0-9_.-]+")
# More digits than any u64 needs (leading zeros included) is refused before int() sees it: int() of
# 4,301+ digits raises ValueError in CPython, and a few hundred already cost time.
MAX_DECIMAL_DIGITS: Final = 20


class InvalidEndpoint(ValueError):
    """An endpoint zmq could never connect to; the message says why."""


def parse_decimal(text: str, maximum: int) -> int | None:
    """``text`` as a non-negative integer <= ``maximum`` if it is ASCII digits only, else None."""
    if not text or len(text) > MAX_DECIMAL_DIGITS or not (text.isascii() and text.isdigit()):
        return None
    value = int(text)
    return value if value <= maximum else None


def parse_port(text: str) -> int | None:
    """A TCP port, 1-65535, written in ASCII digits; None otherwise."""
    port = parse_decimal(text, MAX_PORT)
    return port if port else None


@attrs.frozen
class ZmqEndpoint:
    """A connect endpoint that passed ``parse_zmq_endpoint``; ``port`` is set for tcp only."""

    text: str
    scheme: str
    host: str | None = None  # tcp: the (destination) host, brackets removed
    port: int | None = None  # tcp: the (destination) port

    def with_port_offset(self, offset: int) -> str | None:
        """The same endpoint ``offset`` ports further on (vLLM's per-rank replay ports); None when it
        has no port or the port would leave 1-65535."""
        if self.port is None or not 0 < self.port + offset <= MAX_PORT:
            return None
        head, _, _ = self.text.rpartition(":")
        return f"{head}:{self.port + offset}"


def parse_zmq_endpoint(text: str) -> ZmqEndpoint:
    """Check ``text`` as ``tcp://host:port`` (``tcp://source;host:port`` too), ``ipc://path`` or
    ``inproc://name``; raise InvalidEndpoint saying what is wrong."""
    scheme, separator, address = text.partition("://")
    if not separator:
        raise InvalidEndpoint(f"`{text}` is not a ZMQ endpoint (expected tcp://host:port)")
    if scheme not in SCHEMES:
        raise InvalidEndpoint(
            f"`{text}` has an unsupported transport `{scheme}` (expected one of {', '.join(SCHEMES)})"
        )
    if not address:
        raise InvalidEndpoint(f"`{text}` has no address")
    if "\x00" in address:
        raise InvalidEndpoint(f"`{text}` contains a NUL character")
    if scheme != "tcp":
        return ZmqEndpoint(text, scheme)
    destination = address.rpartition(";")[2]  # zmq's tcp://source;destination
    host, separator, port_text = destination.rpartition(":")
    if not separator or not host:
        raise InvalidEndpoint(f"`{text}` has no host:port")
    port = parse_port(port_text)
    if port is None:
        raise InvalidEndpoint(f"`{text}` has an invalid port `{port_text}` (expected 1-{MAX_PORT} in ASCII digits)")
    if host.startswith("["):
        if not host.endswith("]") or not _is_ipv6(host[1:-1]):
            raise InvalidEndpoint(f"`{text}` has an invalid IPv6 host `{host}`")
        host = host[1:-1]
    elif not _HOST_NAME.fullmatch(host):
        raise InvalidEndpoint(f"`{text}` has an invalid host `{host}` (expected a name, an IPv4 or an [IPv6] address)")
    return ZmqEndpoint(text, scheme, host, port)


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True
