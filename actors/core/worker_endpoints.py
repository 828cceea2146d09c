"""A worker's HTTP ``endpoint``: checked where it enters the catalog, and against the operator's allow-list. Pure.

The frontend POSTs each client's body to ``endpoint`` + ``/v1/completions`` (or ``/v1/chat/completions``) and
relays the answer, and clients of the selection service do the same with the endpoint a selection names. An
endpoint is therefore an address the service will send prompts to, on behalf of whoever registered it. So it must
be a plain base URL whose path the route is joined to, and nothing that could redirect or rewrite that:

* scheme ``http`` or ``https`` (no ``ftp:``, ``file:``, ``javascript:``, ...);
* no userinfo (``http://user:pw@host``: credentials in a catalog anyone may read, and a classic way to make a URL
  look like it names another host), no query (``?x=`` would swallow the route as a parameter) and no fragment
  (``#`` would drop the route from the request entirely);
* a host that is an IPv4 address, a bracketed IPv6 address (no zone) or an ASCII DNS name (a non-ASCII name must be
  written in its ``xn--`` form, so the name checked is the name connected to); a name whose last label is numeric
  must be a dotted-quad IPv4 address (resolvers read ``2130706433`` or ``127.1`` as 127.0.0.1);
* an optional port 1-65535 and an optional base path of plain characters, without ``.``/``..`` segments or ``//``.

The operator's allow-list (``--worker-endpoint-allow``) names the hosts and networks workers may live on: a DNS name
matches the name exactly (case-insensitive; ``.example.com`` also matches every name under it), a network matches an
IP-address host inside it. Names are not resolved here (no I/O in the core): a name is allowed by being listed.
The list covers the ``tcp://`` hosts of a worker's KV-event and replay endpoints too (the service connects to them);
``ipc://`` and ``inproc://`` stay on this machine.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from typing import Final

import attrs
from xxhash import xxh3_64_intdigest

from kvrouter.actors.core.endpoints import MAX_PORT, InvalidEndpoint, parse_port, parse_zmq_endpoint

HTTP_SCHEMES: Final = ("http", "https")
MAX_ENDPOINT_CHARS: Final = 2048  # a base URL; longer is no worker's address
MAX_HOST_CHARS: Final = 253  # a DNS name's limit (RFC 1035)
MAX_LABEL_CHARS: Final = 63
_LABEL: Final = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]*[A-Za-z0-9_])?", re.ASCII)
_HEX_OR_DIGITS: Final = re.compile(r"(?:0[xX][0-9A-Fa-f]*|[0-9]+)", re.ASCII)
# A base path: unreserved characters and the sub-delimiters RFC 3986 allows in a segment, no percent escapes.
_PATH: Final = re.compile(r"[A-Za-z0-9._~!$&'()*+,;=:@/-]*", re.ASCII)
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@attrs.frozen
class HttpEndpoint:
    """An endpoint that passed ``parse_http_endpoint``: its parts, the host lowercased, brackets removed."""

    scheme: str
    host: str
    port: int | None
    path: str  # "" or a path starting with "/", without a trailing "/"
    address: IpAddress | None = None  # the host as an IP address, when it is one

    def joined(self, route: str) -> str:
        """The path of ``route`` (``/v1/completions``) under this endpoint's base path: joined, never replaced."""
        return self.path + route


def parse_http_endpoint(text: str) -> HttpEndpoint:
    """``text`` as a worker's base URL; raise InvalidEndpoint saying what is wrong (the message quotes a prefix of
    the text only: it goes back to the client and into logs)."""
    shown = _shown(text)
    if len(text) > MAX_ENDPOINT_CHARS:
        raise InvalidEndpoint(f"{shown} is longer than {MAX_ENDPOINT_CHARS} characters")
    if not text.isascii():
        raise InvalidEndpoint(f"{shown} has non-ASCII characters; write a host name in its xn-- (IDNA) form")
    if any(not 0x21 <= ord(char) <= 0x7E for char in text):
        raise InvalidEndpoint(f"{shown} has spaces or control characters")
    scheme, separator, rest = text.partition("://")
    if not separator or scheme.lower() not in HTTP_SCHEMES:
        raise InvalidEndpoint(f"{shown} is not an http:// or https:// URL")
    for char, what in (("#", "a fragment (#)"), ("?", "a query (?)"), ("\\", "a backslash")):
        if char in rest:
            raise InvalidEndpoint(f"{shown} has {what}; give the worker's base URL only")
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        raise InvalidEndpoint(f"{shown} has user information (user@ or user:password@); give the host only")
    host_text, port = _host_and_port(authority, shown)
    host, address = _host(host_text, shown)
    return HttpEndpoint(scheme.lower(), host, port, _path(slash + path, shown), address)


