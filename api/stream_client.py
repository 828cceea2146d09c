"""A WebSocket client connection to a live stream (``ws://host:port/ws/loads?model_name=...``), for
``kvrouter watch`` and tests: the query string is kept (it carries the filters), the token is sent at the
upgrade, and the TCP socket is closed on exit however the connection ended."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

from trio_websocket import WebSocketConnection

from kvrouter.client.stream import open_websocket

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
