"""A WebSocket frame written straight to a subscriber's socket: framed once, the same bytes for all (a live
stream's message), and the command stream's results, written by its sending task.

Sent the ASGI way, each message to each subscriber wakes the subscriber's task and goes through the
connection's ``websocket.send`` (wsproto's framing, the stream's write): a hub instead frames an update once
(``text_frame``) and, for each subscriber that is waiting with nothing queued, writes the frame to its
socket at once (``DirectSocket.write``: one non-blocking write, no task switch). A socket that takes
nothing now gets the message the ASGI way (queued, conflated, timed against the stall bound); one that
takes part of it keeps the rest, which the subscriber's task writes before anything else (``flush``).

Only on kvrouter's own WebSocket connection (``api/http/websocket.py``: no extension is ever negotiated, so
a message's frame is exactly this), and only while it is open; anything else (in-process ASGI tests) takes
the ASGI path, with the same messages.
"""

from __future__ import annotations

import struct
from typing import Any

from kvrouter.api.http.websocket import WebSocketConnection

_TEXT_FIN = 0x81  # FIN + opcode 1 (text); a server's frames are not masked (RFC 6455, 5.1-5.2)
_BINARY_FIN = 0x82  # FIN + opcode 2 (binary)


def text_frame(message: str) -> bytes:
    """One final, unmasked WebSocket text frame carrying ``message``."""
    return _frame(_TEXT_FIN, message.encode())


def binary_frame(payload: bytes) -> bytes:
    """One final, unmasked WebSocket binary frame carrying ``payload`` (the command stream's compact results)."""
    return _frame(_BINARY_FIN, payload)


def _frame(first: int, payload: bytes) -> bytes:
    size = len(payload)
    if size < 126:
        head = bytes((first, size))
    elif size < 1 << 16:
        head = struct.pack("!BBH", first, 126, size)
    else:
        head = struct.pack("!BBQ", first, 127, size)
    return head + payload


class DirectSocket:
    """One subscriber's socket, for frames written without its task (see the module doc)."""

    __slots__ = ("_connection",)

    def __init__(self, connection: WebSocketConnection) -> None:
        self._connection = connection

    def write(self, frame: bytes) -> bool:
        """Write ``frame`` now (or its start, the rest kept for ``flush``); False: nothing was written."""
        return self._connection.write_now(frame)

    @property
    def unsent(self) -> bool:
        """Part of a frame is still to be written (``flush``) before anything else."""
        return self._connection.unsent > 0

    async def flush(self) -> None:
        await self._connection.flush()


def direct_socket(scope: dict[str, Any], send: Any) -> DirectSocket | None:
    """The subscriber's socket if this connection's frames can be written directly, else None."""
    connection = getattr(send, "__self__", None)
    if type(connection) is not WebSocketConnection:
        return None
    return DirectSocket(connection)
