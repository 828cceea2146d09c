"""The raw ASGI application: route lookup, authentication, body limits, content types, error mapping.

No domain logic lives here; handlers come from a route table (``api/routes/slot_tracker.py``). Each response
goes out as one ``http.response.body`` message with its content-length (head and body in one write
under kvrouter's server: ``send_whole_response``), and nothing on this path
starts tasks or opens cancel scopes (each costs 10-30 µs per request here); the per-request log line
is only formatted when debug logging is on.

A response sent before the request's body was read (401, 404, 405, 413, 415, 408) carries
``Connection: close``: hypercorn closes such a connection after the response, and a keep-alive client
must know not to send its next request on it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from time import perf_counter
from typing import Any
from urllib.parse import quote, unquote_to_bytes

import trio

from kvrouter.actors.core.ownership.forwarding import FORWARDED_HEADER as _FORWARDED
from kvrouter.actors.mailbox import Overloaded
from kvrouter.api.http import JSON, HttpError, Request, Response, Route, error_response, release
from kvrouter.api.http.auth import BearerToken
from kvrouter.api.http.h1_connection import send_whole_response
from kvrouter.api.routes.metrics import UNMATCHED, MetricsEndpoint, method_label

log = logging.getLogger("kvrouter.api")
request_log = logging.getLogger("kvrouter.api.requests")  # one line per request, at debug

ASGIScope = dict[str, Any]
UNSUPPORTED_MEDIA = "Expected request with `Content-Type: application/json`"
BODY_TOO_LARGE = "Failed to buffer the request body: length limit exceeded"
WEBSOCKET_REFUSED = "this route does not accept WebSocket connections; send a plain HTTP request"
CONNECTION_CLOSE = (b"connection", b"close")
OPEN_PATH = b"/health"  # GET/HEAD /health answers without the token (liveness probes)


class RouteTable:
    """Routes matched on the raw, percent-encoded path, one segment at a time.

    Splitting comes before decoding, so a ``%2F`` inside an id stays part of that id (``DELETE
    /reservations/a%2Fb`` reaches reservation ``a/b``) and ids that can be booked can be addressed.
    An empty segment is an empty id (``DELETE /reservations/`` reaches reservation ``""``), so every
    id a body can name is reachable; literal segments never match an empty one (``/health/`` is 404).
    """

    def __init__(self, routes: Iterable[Route]) -> None:
        # Literal paths by their raw bytes: the common case is one dict lookup, no decoding.
        self.exact: dict[bytes, dict[str, Route]] = {}
        self.by_segments: dict[tuple[str, ...], dict[str, Route]] = {}
        self.patterns: list[tuple[tuple[str, ...], dict[str, Route]]] = []
        for route in routes:
            segments = tuple(route.path.removeprefix("/").split("/"))
            if "{" in route.path:
                for known, methods in self.patterns:
                    if known == segments:
                        methods[route.method] = route
                        break
                else:
                    self.patterns.append((segments, {route.method: route}))
            else:
                methods = self.by_segments.setdefault(segments, {})
                methods[route.method] = route
                self.exact[route.path.encode()] = methods

    def lookup(self, raw_path: bytes) -> tuple[dict[str, Route], dict[str, str]] | None:
        """The methods at ``raw_path`` and its decoded path parameters; None: no such route.

        Raises ``HttpError(400)`` for a segment that is not percent-encoded UTF-8.
        """
        methods = self.exact.get(raw_path)
        if methods is not None:
            return methods, {}
        parts = split_path(raw_path)
        if parts is None:
            return None
        methods = self.by_segments.get(parts)
        if methods is not None:
            return methods, {}
        for segments, methods in self.patterns:
            if len(segments) != len(parts):
                continue
            params = {}
            for pattern, part in zip(segments, parts, strict=True):
                if pattern.startswith("{"):
                    params[pattern[1:-1]] = part
                elif pattern != part:
                    break
            else:
                return methods, params
        return None


def split_path(raw_path: bytes) -> tuple[str, ...] | None:
    """The decoded segments of an origin-form path (``/a/b%2Fc`` -> ``("a", "b/c")``); None otherwise."""
    if not raw_path.startswith(b"/"):
        return None  # "*", or an absolute URI: no route has that form
    try:
        return tuple(unquote_to_bytes(part).decode("utf-8") for part in raw_path[1:].split(b"/"))
    except UnicodeDecodeError:
        raise HttpError(400, "Invalid URL: the path is not percent-encoded UTF-8") from None


def raw_path_of(scope: ASGIScope) -> bytes:
    """The path as the client sent it (ASGI ``raw_path`` is optional: rebuild it from ``path`` if absent)."""
    raw = scope.get("raw_path")
    return raw if raw is not None else quote(scope["path"]).encode("ascii")


def _is_json(content_type: bytes | None) -> bool:
    if content_type is None:
        return False
    # Leading blanks are tolerated, a blank before ";" is not (as axum's check).
    mime = content_type.split(b";", 1)[0].lstrip().lower()
    return mime == b"application/json" or (mime.startswith(b"application/") and mime.endswith(b"+json"))


FORWARDED_HEADER = _FORWARDED.encode()


class _Headers:
    """The request headers the app reads, found in one pass (names arrive lower-cased)."""

    __slots__ = ("authorization", "content_length", "content_type", "forwarded", "has_body")

    def __init__(self, raw: Iterable[tuple[bytes, bytes]]) -> None:
        # FORWARDED_HEADER, unchecked: a cluster replica passed this request on to its scope's owner, naming itself
        self.forwarded: str | None = None
        self.content_type: bytes | None = None
        self.content_length: int | None = None
        self.authorization: bytes | None = None
        self.has_body = False
        authorizations = 0
        for name, value in raw:
            if name == b"content-type":
                self.content_type = value
            elif name == b"content-length":
                self.content_length = int(value) if value.isdigit() else None  # h11 has checked it
                self.has_body = self.has_body or self.content_length != 0
            elif name == b"transfer-encoding":
                self.has_body = True
            elif name == b"authorization":
                self.authorization = value
                authorizations += 1
            elif name == FORWARDED_HEADER:
                # Sent twice, it names no one sender: the two values together name no member, and are refused.
                text = value.decode("latin-1")
                self.forwarded = text if self.forwarded is None else f"{self.forwarded}, {text}"
        if authorizations > 1:
            self.authorization = None  # ambiguous: treated as absent


def make_app(
    routes: Iterable[Route],
    *,
    body_limit: int,
    body_timeout: float | None = None,
    auth: BearerToken | None = None,
    stopping: trio.Event | None = None,
) -> Any:
    """The ASGI app serving ``routes``.

    ``body_timeout``: seconds a request body may take to arrive in full, counted from the app's first
    read (a trickling client gets 408; a silent one is hypercorn's read timeout). ``auth``: every route
    but ``GET /health`` requires this bearer token. ``stopping``: set when the service starts to stop
    (WebSocket routes hear of it and close their connections). A ``GET /metrics`` route in ``routes`` gets
    every HTTP request counted into its ``FrontMetrics`` (method, route template, status, time to respond).
    """
    return ServiceApp(list(routes), body_limit, body_timeout, auth, stopping)


class ServiceApp:
    """The ASGI app of a service's routes (``make_app``)."""

    def __init__(
        self,
        routes: list[Route],
        body_limit: int,
        body_timeout: float | None,
        auth: BearerToken | None,
        stopping: trio.Event | None,
    ) -> None:
        self.table = RouteTable(routes)
        self.open_methods = self.table.exact.get(OPEN_PATH)
        endpoint = next((r.handler for r in routes if isinstance(r.handler, MetricsEndpoint)), None)
        self.requests = endpoint.front.requests if endpoint is not None else None
        self.body_limit = body_limit
        self.body_timeout = body_timeout
        self.auth = auth
        self.stopping = stopping

    async def __call__(self, scope: ASGIScope, receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind == "http":
            started = perf_counter() if self.requests is not None or request_log.isEnabledFor(logging.DEBUG) else None
            response, body_unread, template = await self._respond(scope, receive)
            headers = [(b"content-length", str(len(response.body)).encode())]
            if response.content_type is not None:
                headers.append((b"content-type", response.content_type))
            headers.extend(response.headers)
            if body_unread:
                headers.append(CONNECTION_CLOSE)
            if started is not None:
                # Before sending: counted and logged by the time the client reads the answer.
                if self.requests is not None:
                    self.requests.record(
                        method_label(scope["method"]), template, response.status, perf_counter() - started
                    )
                if request_log.isEnabledFor(logging.DEBUG):
                    _log_request(scope, response.status, started)
            # HEAD: same headers (content-length included), no body.
            body = b"" if scope["method"] == "HEAD" else response.body
            await send_whole_response(
                send,
                {"type": "http.response.start", "status": response.status, "headers": headers},
                {"type": "http.response.body", "body": body},
            )
        elif kind == "websocket":
            await self._websocket(scope, receive, send)
        elif kind == "lifespan":
            # The actor system lives in the outer nursery, not in lifespan; just answer.
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    def _route(self, scope: ASGIScope, method: str, headers: _Headers) -> tuple[Route, dict[str, str]] | Response:
        """The route and its path parameters, or the response refusing the request (bad path or token,
        unknown route, wrong method). The token is checked before revealing whether a route exists."""
        try:
            found = self.table.lookup(raw_path_of(scope))
        except HttpError as exc:
            return error_response(exc.status, exc.message)
        if self.auth is not None and not self.auth.admits(headers.authorization):
            public = found is not None and found[0] is self.open_methods and method in ("GET", "HEAD")
            if not public:
                return self.auth.refusal(headers.authorization)
        if found is None:
            return error_response(404, "route not found")
        methods, params = found
        route = methods.get(method) or (methods.get("GET") if method == "HEAD" else None)
        if route is None:
            allowed = ",".join([*methods, "HEAD"] if "GET" in methods else methods)
            return error_response(405, "method not allowed", ((b"allow", allowed.encode()),))
        return route, params

    async def _respond(self, scope: ASGIScope, receive: Any) -> tuple[Response, bool, str]:
        """The response, whether the request body was left unread (then the connection closes), and the
        route's template (``unmatched`` if refused before a route was chosen)."""
        headers = _Headers(scope["headers"])
        body_unread = headers.has_body
        method = scope["method"]
        found = self._route(scope, method, headers)
        if isinstance(found, Response):
            return found, body_unread, UNMATCHED
        route, params = found
        response, body_unread = await self._answer(scope, receive, headers, route, params)
        return response, body_unread, route.path

    async def _answer(
        self, scope: ASGIScope, receive: Any, headers: _Headers, route: Route, params: dict[str, str]
    ) -> tuple[Response, bool]:
        body_unread = headers.has_body
        method = scope["method"]
        try:
            body = b""
            if route.json_body or route.optional_body or (route.json_body_if_typed and _is_json(headers.content_type)):
                if route.json_body and not _is_json(headers.content_type):
                    return error_response(415, UNSUPPORTED_MEDIA), body_unread
                if headers.content_length is not None and headers.content_length > self.body_limit:
                    return error_response(413, BODY_TOO_LARGE), body_unread  # refused before reading a byte
                body = await _read_body(receive, self.body_limit, self.body_timeout)
                body_unread = False
                if body and not _is_json(headers.content_type):
                    return error_response(415, UNSUPPORTED_MEDIA), body_unread
        except HttpError as exc:
            release(exc)
            return http_error_response(exc), body_unread
        request = Request(
            method,
            scope["path"],
            scope["query_string"],
            body,
            params,
            body_type=route.body_type,
            forwarded_by=headers.forwarded,
        )
        return await call_route(route, request), body_unread

    async def _websocket(self, scope: ASGIScope, receive: Any, send: Any) -> None:
        """Hand an authorised upgrade of a WebSocket route to it; refuse any other with a plain 4xx
        ``{"error"}`` (401 without the token, 404 for an unknown path, else 400), through ASGI's
        denial-response extension when the server has it (hypercorn does), else by closing before
        accepting (the server then answers 403)."""
        found = self._route(scope, "GET", _Headers(scope["headers"]))  # a WebSocket handshake is a GET
        if not isinstance(found, Response) and found[0].websocket is not None:
            await found[0].websocket(scope, receive, send, self.stopping)
            return
        if isinstance(found, Response) and found.status in (400, 401, 404):
            response = found
        else:
            response = error_response(400, WEBSOCKET_REFUSED)
        if "websocket.http.response" not in scope.get("extensions", {}):
            await send({"type": "websocket.close"})
            return
        headers = [(b"content-length", str(len(response.body)).encode()), (b"content-type", JSON), CONNECTION_CLOSE]
        headers.extend(response.headers)
        await send({"type": "websocket.http.response.start", "status": response.status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": response.body})


async def call_route(route: Route, request: Request) -> Response:
    """``route``'s answer to ``request``, every failure in the API's shape (one place, so a command of a
    batch is answered exactly as the same request on its own route)."""
    try:
        return await route.handler(request)
    except HttpError as exc:
        release(exc)
        return http_error_response(exc)
    except Overloaded as exc:
        release(exc)
        return error_response(503, str(exc), ((b"retry-after", b"1"),))
    except Exception as exc:
        # A bug in a handler: answer in the API's shape and keep serving (actor bugs are
        # fail-stop instead, since they may have left state half-applied).
        log.exception("unhandled error in %s %s", request.method, request.path)
        release(exc)
        return error_response(500, "internal error")


def http_error_response(exc: HttpError) -> Response:
    if exc.plain:
        return Response(exc.status, exc.message.encode(), b"text/plain; charset=utf-8", exc.headers)
    return error_response(exc.status, exc.message, exc.headers)


def _log_request(scope: ASGIScope, status: int, started: float) -> None:
    """``METHOD raw-path status duration`` (the time to produce the response): never a header (the token is
    in one), a query string or a body."""
    path = raw_path_of(scope).decode("ascii", "backslashreplace")
    request_log.debug("%s %s %d %.3f ms", scope["method"], path, status, (perf_counter() - started) * 1000)


async def _read_body(receive: Any, limit: int, seconds: float | None) -> bytes:
    """The whole body, refused (413) past ``limit`` bytes and (408) past ``seconds`` from the first read.

    The deadline is checked as each chunk arrives (no cancel scope on this path). A client that falls silent
    is the server's read timeout (the same number of seconds) to end: the disconnect it hands over comes past
    the deadline, and the client, still there, is answered 408. One that arrives before it is a client that went
    away (400, sent to nobody).
    """
    deadline = None if seconds is None else trio.current_time() + seconds
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if deadline is not None and trio.current_time() >= deadline:
                raise HttpError(408, f"the request body did not arrive within {seconds:g} s")
            raise HttpError(400, "client disconnected")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise HttpError(413, BODY_TOO_LARGE)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)
        if deadline is not None and trio.current_time() > deadline:
            raise HttpError(408, f"the request body did not arrive within {seconds:g} s")
