"""Requests derived from a route row, plausible or spoiled, and a raw HTTP/1.1 client to send them.

The client writes the request line and headers byte for byte (an HTTP library would normalise a
percent-encoded path, refuse an odd method or strip an Upgrade header), one connection per request.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlencode

import attrs
import orjson
import trio
from hypothesis import strategies as st

from tests.fuzz.routes import FuzzRoute
from tests.fuzz.strategies import (
    CONTENT_TYPES,
    JUNK_PATHS,
    METHODS,
    NASTY,
    NASTY_STRINGS,
    RAW_BODIES,
    RAW_PARAMS,
    UPGRADE_HEADERS,
    encode,
    path_with,
    spoiled,
    with_repeated_key,
)

JSON = "application/json"
RESPONSE_TIMEOUT = 10.0

# How a request departs from a plausible one (plausible ones build the state the others meet).
SPOILS = [
    *["plausible"] * 8,
    *["body"] * 4,
    *["param"] * 2,
    *["raw body", "content type", "method", "path", "query", "framing", "upgrade", "auth"],
    *["repeat"] * 2,  # a key written twice in the body (a parser keeping the last value reads a plausible body)
]
VALID_TOKEN = "valid"  # FuzzRequest.authorization: the service's own token, whatever it is
# Authorization headers a service with a token must refuse (a service without one ignores them).
BAD_AUTHORIZATION = st.sampled_from(
    [None, "", "Bearer", "Bearer ", "bearer wrong", "Bearer wrong", "Basic dXNlcjpwYXNz", "Bearer " + "x" * 5000]
)


@attrs.frozen
class FuzzRequest:
    method: str
    target: str  # path and query, as sent on the request line
    body: bytes | None
    headers: tuple[tuple[str, str], ...]
    route: FuzzRoute
    spoil: str
    authorization: str | None = VALID_TOKEN  # the header's value; None: no header
    repeated: str | None = None  # "repeat": the key the body's top-level object holds twice

    def describe(self) -> str:
        body = (self.body or b"")[:300]
        return f"{self.method} {self.target[:300]} ({self.spoil}) headers={dict(self.headers)} body={body!r}"


@attrs.frozen
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


def draw_request(route: FuzzRoute, data: st.DataObject, spoils: list[str]) -> FuzzRequest:
    spoil = data.draw(st.sampled_from(spoils), label="spoil")
    repeated: str | None = None
    method = route.method
    params = {name: data.draw(strategy, label=name) for name, strategy in route.params.items()}
    path = path_with(route.path, params)
    query = urlencode(data.draw(route.query)) if route.query is not None else ""
    body: Any = data.draw(route.body, label="body") if route.body is not None else None
    raw: bytes | None = None if body is None else encode(body)
    headers: list[tuple[str, str]] = [("content-type", JSON)] if raw is not None else []
    if spoil == "body":
        raw = encode(spoiled(body, data) if body is not None else data.draw(NASTY))
        headers = [("content-type", JSON)]
    elif spoil == "repeat" and body is not None and (repeat := with_repeated_key(body, data)) is not None:
        raw, repeated = repeat
    elif spoil == "raw body":
        raw = data.draw(RAW_BODIES)
        headers = [("content-type", JSON)]
    elif spoil == "content type":
        content_type = data.draw(CONTENT_TYPES)
        headers = [("content-type", content_type)] if content_type else []
        raw = raw if raw is not None else b"{}"
    elif spoil == "param" and route.params:
        name = data.draw(st.sampled_from(sorted(route.params)))
        value = data.draw(st.one_of(RAW_PARAMS, NASTY_STRINGS.map(lambda text: quote(text, safe=""))))
        path = route.path.replace("{" + name + "}", value)
        path = path_with(path, {k: v for k, v in params.items() if k != name})
    elif spoil == "method":
        method = data.draw(METHODS.filter(lambda m: m != route.method))
    elif spoil == "path":
        path = data.draw(st.one_of(JUNK_PATHS, st.just(path + "/"), st.just(path + "/x"), st.just("/" + path)))
    elif spoil == "query":
        query = data.draw(
            st.sampled_from(
                ["model_name=a&model_name=b", "tenant_id=%zz", "model_name=%C2%B2", "a=b=c", "&&&", "%", "x" * 5000]
            )
        )
    elif spoil == "framing":  # the body in chunks, announced by Expect: 100-continue, or both
        how = data.draw(st.sampled_from(["chunked", "expect", "both"]))
        if how != "expect":
            payload = raw or b""
            cut = data.draw(st.integers(0, len(payload)))
            pieces = [piece for piece in (payload[:cut], payload[cut:]) if piece]
            raw = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n\r\n"
            headers = [*headers, ("transfer-encoding", "chunked")]
        if how != "chunked":
            headers = [*headers, ("expect", "100-continue")]
    elif spoil == "upgrade":
        headers = [*headers, *UPGRADE_HEADERS.items()]
    authorization = data.draw(BAD_AUTHORIZATION) if spoil == "auth" else VALID_TOKEN
    target = f"{path}?{query}" if query else path
    return FuzzRequest(method, target, raw, tuple(headers), route, spoil, authorization, repeated)


def known_request(rows: list[FuzzRoute], method: str, target: str, body: Any) -> FuzzRequest:
    """A fixed request, checked like a generated one against the row of the route it reaches."""
    segments = target.split("?")[0].strip("/").split("/")

    def matches(row: FuzzRoute) -> bool:
        template = row.path.strip("/").split("/")
        return len(template) == len(segments) and all(
            t.startswith("{") or t == part for t, part in zip(template, segments, strict=True)
        )

    row = next((r for r in rows if r.method == method and matches(r)), FuzzRoute(method, target))
    headers = (("content-type", JSON),) if body is not None else ()
    return FuzzRequest(method, target, None if body is None else encode(body), headers, row, "known")


async def send(port: int, request: FuzzRequest, token: str | None) -> RawResponse:
    """Send ``request``, with the service's bearer ``token`` where the request carries a valid one."""
    authorization = f"Bearer {token}" if request.authorization == VALID_TOKEN else request.authorization
    headers = request.headers
    if authorization is not None and (token is not None or request.authorization != VALID_TOKEN):
        headers = (*headers, ("authorization", authorization))
    return await raw_request(port, request.method, request.target, headers, request.body)


