"""A WebSocket client connection to a live stream (``ws://host:port/ws/loads?model_name=...``), for
``kvrouter watch`` and tests: the query string is kept (it carries the filters), the token is sent at the
upgrade, and the TCP socket is closed on exit however the connection ended."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import trio
from trio_websocket import HandshakeError, WebSocketConnection, wrap_client_stream

MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a snapshot of many scopes is one message
CLOSE_SECONDS = 2.0


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
    """Connect to ``url`` (a ws:// URL); ``receive_buffer``: the socket's SO_RCVBUF (tests of slow readers).
    A refused upgrade raises trio-websocket's ``ConnectionRejected``; a refused connection ``OSError``."""
    parts = urlsplit(url)
    if parts.scheme != "ws" or parts.hostname is None:
        raise ValueError(f"{url!r} is not a ws:// URL")
    port = parts.port or 80
    resource = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    headers = [(b"authorization", b"Bearer " + token.encode())] if token is not None else None
    if receive_buffer is None:
        stream = await trio.open_tcp_stream(parts.hostname, port)
    else:
        sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        await sock.connect((parts.hostname, port))
        stream = trio.SocketStream(sock)
    rejected: list[HandshakeError] = []
    try:
        async with trio.open_nursery() as nursery:
            connection = await wrap_client_stream(
                nursery,
                stream,
                f"{parts.hostname}:{port}",
                resource,
                extra_headers=headers,
                max_message_size=MAX_MESSAGE_BYTES,
            )
            try:
                yield connection
            finally:
                with trio.move_on_after(CLOSE_SECONDS) as closing:
                    closing.shield = True
                    await connection.aclose()
                nursery.cancel_scope.cancel()
    except* HandshakeError as refusals:
        rejected.extend(refusals.exceptions)  # type: ignore[arg-type]
    finally:
        await trio.aclose_forcefully(stream)
    if rejected:
        raise rejected[0]
