"""The raw ASGI application: route lookup, body limits, content types, error mapping.

No domain logic lives here; handlers come from a route table (``api/routes.py``). Each response
goes out as one ``http.response.body`` message with its content-length, and nothing on this path
starts tasks, opens cancel scopes or logs (each of those costs 10-30 µs per request here).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from kvrouter.actors.mailbox import Overloaded
from kvrouter.api.http import HttpError, Request, Response, Route, error_response

log = logging.getLogger("kvrouter.api")

ASGIScope = dict[str, Any]
UNSUPPORTED_MEDIA = "Expected request with `Content-Type: application/json`"


class RouteTable:
    """Exact paths in a dict; parameterised paths ("/reservations/{id}") matched by segments."""

    def __init__(self, routes: Iterable[Route]) -> None:
        self.exact: dict[str, dict[str, Route]] = {}
        self.patterns: list[tuple[tuple[str, ...], dict[str, Route]]] = []
        for route in routes:
            if "{" in route.path:
                segments = tuple(route.path.strip("/").split("/"))
                for known, methods in self.patterns:
                    if known == segments:
                        methods[route.method] = route
                        break
                else:
                    self.patterns.append((segments, {route.method: route}))
            else:
                self.exact.setdefault(route.path, {})[route.method] = route

    def lookup(self, path: str) -> tuple[dict[str, Route], dict[str, str]] | None:
        methods = self.exact.get(path)
        if methods is not None:
            return methods, {}
        parts = path.strip("/").split("/")
        for segments, methods in self.patterns:
            if len(segments) != len(parts):
                continue
            params = {}
            for pattern, part in zip(segments, parts, strict=True):
                if pattern.startswith("{"):
                    if not part:
                        break
                    params[pattern[1:-1]] = part
                elif pattern != part:
                    break
            else:
                return methods, params
        return None


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
        found = table.lookup(scope["path"])
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
