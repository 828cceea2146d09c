"""A live stream's message written straight to a subscriber's socket: framed once, the same bytes for all
(and the command stream's results, written by its sending task without hypercorn's WebSocket stream).

Sent the ASGI way, each message to each subscriber wakes the subscriber's task and goes through
hypercorn's WebSocket stream, wsproto's framing, its connection's send lock and two trio checkpoints:
~120 us of service CPU per message (profiled, ``benchmarks/ws_loads_bench.py``), so 100 subscribers of
one busy scope cost the lifecycle a tenth of its rate. A hub instead frames an update once
(``text_frame``) and, for each subscriber that is waiting with nothing queued, writes the frame to its
socket at once (``DirectSocket.write``: one non-blocking write, no task switch). A socket that takes
nothing now gets the message the ASGI way (queued, conflated, timed against the stall bound); one that
takes part of it keeps the rest, which the subscriber's task writes before anything else (``flush``).

Only where the bytes on the wire are exactly that frame: an HTTP/1.1 WebSocket (not over HTTP/2)
whose client offered no extension (permessage-deflate would frame differently), served by kvrouter's
HTTP server (``api/server.py``'s stream, which keeps the order of its writes) on hypercorn
``HYPERCORN_VERSION``, whose objects behind the ASGI ``send`` are relied on here (the WebSocket stream,
its wsproto connection's state, the connection's stream); anything else (another hypercorn, in-process
ASGI tests, a browser offering deflate) takes the ASGI path, with the same messages.
tests/api/test_ws_direct.py checks those internals on the pinned version. Control frames stay
hypercorn's: once either side has begun closing, nothing is written here.
"""

from __future__ import annotations

import struct
from typing import Any, Protocol

from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.ws_stream import WSStream
from wsproto.connection import ConnectionState

from kvrouter.api.hypercorn_adapter import ACTIVE

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


class RawStream(Protocol):
    """What kvrouter's HTTP server gives hypercorn as a connection's stream (``api/server.py``)."""

    def write_now(self, data: bytes) -> bool: ...

    @property
    def unsent(self) -> int: ...

    async def flush(self) -> None: ...


class DirectSocket:
    """One subscriber's socket, for frames written without its task (see the module doc)."""

    __slots__ = ("_stream", "_websocket")

    def __init__(self, websocket: WSStream, stream: RawStream) -> None:
        self._websocket = websocket
        self._stream = stream

    def write(self, frame: bytes) -> bool:
        """Write ``frame`` now (or its start, the rest kept for ``flush``); False: nothing was written."""
        websocket = self._websocket
        if websocket.closed or websocket.connection.state is not ConnectionState.OPEN:
            return False
        return self._stream.write_now(frame)

    @property
    def unsent(self) -> bool:
        """Part of a frame is still to be written (``flush``) before anything else."""
        return self._stream.unsent > 0

    async def flush(self) -> None:
        await self._stream.flush()


def direct_socket(scope: dict[str, Any], send: Any) -> DirectSocket | None:
    """The subscriber's socket if this connection's frames can be written directly, else None."""
    if not ACTIVE or scope.get("http_version") != "1.1":
        return None
    if any(name.lower() == b"sec-websocket-extensions" for name, _ in scope.get("headers", ())):
        return None
    websocket = getattr(send, "__self__", None)
    if not isinstance(websocket, WSStream):
        return None
    protocol = getattr(websocket.send, "__self__", None)
    if not isinstance(protocol, H11Protocol):
        return None
    stream = getattr(getattr(protocol.send, "__self__", None), "stream", None)
    if not callable(getattr(stream, "write_now", None)):
        return None
    return DirectSocket(websocket, stream)  # type: ignore[arg-type]
