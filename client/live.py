"""The live streams from the client's side: ``watch(url, "watch_loads")`` yields each message of ``GET /ws/loads``
(or ``"watch_decisions"``: ``GET /ws/decisions``) as it arrives, decoded; ``open_stream`` is the connection itself
(``kvrouter watch`` and the tests use it): the query string is kept (it carries the filters), the token is sent at
the upgrade, and the TCP socket is closed on exit however the connection ended."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlencode, urlsplit

import orjson
from trio_websocket import WebSocketConnection

from kvrouter.client.stream import open_websocket
from kvrouter.client.table import BY_NAME, Kind

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a snapshot of many scopes is one message


def stream_url(url: str, path: str) -> str:
    """``http://host:port[/...][?query]`` or ``ws://...`` -> ``ws://host:port{path}[?query]``."""
    parts = urlsplit(url if "://" in url else "http://" + url)
    if parts.scheme not in ("http", "ws"):
        raise ValueError(f"{url!r}: kvrouter serves plain http:// (or ws://), not {parts.scheme}://")
    if parts.hostname is None:
        raise ValueError(f"{url!r} names no host")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{url!r}: {exc}") from None
    netloc = parts.hostname if port is None else f"{parts.hostname}:{port}"
    if ":" in parts.hostname:
        netloc = f"[{parts.hostname}]" + (f":{port}" if port is not None else "")
    query = f"?{parts.query}" if parts.query else ""
    return f"ws://{netloc}{path}{query}"


@contextlib.asynccontextmanager
async def open_stream(
    url: str, *, token: str | None = None, receive_buffer: int | None = None
) -> AsyncIterator[WebSocketConnection]:
    """Connect to ``url`` (a ws:// URL) with the command stream client's connection (``client.stream``), whose
    messages here may be as large as a snapshot; ``receive_buffer``: the socket's SO_RCVBUF (tests of slow
    readers). A refused upgrade raises trio-websocket's ``ConnectionRejected``; a refused connection ``OSError``."""
    async with open_websocket(
        url, token=token, max_message_size=MAX_MESSAGE_BYTES, receive_buffer=receive_buffer
    ) as connection:
        yield connection


async def watch(
    url: str,
    name: str = "watch_loads",
    *,
    model_name: str | None = None,
    tenant_id: str | None = None,
    token: str | None = None,
) -> AsyncIterator[Any]:
    """Each message of live stream ``name`` (an operation of the table: ``watch_loads``, ``watch_decisions``) of
    the service at ``url`` (``http://host:port``), decoded, for as long as the caller iterates; filtered to one
    model and tenant when given. The first message of ``watch_loads`` is a snapshot of every matching rank."""
    op = BY_NAME[name]
    if op.kind is not Kind.WEBSOCKET or op.name == "command_stream":
        raise ValueError(f"{name!r} is not a live stream (watch_loads, watch_decisions)")
    query = urlencode({k: v for k, v in (("model_name", model_name), ("tenant_id", tenant_id)) if v is not None})
    target = stream_url(url.split("?", 1)[0], op.path) + (f"?{query}" if query else "")
    async with open_stream(target, token=token) as connection:
        while True:
            yield orjson.loads(await connection.get_message())
