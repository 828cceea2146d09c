"""A WebSocket connection served to an ASGI app with wsproto's public sans-I/O API, under a thin trio shell.

The HTTP/1.1 shell (``api/http/h1_connection.py``) hands over a GET that asks to upgrade; wsproto checks the
handshake (``initiate_upgrade_connection``), frames and parses. What this adds, as hypercorn's WebSocket
stream does for ASGI: the ``websocket.*`` messages (with the denial-response extension), pongs, the closing
handshake, and a bound on a message.

* No extension is negotiated (permessage-deflate offers are declined), so a message's size on the wire is
  its size: a message over ``max_message_bytes`` is refused with close code 1009 after at most that many
  bytes were held, and no compressed message can inflate past it.
* A frame wsproto refuses (a protocol error, bad UTF-8 in a text message) is answered with the close code
  wsproto names (1002, 1007) before the connection closes.
* The app's ``receive`` reads the socket (no reader task); a client silent for ``read_timeout`` is gone
  (``websocket.disconnect`` 1006), as under hypercorn.
* ``write_now``: a frame written without a task switch (``api/streams/ws_direct.py``), only while open.
"""

from __future__ import annotations

import errno
import math
import os
from typing import Any

import orjson
import trio
from hypercorn.config import Config
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.frame_protocol import CloseReason
from wsproto.utilities import RemoteProtocolError

from kvrouter.api.http.h1_protocol import RequestHead

MAX_RECV = 64 * 1024
NORMAL = CloseReason.NORMAL_CLOSURE.value
GONE = CloseReason.ABNORMAL_CLOSURE.value  # 1006: the connection ended without a closing handshake


