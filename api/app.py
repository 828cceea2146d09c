"""The raw ASGI application: route lookup, body limits, content types, error mapping.

No domain logic lives here; handlers come from a route table (``api/routes.py``). Each response
goes out as one ``http.response.body`` message with its content-length, and nothing on this path
starts tasks, opens cancel scopes or logs (each of those costs 10-30 µs per request here).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote, unquote_to_bytes

from kvrouter.actors.mailbox import Overloaded
from kvrouter.api.http import HttpError, Request, Response, Route, error_response

log = logging.getLogger("kvrouter.api")

ASGIScope = dict[str, Any]
UNSUPPORTED_MEDIA = "Expected request with `Content-Type: application/json`"


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


def make_app(routes: Iterable[Route], *, body_limit: int) -> Any:
    table = RouteTable(routes)

    async def app(scope: ASGIScope, receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind == "http":
            response = await _respond(scope, receive)
            headers = [(b"content-length", str(len(response.body)).encode())]
            if response.content_type is not None:
                headers.append((b"content-type", response.content_type))
            headers.extend(response.headers)
            await send({"type": "http.response.start", "status": response.status, "headers": headers})
            # HEAD: same headers (content-length included), no body.
            body = b"" if scope["method"] == "HEAD" else response.body
            await send({"type": "http.response.body", "body": body})
        elif kind == "lifespan":
            # The actor system lives in the outer nursery, not in lifespan; just answer.
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    async def _respond(scope: ASGIScope, receive: Any) -> Response:
        try:
            found = table.lookup(raw_path_of(scope))
        except HttpError as exc:
            return error_response(exc.status, exc.message)
        if found is None:
            return error_response(404, "route not found")
        methods, params = found
        method = scope["method"]
        route = methods.get(method) or (methods.get("GET") if method == "HEAD" else None)
        if route is None:
            allowed = ",".join([*methods, "HEAD"] if "GET" in methods else methods)
            return error_response(405, "method not allowed", ((b"allow", allowed.encode()),))
        try:
            body = b""
            if route.json_body or route.optional_body:
                content_type = None
                for name, value in scope["headers"]:
                    if name == b"content-type":
                        content_type = value
                if route.json_body and not _is_json(content_type):
                    return error_response(415, UNSUPPORTED_MEDIA)
                body = await _read_body(receive, body_limit)
                if body and not _is_json(content_type):
                    return error_response(415, UNSUPPORTED_MEDIA)
            request = Request(method, scope["path"], scope["query_string"], body, params)
            return await route.handler(request)
        except HttpError as exc:
            if exc.plain:
                return Response(exc.status, exc.message.encode(), b"text/plain; charset=utf-8", exc.headers)
            return error_response(exc.status, exc.message, exc.headers)
        except Overloaded as exc:
            return error_response(503, str(exc), ((b"retry-after", b"1"),))
        except Exception:
            # A bug in a handler: answer in the API's shape and keep serving (actor bugs are
            # fail-stop instead, since they may have left state half-applied).
            log.exception("unhandled error in %s %s", method, scope["path"])
            return error_response(500, "internal error")

    return app


async def _read_body(receive: Any, limit: int) -> bytes:
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise HttpError(400, "client disconnected")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise HttpError(413, "Failed to buffer the request body: length limit exceeded")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)