def http_endpoint_problem(text: str | None) -> str | None:
    """Why ``text`` cannot be a worker's endpoint, or None (None and "" mean "no endpoint": the record is then
    incomplete, as in 1.6.1, which is not an error)."""
    if not text:
        return None
    try:
        parse_http_endpoint(text)
    except InvalidEndpoint as exc:
        return str(exc)
    return None


def service_url_problem(text: str, *, schemes: tuple[str, ...] = ("http",), port_required: bool = True) -> str | None:
    """Why ``text`` cannot be the base URL of a kvrouter service (``http://HOST:PORT``, where routes are joined
    on), or None: a worker endpoint's rules, and no path besides a lone ``/`` (a path would be silently dropped or
    joined differently by each caller), a scheme among ``schemes`` and, if ``port_required``, a port."""
    shown = _shown(text)
    if text.partition("://")[0].lower() not in schemes or "://" not in text:
        plain = " (kvrouter serves plain HTTP)" if schemes == ("http",) else ""
        return f"{shown} is not an {' or '.join(f'{scheme}://' for scheme in schemes)} URL{plain}"
    try:
        endpoint = parse_http_endpoint(text)
    except InvalidEndpoint as exc:
        return str(exc).replace("the worker's base URL only", "the scheme, host and port only")
    if endpoint.path:
        return f"{shown} has a path ({endpoint.path[:40]}); give the scheme, host and port only"
    if port_required and endpoint.port is None:
        return f"{shown} has no port; give the port the service listens on"
    return None


def _shown(text: str) -> str:
    return f"`{text[:80]}...`" if len(text) > 80 else f"`{text}`"


def _host_and_port(authority: str, shown: str) -> tuple[str, int | None]:
    if authority.startswith("["):
        end = authority.find("]")
        if end < 0:
            raise InvalidEndpoint(f"{shown} has an unclosed [IPv6] host")
        host, after = authority[: end + 1], authority[end + 1 :]
        if after and not after.startswith(":"):
            raise InvalidEndpoint(f"{shown} has characters after its [IPv6] host")
        port_text = after[1:] if after else None
    else:
        host, colon, rest = authority.partition(":")
        port_text = rest if colon else None
    if port_text is None:
        return host, None
    port = parse_port(port_text)
    if port is None:
        raise InvalidEndpoint(f"{shown} has an invalid port `{port_text[:20]}` (expected 1-{MAX_PORT} in digits)")
    return host, port


def _host(host: str, shown: str) -> tuple[str, IpAddress | None]:
    """The host lowercased, and its address when it is an IP literal."""
    if not host:
        raise InvalidEndpoint(f"{shown} has no host")
    if host.startswith("["):
        inner = host[1:-1]
        if "%" in inner:
            raise InvalidEndpoint(f"{shown} has an IPv6 zone (%); give the address alone")
        try:
            v6 = ipaddress.IPv6Address(inner)
        except ValueError:
            raise InvalidEndpoint(f"{shown} has an invalid IPv6 host `{host}`") from None
        return str(v6), v6
    name = host.lower()
    if name.endswith("."):
        name = name[:-1]  # the root label: "w." is "w"
    labels = name.split(".")
    if len(name) > MAX_HOST_CHARS or not all(
        len(label) <= MAX_LABEL_CHARS and _LABEL.fullmatch(label) for label in labels
    ):
        raise InvalidEndpoint(
            f"{shown} has an invalid host `{host}` (expected a DNS name, an IPv4 or an [IPv6] address)"
        )
    if _HEX_OR_DIGITS.fullmatch(labels[-1]):
        # No top-level domain is numeric: resolvers would read the name as an address in some shorthand.
        try:
            v4 = ipaddress.IPv4Address(name)
        except ValueError:
            raise InvalidEndpoint(f"{shown} has a host `{host}` that is not a dotted-quad IPv4 address") from None
        return str(v4), v4
    return name, None


def _path(path: str, shown: str) -> str:
    if not _PATH.fullmatch(path):
        raise InvalidEndpoint(f"{shown} has characters its path may not hold (percent escapes included)")
    trimmed = path.rstrip("/")
    if "//" in trimmed:
        raise InvalidEndpoint(f"{shown} has an empty path segment (//)")
    if any(segment in (".", "..") for segment in trimmed.split("/")):
        raise InvalidEndpoint(f"{shown} has a . or .. path segment")
    return trimmed


# -- the operator's allow-list -------------------------------------------------------------------------------------


