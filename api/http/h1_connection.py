"""The trio shell of HTTP/1.x: one connection's socket, its ``H1Protocol`` and the ASGI app, called inline.

Under hypercorn 0.18 a small request costs ~250 us of CPU here before the app runs (h11's parse and
serialise in Python, a stream, event and task per request, the ASGI plumbing between them). This shell
costs a fraction: the head is parsed by httptools (``api/http/h1_protocol.py``), the app runs in the
connection's own task, ASGI ``receive`` reads the body straight from the socket and ``send`` writes head
and body in one write (``send_whole``).

What a client sees of a plain request is what hypercorn sends (tests/api/test_h1_connection.py compares the
bytes): h11's status line and header order, hypercorn's ``date`` and ``server`` headers (from its
public ``Config.response_headers``), ``Connection: close`` while draining, a 500 with ``Connection: close``
if the app fails before answering, chunked framing for a body of unknown length. Its timers too: a head
must be complete ``keep_alive_timeout`` after the connection opened or the last response went out, any
read waits at most ``read_timeout``, and a terminating server closes idle connections (``close_if_idle``)
and every connection after its current response. Protocol errors are answered with ``{"error"}`` and
close the connection (``H1Protocol``'s rules).

``serve`` ends with the connection, or returns what it is to become: a WebSocket (the request head, served
by ``api/http/websocket.py``) or HTTP/2 (the bytes to replay to hypercorn's own connection).
"""

from __future__ import annotations

import errno
import math
import os
from collections.abc import Callable
from time import time
from typing import Any
from urllib.parse import unquote

import trio
from hypercorn.config import Config
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.utils import parse_socket_addr

from kvrouter.api.http.h1_protocol import (
    END_OF_MESSAGE,
    NEED_DATA,
    Data,
    H1Protocol,
    HandOver,
    Refusal,
    RequestHead,
    ResponseFraming,
    error_response,
    response_body,
    response_head,
)

MAX_RECV = 64 * 1024  # bytes per read, as hypercorn's
YIELD_EVERY = 16  # requests answered from bytes already read before the task yields to the scheduler
CONTINUE = b"HTTP/1.1 100 \r\n\r\n"

Outcome = RequestHead | HandOver | None  # a WebSocket's head, HTTP/2's bytes, or the connection is over