async def raw_request(
    port: int, method: str, target: str, headers: tuple[tuple[str, str], ...] = (), body: bytes | None = None
) -> RawResponse:
    lines = [f"{method} {target} HTTP/1.1", "host: 127.0.0.1", "connection: close"]
    lines += [f"{name}: {value}" for name, value in headers]
    if body is not None and all(name != "transfer-encoding" for name, _ in headers):
        lines.append(f"content-length: {len(body)}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    with trio.fail_after(RESPONSE_TIMEOUT):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(head + (body or b""))
            chunks = []
            while chunk := await stream.receive_some(65536):
                chunks.append(chunk)
                if chunks[0].startswith(b"HTTP/1.1 101") and b"\r\n\r\n" in b"".join(chunks):
                    break  # a WebSocket opened (the command stream): its head is the whole answer
    return parse_response(b"".join(chunks), head_only=method == "HEAD")


def parse_response(data: bytes, *, head_only: bool) -> RawResponse:
    while data.startswith(b"HTTP/1.1 100"):  # interim answers to Expect: 100-continue
        data = data.partition(b"\r\n\r\n")[2]
    head, separator, rest = data.partition(b"\r\n\r\n")
    if not separator:
        raise AssertionError(f"no complete response (the server closed the connection): {data[:200]!r}")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", len(rest)))
    return RawResponse(int(status_line.split()[1]), headers, b"" if head_only else rest[:length])