class WebSocketConnection:
    """One WebSocket (see the module doc): ``serve`` runs the app on it and returns when both are done."""

    def __init__(
        self,
        stream: Any,
        app: Any,
        config: Config,
        scope: dict[str, Any],
        head: RequestHead,
        trailing: bytes,
        max_message_bytes: int,
    ) -> None:
        self._stream = stream  # kvrouter's connection stream (api/http/server.py ``ConnectionStream``)
        self._fd = stream.socket.fileno()
        self._app = app
        self._config = config
        self._scope = scope
        self._head = head
        self._trailing = trailing  # bytes read after the handshake's head (the client's first frames)
        self._max_message_bytes = max_message_bytes
        self._ws = WSConnection(ConnectionType.SERVER)
        self._state = "handshake"  # handshake | response | open | closed (by either side) | denied
        self._connected = False  # websocket.connect given to the app
        self._parts: list[bytes | bytearray | str] = []  # the message being received
        self._size = 0
        self._disconnect_code = GONE
        self._eof = False

    @property
    def open(self) -> bool:
        return self._state == "open"

    def write_now(self, frame: bytes) -> bool:
        """Write a whole frame without waiting if the socket takes it now (the rest kept for ``flush``)."""
        return self._state == "open" and self._stream.write_now(frame)

    @property
    def unsent(self) -> int:
        return int(self._stream.unsent)

    async def flush(self) -> None:
        await self._stream.flush()

    async def serve(self) -> None:
        head = self._head
        target = head.path + (b"?" + head.query if head.query else b"")
        try:
            self._ws.initiate_upgrade_connection(head.headers, target)
            request = next(iter(self._ws.events()), None)
        except RemoteProtocolError as exc:
            await self._refuse(400, f"invalid WebSocket handshake: {exc}")
            return
        if not isinstance(request, Request):
            await self._refuse(400, "invalid WebSocket handshake")
            return
        self._scope["subprotocols"] = list(request.subprotocols)
        self._scope["extensions"] = {"websocket.http.response": {}}
        try:
            await self._app(self._scope, self._receive, self._send)
        except Exception:
            await self._config.log.exception("Error in ASGI Framework")
        if self._state in ("handshake", "response"):
            await self._refuse(500, "the WebSocket endpoint failed before answering")
        elif self._state == "open":
            await self._send_close(CloseReason.INTERNAL_ERROR.value, None)

    # -- ASGI --

    async def _send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        state = self._state
        if state in ("closed", "denied"):
            return
        if kind == "websocket.accept" and state == "handshake":
            headers = [(bytes(name), bytes(value)) for name, value in message.get("headers", ())]
            accept = AcceptConnection(subprotocol=message.get("subprotocol"), extensions=[], extra_headers=headers)
            self._state = "open"
            await self._write(self._ws.send(accept))
        elif kind == "websocket.send" and state == "open":
            data = message.get("bytes")
            if data is not None:
                await self._write(self._ws.send(BytesMessage(data=bytes(data))))
            elif isinstance(message.get("text"), str):
                await self._write(self._ws.send(TextMessage(data=message["text"])))
            else:
                raise TypeError("websocket.send needs bytes or text")
        elif kind == "websocket.close" and state == "handshake":
            self._state = "denied"
            await self._write(b"HTTP/1.1 403 \r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        elif kind == "websocket.close" and state == "open":
            await self._send_close(int(message.get("code", NORMAL)), message.get("reason"))
        elif kind == "websocket.http.response.start" and state == "handshake":
            self._state = "response"
            headers = [(bytes(name), bytes(value)) for name, value in message.get("headers", ())]
            rejection = RejectConnection(status_code=int(message["status"]), headers=headers, has_body=True)
            await self._write(self._ws.send(rejection))
        elif kind == "websocket.http.response.body" and state == "response":
            more = bool(message.get("more_body", False))
            data = self._ws.send(RejectData(data=bytes(message.get("body", b"")), body_finished=not more))
            if not more:
                self._state = "denied"
            await self._write(data)
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r} in WebSocket state {state!r}")

    async def _receive(self) -> dict[str, Any]:
        if not self._connected:
            self._connected = True
            return {"type": "websocket.connect"}
        if self._state == "open":
            message = await self._next_message()
            if message is not None:
                return message
        return {"type": "websocket.disconnect", "code": self._disconnect_code}

    async def _next_message(self) -> dict[str, Any] | None:
        """A whole message from the client (None: the connection is over). Messages wsproto already holds come
        first: the socket is read only when it has none."""
        ws = self._ws
        while True:
            for event in ws.events():
                if isinstance(event, (TextMessage, BytesMessage)):
                    self._parts.append(event.data)
                    self._size += len(event.data)
                    if self._size > self._max_message_bytes:
                        await self._send_close(CloseReason.MESSAGE_TOO_BIG.value, "message too big")
                        return None
                    if event.message_finished:
                        return self._message(isinstance(event, TextMessage))
                elif isinstance(event, Ping):
                    await self._write(ws.send(event.response()))
                elif isinstance(event, CloseConnection):
                    if ws.state is ConnectionState.REMOTE_CLOSING:
                        await self._write(ws.send(event.response()))  # the client's close, answered
                    elif ws.state is ConnectionState.OPEN:
                        await self._write(ws.send(CloseConnection(event.code, event.reason)))  # a protocol error
                    self._state = "closed"
                    self._disconnect_code = event.code
                    return None
            if self._state != "open":
                return None
            if self._trailing:
                data, self._trailing = self._trailing, b""
            else:
                read = await self._read()
                if read is None:
                    self._state = "closed"
                    self._disconnect_code = GONE
                    return None
                data = read
            ws.receive_data(data or None)

    def _message(self, text: bool) -> dict[str, Any]:
        parts, self._parts, self._size = self._parts, [], 0
        if text:
            return {"type": "websocket.receive", "text": "".join(parts)}  # type: ignore[arg-type]
        return {"type": "websocket.receive", "bytes": b"".join(parts)}  # type: ignore[arg-type]

    async def _send_close(self, code: int, reason: str | None) -> None:
        self._state = "closed"
        self._disconnect_code = code
        if self._ws.state in (ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING):
            await self._write(self._ws.send(CloseConnection(code=code, reason=reason)))

    async def _refuse(self, status: int, message: str) -> None:
        self._state = "denied"
        await self._write(_json_refusal(status, message))

    # -- the socket --

    async def _read(self) -> bytes | None:
        """What the client sent next (b"": it ended its side), or None: silent for the read timeout."""
        if self._eof:
            return b""
        timeout = self._config.read_timeout or math.inf
        with trio.move_on_after(timeout):
            while True:
                try:
                    data = os.read(self._fd, MAX_RECV)
                except BlockingIOError:
                    try:
                        await trio.lowlevel.wait_readable(self._fd)
                    except (trio.ClosedResourceError, OSError):
                        data = b""
                    else:
                        continue
                except OSError as exc:
                    if exc.errno == errno.EINTR:
                        continue
                    data = b""
                self._eof = not data
                return data
        return None

    async def _write(self, data: bytes) -> None:
        if not data:
            return
        try:
            await self._stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._state = "closed"
            self._disconnect_code = GONE


def _json_refusal(status: int, message: str) -> bytes:
    body = orjson.dumps({"error": message})
    return b"HTTP/1.1 %d \r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s" % (
        status,
        len(body),
        body,
    )