class ResponseHeaders:
    """hypercorn's ``config.response_headers("h11")`` (``date``, ``server``) as header lines, made once a
    second: the date is formatted to the second, so the bytes are those of making them per response."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self._second = -1
        self._lines = b""

    def lines(self) -> bytes:
        second = int(time())
        if second != self._second:
            self._lines = b"".join(b"%s: %s\r\n" % pair for pair in self._config.response_headers("h11"))
            self._second = second
        return self._lines


class H1Connection:
    """One connection's HTTP/1.x requests (see the module doc)."""

    def __init__(
        self,
        stream: Any,
        app: Callable[..., Any],
        config: Config,
        context: WorkerContext,
        response_headers: ResponseHeaders,
        max_head_bytes: int,
    ) -> None:
        self._stream = stream  # kvrouter's connection stream (api/http/server.py ``ConnectionStream``)
        self._fd = stream.socket.fileno()
        self._app = app
        self._config = config
        self._context = context
        self._response_headers = response_headers
        self.protocol = H1Protocol(max_head_bytes)
        self._eof = False
        self._idle = True  # between requests (a terminating server may close the connection now)
        self._wait: trio.CancelScope | None = None  # the read in progress, while idle
        sock = stream.socket
        self.client = parse_socket_addr(sock.family, sock.getpeername())
        self.server = parse_socket_addr(sock.family, sock.getsockname())
        self._requests = 0  # requests on this connection so far (hypercorn's keep_alive_requests)
        # The request being answered.
        self._head: RequestHead | None = None
        self._framing = ResponseFraming()
        self._body_delivered = False  # the app has had the whole body (more_body false)
        self._continued = False  # 100 Continue sent (or not asked for)
        self._started = False  # the response's head is decided
        self._finished = False  # the whole response went out
        self._held = b""  # the response head, held for its body (``send_whole``)
        self._holding_head = False
        self._broken = False  # a write failed, or the request was refused: send nothing more
        self._read_over = False  # the client's side ended, or fell silent, during this request: close after it
        self._waited = False  # the last reads waited for the socket (a scheduling point)

    # -- reading --

    async def _read(self, deadline: float) -> bool:
        """Feed the protocol what the socket has, waiting until ``deadline`` (and at most the read timeout)
        for it. False: nothing came in time (the end of the stream is fed as such, and is True once)."""
        if self._eof:
            return False
        while True:
            try:
                data = os.read(self._fd, MAX_RECV)
            except BlockingIOError:
                pass
            except OSError as exc:
                if exc.errno != errno.EINTR:
                    self._eof = True
                    self.protocol.receive_data(b"")
                    return True
                continue
            else:
                if not data:
                    self._eof = True
                self.protocol.receive_data(data)
                return True
            read_timeout = self._config.read_timeout
            if read_timeout:
                deadline = min(deadline, trio.current_time() + read_timeout)
            self._waited = True
            with trio.CancelScope(deadline=deadline) as wait:
                self._wait = wait
                try:
                    await trio.lowlevel.wait_readable(self._fd)
                except (trio.ClosedResourceError, trio.BrokenResourceError, OSError):
                    self._eof = True
                    self.protocol.receive_data(b"")
                    return True
                finally:
                    self._wait = None
            if wait.cancelled_caught:
                return False

    def _read_ready(self) -> None:
        """Feed the protocol what the socket has now, without waiting."""
        if self._eof:
            return
        try:
            data = os.read(self._fd, MAX_RECV)
        except OSError:
            return  # nothing yet (or broken: the next read or write finds out)
        if not data:
            self._eof = True
        self.protocol.receive_data(data)

    def close_if_idle(self) -> None:
        """The server is terminating: stop waiting for a next request (a request being read or answered
        finishes first)."""
        if self._idle and self._wait is not None:
            self._wait.cancel()

    # -- the connection --

    async def serve(self) -> Outcome:
        answered_without_waiting = 0
        terminated = self._context.terminated
        protocol = self.protocol
        while True:
            self._idle = True
            if terminated.is_set():
                return None
            idle_deadline = trio.current_time() + self._config.keep_alive_timeout
            while (event := protocol.next_event()) is NEED_DATA:
                self._waited = False
                if not await self._read(idle_deadline):
                    return None  # idle (or a head trickling in) for the keep-alive timeout, or silent
                if self._waited:
                    answered_without_waiting = 0
            self._idle = False
            if type(event) is not RequestHead:
                if type(event) is Refusal:
                    await self._write(error_response(event.status, event.message, self._response_headers.lines()))
                    return None
                return event if type(event) is HandOver else None
            if event.websocket:
                return event
            if not await self._answer(event):
                return None
            protocol.start_next_request()
            # Requests answered from bytes already read, by an app that need not wait either, would keep every
            # other task waiting: give way every few (a real wait for the socket counts as one).
            answered_without_waiting += 1
            if answered_without_waiting >= YIELD_EVERY:
                answered_without_waiting = 0
                await trio.lowlevel.checkpoint()

    def scope(self, head: RequestHead, kind: str = "http") -> dict[str, Any]:
        """The ASGI scope of ``head``, as hypercorn makes it."""
        scope = {
            "type": kind,
            "http_version": head.http_version,
            "asgi": {"spec_version": "2.1" if kind == "http" else "2.3", "version": "3.0"},
            "scheme": "http" if kind == "http" else "ws",
            "path": unquote(path) if "%" in (path := head.path.decode("ascii")) else path,
            "raw_path": head.path,
            "query_string": head.query,
            "root_path": self._config.root_path,
            "headers": head.headers,
            "client": self.client,
            "server": self.server,
            "state": {},
            "extensions": {},
        }
        if kind == "http":
            scope["method"] = head.method.decode()
        return scope

    async def _answer(self, head: RequestHead) -> bool:
        """Run the app on one request. True: the connection stays open for the next."""
        self._head = head
        self._started = self._finished = self._broken = self._body_delivered = self._read_over = False
        self._continued = not head.expect_continue
        self._requests += 1
        self._held = b""
        try:
            await self._app(self.scope(head), self._receive, self._send)
        except Exception:
            await self._config.log.exception("Error in ASGI Framework")
        if self._broken:
            return False
        if not self._started:
            await self._write(self._error_500())
            return False
        if not self._finished or self._framing.close or self._read_over or not head.keep_alive:
            return False  # (a response cut short: the client cannot tell where it ends)
        if not self._body_delivered:
            # Answered without reading the body: as under hypercorn, the connection goes on if the body has
            # arrived (it is skipped), else it closes.
            self._read_ready()
            return self.protocol.skip_body()
        return True

    async def _receive(self) -> dict[str, Any]:
        """The next piece of the request body (ASGI ``http.request``), then ``http.disconnect`` once the
        response has gone out or the client's side ends. A body the protocol refuses (bad chunks, the end of
        the stream within it) is answered with its ``{"error"}`` and the connection closes."""
        if self._body_delivered:
            if self._finished or self._broken or self._read_over:
                return {"type": "http.disconnect"}
            return await self._wait_for_disconnect()
        if not self._continued:
            self._continued = True
            if not self._started:
                await self._write(CONTINUE)
        protocol = self.protocol
        if protocol.message_complete:
            self._body_delivered = True
            return {"type": "http.request", "body": b"", "more_body": False}
        while (event := protocol.next_event()) is NEED_DATA:
            if not await self._read(math.inf):
                self._read_over = True  # silent for the read timeout
                return {"type": "http.disconnect"}
        if type(event) is Data:
            self._body_delivered = complete = protocol.message_complete
            return {"type": "http.request", "body": event.data, "more_body": not complete}
        if event is END_OF_MESSAGE:
            self._body_delivered = True
            return {"type": "http.request", "body": b"", "more_body": False}
        self._read_over = True
        if type(event) is Refusal and not self._started:
            await self._write(error_response(event.status, event.message, self._response_headers.lines()))
        self._broken = True  # (nothing of the app's goes out after a refusal)
        return {"type": "http.disconnect"}

    async def _wait_for_disconnect(self) -> dict[str, Any]:
        """The app waits for the client to go away: read (and keep, up to the head limit) what it sends."""
        while self.protocol.buffered <= self.protocol.max_head_bytes:
            if not await self._read(math.inf) or self._eof:
                self._read_over = True
                return {"type": "http.disconnect"}
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def send_whole(self, start: dict[str, Any], body: dict[str, Any]) -> None:
        """``start`` and its final ``body``, as one write (``send_whole_response``)."""
        self._holding_head = True
        try:
            await self._send(start)
            await self._send(body)
        finally:
            self._holding_head = False
            if self._held:
                held, self._held = self._held, b""
                await self._write(held)

    async def _send(self, message: dict[str, Any]) -> None:
        """ASGI ``send``, as hypercorn's: the head goes out at once (unless a whole response is being sent),
        body bytes as they come, framed as the head says; bytes beyond a declared length are refused."""
        kind = message["type"]
        if self._broken or self._finished:
            return
        if kind == "http.response.start":
            if self._started:
                return
            head = self._head
            assert head is not None
            self._framing = framing = ResponseFraming()
            data = response_head(
                int(message["status"]),
                message.get("headers", ()),
                self._response_headers.lines(),
                framing,
                http_version=head.http_version,
                head_request=head.method == b"HEAD",
                close=self._requests >= self._config.keep_alive_max_requests or not head.keep_alive,
            )
            self._started = True  # (a head that cannot be sent leaves the request unanswered: a 500)
            if self._holding_head:
                self._held = data
            else:
                await self._write(data)
        elif kind == "http.response.body" and self._started:
            more = message.get("more_body", False)
            try:
                body = response_body(bytes(message.get("body", b"")), more, self._framing)
            except ValueError:
                # As h11: bytes beyond the length are refused unsent, a body that ends short is sent and then
                # refused; either way the connection closes (the client cannot tell where it ends).
                self._finished = self._framing.close = True
                short = self._framing.length_left > 0
                sent = self._held + (bytes(message.get("body", b"")) if short else b"")
                self._held = b""
                if sent:
                    await self._write(sent)
                raise
            if not more:
                self._finished = True
            if self._held:
                body, self._held = self._held + body, b""
            if body:
                await self._write(body)

    def _error_500(self) -> bytes:
        """hypercorn's answer when the app fails before answering (``Connection: close`` added again while
        draining, as its response path does)."""
        draining = self._requests >= self._config.keep_alive_max_requests
        return b"HTTP/1.1 500 \r\ncontent-length: 0\r\nconnection: close\r\n%s%s\r\n" % (
            self._response_headers.lines(),
            b"connection: close\r\n" if draining else b"",
        )

    async def _write(self, data: bytes) -> None:
        try:
            await self._stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._broken = True


async def send_whole_response(send: Any, start: dict[str, Any], body: dict[str, Any]) -> None:
    """Send ``start`` then its final ``body`` message (``more_body`` false): as one write on kvrouter's
    HTTP/1.x connection, else (HTTP/2, in-process ASGI) as two ASGI sends."""
    connection = getattr(send, "__self__", None)
    if type(connection) is H1Connection:
        await connection.send_whole(start, body)
        return
    await send(start)
    await send(body)