@attrs.frozen
class EndpointAllowList:
    """The hosts and networks worker endpoints may name (``--worker-endpoint-allow``); ``None`` in a config means
    every host is allowed (the default)."""

    names: frozenset[str] = frozenset()  # exact names, lowercased
    suffixes: tuple[str, ...] = ()  # ".example.com": any name under example.com
    networks: tuple[IpNetwork, ...] = ()
    entries: tuple[str, ...] = ()  # as the operator wrote them, for messages

    def allows(self, endpoint: HttpEndpoint) -> bool:
        return self._allows(endpoint.host, endpoint.address)

    def allows_host(self, host: str) -> bool:
        """Whether a host as written in a ZMQ endpoint (a name or an address, no brackets) is allowed."""
        try:
            address: IpAddress | None = ipaddress.ip_address(host)
        except ValueError:
            address = None
        return self._allows(host.lower().rstrip("."), address)

    def _allows(self, host: str, address: IpAddress | None) -> bool:
        if address is not None:
            address = _unmapped(address)
            return any(address.version == net.version and address in net for net in self.networks)
        return host in self.names or any(host.endswith(suffix) for suffix in self.suffixes)

    def describe(self) -> str:
        return ", ".join(self.entries)


def parse_allow_list(values: Iterable[str]) -> EndpointAllowList:
    """The allow-list from ``--worker-endpoint-allow`` values (each a comma-separated list of hosts, ``.domain``
    suffixes, IP addresses or CIDR networks); raise ValueError naming the first bad entry."""
    names: set[str] = set()
    suffixes: list[str] = []
    networks: list[IpNetwork] = []
    entries: list[str] = []
    for value in values:
        for raw in value.split(","):
            entry = raw.strip()
            if not entry:
                continue
            entries.append(entry)
            network = _network(entry)
            if network is not None:
                networks.append(network)
                continue
            suffix = entry.startswith(".")
            try:
                _, address = _host(entry[1:] if suffix else entry, f"`{entry}`")
            except InvalidEndpoint:
                raise ValueError(f"`{entry}` is not a host name, .domain, IP address or CIDR network") from None
            if address is not None:  # a numeric name normalised to an address: match it as one
                networks.append(ipaddress.ip_network(address))
            elif suffix:
                suffixes.append("." + entry[1:].lower().rstrip("."))
            else:
                names.add(entry.lower().rstrip("."))
    if not entries:
        raise ValueError("no host or network given")
    return EndpointAllowList(frozenset(names), tuple(suffixes), tuple(networks), tuple(entries))


def _network(entry: str) -> IpNetwork | None:
    """``entry`` as an IP address or CIDR network (host bits set are refused: ``10.0.0.1/8`` is likely a typo)."""
    text = entry[1:-1] if entry.startswith("[") and entry.endswith("]") else entry
    try:
        ipaddress.ip_address(text.partition("/")[0])
    except ValueError:
        return None  # not an address: a host name, or nothing (refused there)
    try:
        network = ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        raise ValueError(f"`{entry}` is not a CIDR network ({exc})") from None
    if isinstance(network, ipaddress.IPv6Network) and network.network_address.ipv4_mapped is not None:
        mapped = network.network_address.ipv4_mapped
        return ipaddress.IPv4Network((mapped, max(0, network.prefixlen - 96)))
    return network


def _unmapped(address: IpAddress) -> IpAddress:
    """``::ffff:10.0.0.1`` is 10.0.0.1: matched against IPv4 networks, so the mapped form allows nothing more."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def allow_list_problem(field: str, endpoint: str | None, allow: EndpointAllowList | None) -> str | None:
    """Why ``allow`` refuses the HTTP ``endpoint`` (a valid one, or none), or None."""
    if allow is None or not endpoint:
        return None
    try:
        parsed = parse_http_endpoint(endpoint)
    except InvalidEndpoint as exc:
        return f"{field}: {exc}"
    return None if allow.allows(parsed) else _not_allowed(field, parsed.host, allow)


def zmq_allow_list_problem(field: str, endpoint: str | None, allow: EndpointAllowList | None) -> str | None:
    """Why ``allow`` refuses a tcp:// ZMQ ``endpoint`` (ipc:// and inproc:// stay on this machine: not checked)."""
    if allow is None or not endpoint:
        return None
    try:
        parsed = parse_zmq_endpoint(endpoint)
    except InvalidEndpoint as exc:
        return f"{field}: {exc}"
    if parsed.host is None or allow.allows_host(parsed.host):
        return None
    return _not_allowed(field, parsed.host, allow)


def _not_allowed(field: str, host: str, allow: EndpointAllowList) -> str:
    return (
        f"{field}: host `{host}` is not in the operator's allow-list of worker hosts "
        f"(--worker-endpoint-allow {allow.describe()})"
    )


def default_worker_id(endpoint: str) -> int:
    """A stable worker id per advertised endpoint, below 2**63 (some clients read ids as signed): what the mock
    worker registers under, and what the frontend and discovery give a worker that names none."""
    return xxh3_64_intdigest(endpoint.encode()) >> 1
