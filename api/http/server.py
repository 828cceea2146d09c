"""The HTTP server: kvrouter's accept loop, embedded in the service's nursery; HTTP/1.x and WebSockets on
kvrouter's own sans-I/O protocol (``api/http/``), HTTP/2 (the preface, or an ``h2c`` upgrade) on
hypercorn's stock trio connection, through its public ``TCPServer`` and a stream that replays the bytes
already read. The choice and its figures: docs/architecture/http.md.

The config bounds what hypercorn's own timers did: a complete request head must arrive within
``idle_timeout`` of the connection opening or of its previous response (``keep_alive_timeout``: it
bounds slow headers as well as idle keep-alive connections), and a connection silent for ``body_timeout``
is closed (``read_timeout``); the app adds a total deadline for a body that trickles in
(:func:`kvrouter.api.http.app.make_app`). What a bare server lacks, this module adds:

* an open-connection cap: beyond ``max_connections``, a new connection is refused (overflow policy:
  *refuse newest*): it gets a 503 ``{"error"}`` with ``Connection: close`` and is closed at once, so a
  connection flood cannot exhaust file descriptors (the listeners' budget assumes at most ~450 HTTP
  connections, see ``actors/transport/socket_budget.py``);
* a shutdown that answers what is in flight, then closes: the listening sockets close first (new
  connections are refused by the kernel), every later response says ``Connection: close``
  (``keep_alive_max_requests`` set to 0), idle keep-alive connections close after ``IDLE_DRAIN_SECONDS``
  (a request already on its way is answered), and the service stops as soon as the last in-flight
  request is answered, or after ``shutdown_grace`` at the latest;
* a write timeout: each ``WRITE_CHUNK`` of a response must be taken within ``write_timeout``, else the
  connection is closed as broken (a client that sends requests and never reads the answers would hold
  its connection, and the answers, for ever);
* a lingering close: when a connection is closed while its client is still sending (a body refused
  early with 413), the unread bytes are drained and discarded for up to ``LINGER_SECONDS`` first, since
  closing a socket with unread data sends a reset that can destroy the response before the client
  reads it.

The app's lifespan protocol is not driven: kvrouter's state lives in the service's nursery, not in
ASGI lifespan.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import struct
import termios
from collections.abc import Awaitable, Callable
from math import inf
from typing import Any

import attrs
import orjson
import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.utils import repr_socket_addr

from kvrouter.api.http.h1_connection import H1Connection, ResponseHeaders
from kvrouter.api.http.h1_protocol import RequestHead
from kvrouter.api.http.websocket import WebSocketConnection

log = logging.getLogger("kvrouter.http")

# Leaves room in FD_RESERVE (512 descriptors, actors/transport/socket_budget.py) for the journal, zmq's
# own and the refusals in progress.
DEFAULT_MAX_CONNECTIONS = 400
MAX_REFUSALS_IN_PROGRESS = 32  # beyond this many 503s being written, a refused connection is just closed
LINGER_SECONDS = 1.0
WRITE_CHUNK = 64 * 1024  # a response is written in chunks of this size, each within the write timeout
IDLE_DRAIN_SECONDS = 1.0  # at shutdown, idle keep-alive connections may still deliver a request this long
MAX_HEAD_BYTES = 16 * 1024  # a request head (request line and headers) larger than this is refused (431)
REFUSAL_LOG_INTERVAL = 10.0  # seconds between warnings about refused connections
# accept(2) failures that mean "out of a resource for now": wait and retry, as trio.serve_listeners does.
_ACCEPT_RESOURCE_ERRORS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}


@attrs.frozen
class HttpSettings:
    """Limits on clients (seconds and counts; all > 0)."""

    idle_timeout: float = 5.0  # open or after a response -> a complete request head (slow headers, idle keep-alive)
    body_timeout: float = 30.0  # head -> complete body; also closes a connection silent this long
    max_connections: int = DEFAULT_MAX_CONNECTIONS  # open HTTP connections; newer ones are refused (503)
    write_timeout: float = 30.0  # a response the client does not read: closed once WRITE_CHUNK waits this long
    shutdown_grace: float = 10.0  # SIGTERM -> in-flight requests answered; then they are cut


def _refusal(message: str) -> bytes:
    body = orjson.dumps({"error": message})
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def hypercorn_config(host: str, port: int, settings: HttpSettings = HttpSettings()) -> Config:
    config = Config()
    bind_host = f"[{host}]" if ":" in host else host
    config.bind = [f"{bind_host}:{port}"]
    config.accesslog = None  # the access log costs ~25% of throughput; kvrouter logs requests at debug instead
    # Through our logging setup (one line per message, our format and level), not a second handler.
    config.errorlog = logging.getLogger("hypercorn.error")
    config.keep_alive_max_requests = 1 << 62  # never recycle healthy keep-alive connections (0 while draining)
    config.keep_alive_timeout = settings.idle_timeout
    config.read_timeout = settings.body_timeout  # type: ignore[assignment]  # hypercorn's hint says int; any number works
    config.graceful_timeout = settings.shutdown_grace
    config.websocket_ping_interval = None
    config.websocket_max_message_size = 1 << 20
    config.h11_max_incomplete_size = MAX_HEAD_BYTES  # a whole request head, on every HTTP/1.x path
    config.h2_max_header_list_size = MAX_HEAD_BYTES  # and HTTP/2's header lists
    return config


class ConnectionStream:
    """A connection's stream, for kvrouter's HTTP/1.x and WebSocket shells and hypercorn's HTTP/2; closing it
    ends the connection (see the module doc)."""

    def __init__(self, stream: trio.SocketStream, connection: trio.CancelScope, write_timeout: float = inf) -> None:
        self._stream = stream
        self._connection = connection
        self._write_timeout = write_timeout
        self._closed = False
        self._closing = False  # hypercorn has started to close: no more sends
        self._sent: trio.Event | None = None  # set while a send is in progress, fired when it ends
        self._unsent = b""  # what ``write_now`` could not write at once: the next send starts with it
        self.replay = b""  # read by the HTTP/1.x shell and handed to hypercorn's HTTP/2: it reads these first
        self.socket = stream.socket  # hypercorn reads the peer and local addresses from it

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        # Sends may come from two tasks (a WebSocket's pong from its reader, a message from the app; hypercorn's
        # close from its read task): a send waits for the one in progress, and a send after the close began
        # fails as on a closed stream, instead of either failing with BusyResourceError.
        if self._closing:
            raise trio.ClosedResourceError("the connection is closing")
        while self._sent is not None:
            await self._sent.wait()
            if self._closing:
                raise trio.ClosedResourceError("the connection is closing")
        if self._unsent:
            data, self._unsent = self._unsent + bytes(data), b""
        elif data:
            # Most responses fit the socket's buffer: one write now, without trio's send machinery (a
            # checkpoint, a conflict detector, a timeout scope and an event: ~10 % of a small request's CPU).
            # A partial write sends the rest the usual way; a failure is left to it to report as trio does.
            try:
                written = os.write(self._stream.socket.fileno(), data)
            except OSError:
                written = 0
            if written == len(data):
                return
            data = memoryview(data)[written:]
        self._sent = sent = trio.Event()
        try:
            # A client that stops reading would hold the connection (its slot, and the answer) for ever. Each
            # chunk must be taken within the write timeout, else the connection is given up as broken.
            view = memoryview(data)
            for start in range(0, max(len(view), 1), WRITE_CHUNK):
                with trio.move_on_after(self._write_timeout) as waited:
                    await self._stream.send_all(view[start : start + WRITE_CHUNK])
                if not waited.cancelled_caught:
                    continue
                self._closing = True
                self._connection.cancel()
                log.debug("closed a connection whose client took no response bytes for %g s", self._write_timeout)
                raise trio.BrokenResourceError(f"the client took no response bytes for {self._write_timeout:g} s")
        finally:
            self._sent = None
            sent.set()

    def write_now(self, data: bytes) -> bool:
        """Write ``data`` without waiting, if no send is in progress or unfinished and the socket takes at least
        part of it at once (a WebSocket frame written without its task: ``api/streams/ws_direct.py``).
        What the socket did not take is kept, and written before anything else (``flush``, or the next send).
        False: nothing was written."""
        if self._closing or self._sent is not None or self._unsent:
            return False
        try:
            written = os.write(self._stream.socket.fileno(), data)
        except OSError:  # would block, or broken (the next send reports it)
            return False
        if written < len(data):
            self._unsent = data[written:]
        return True

    @property
    def unsent(self) -> int:
        """Bytes ``write_now`` left to write."""
        return len(self._unsent)

    async def flush(self) -> None:
        """Write what ``write_now`` left (under the write timeout, as any send)."""
        if self._unsent:
            await self.send_all(b"")

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if self.replay:
            data, self.replay = self.replay, b""
            return data
        return await self._stream.receive_some(max_bytes)

    async def send_eof(self) -> None:
        self._closing = True
        await self._send_finished()
        await self._stream.send_eof()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = self._closing = True
        try:
            await self._send_finished()
            if _unread_bytes(self._stream) > 0:
                await self._linger()
        finally:
            await self._stream.aclose()
            self._connection.cancel()

    async def _send_finished(self) -> None:
        sent = self._sent
        if sent is not None:
            with trio.move_on_after(LINGER_SECONDS):
                await sent.wait()

    async def _linger(self) -> None:
        """Read and discard what the client still sends (after our FIN), until it closes or time is up."""
        with trio.move_on_after(LINGER_SECONDS):
            try:
                await self._stream.send_eof()
                while await self._stream.receive_some(65536):
                    pass
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
                pass


async def _close(stream: ConnectionStream) -> None:
    """End a connection: our end of the stream, then close (lingering over what the client still sends)."""
    with contextlib.suppress(trio.BrokenResourceError, trio.BusyResourceError, trio.ClosedResourceError, OSError):
        await stream.send_eof()
    await stream.aclose()


def _unread_bytes(stream: trio.SocketStream) -> int:
    """Bytes the client sent that nobody has read yet (FIONREAD)."""
    try:
        found = fcntl.ioctl(stream.socket.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except OSError:
        return 0
    return int(struct.unpack("i", found)[0])


class _Server:
    def __init__(self, app: Any, config: Config, max_connections: int, write_timeout: float = inf) -> None:
        self.raw_app = app
        self.app = ASGIWrapper(app)  # for hypercorn's HTTP/2 connections
        self.config = config
        self.response_headers = ResponseHeaders(config)
        self.http1: set[H1Connection] = set()  # connections reading HTTP/1.x (closed when idle at shutdown)
        self.write_timeout = write_timeout
        self.context = WorkerContext(None)
        self.all_closed = trio.Event()  # set once draining and the last connection has ended
        self.max_connections = max_connections
        self.open = 0
        self.refusing = 0
        self.refused_since_log = 0
        self.last_refusal_log = -REFUSAL_LOG_INTERVAL
        self.refusal = _refusal(
            f"too many open connections (--http-max-connections {max_connections}); retry, or reuse a connection"
        )

    async def accept(self, listener: trio.SocketListener, connections: trio.Nursery) -> None:
        resource_errors = 0
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in _ACCEPT_RESOURCE_ERRORS:
                    raise
                resource_errors += 1
                if resource_errors == 1:
                    log.warning("cannot accept HTTP connections (%s); retrying every 0.1 s", exc.strerror)
                await trio.sleep(0.1)
                continue
            resource_errors = 0
            if self.open >= self.max_connections:
                self._note_refusal()
                if self.refusing < MAX_REFUSALS_IN_PROGRESS:
                    self.refusing += 1
                    connections.start_soon(self._refuse, stream)
                else:
                    stream.socket.close()
                continue
            self.open += 1
            connections.start_soon(self._serve, stream)

    async def _serve(self, stream: trio.SocketStream) -> None:
        try:
            with trio.CancelScope() as connection:
                wrapped = ConnectionStream(stream, connection, self.write_timeout)
                await self._serve_stream(wrapped)
        finally:
            self.open -= 1
            stream.socket.close()
            if self.open == 0 and self.config.keep_alive_max_requests == 0:
                self.all_closed.set()  # already closed, unless the connection was cancelled before it closed

    async def _serve_stream(self, wrapped: ConnectionStream) -> None:
        """HTTP/1.x (and a WebSocket it upgrades to) here; HTTP/2 on hypercorn's own, stock connection."""
        config = self.config
        http1 = H1Connection(
            wrapped, self.raw_app, config, self.context, self.response_headers, config.h11_max_incomplete_size
        )
        self.http1.add(http1)
        try:
            outcome = await http1.serve()
        finally:
            self.http1.discard(http1)
        if isinstance(outcome, RequestHead):
            scope = http1.scope(outcome, "websocket")
            trailing = http1.protocol.unread()
            max_message = config.websocket_max_message_size
            await WebSocketConnection(wrapped, self.raw_app, config, scope, outcome, trailing, max_message).serve()
        elif outcome is not None:
            wrapped.replay = outcome.data
            await TCPServer(self.app, config, self.context, {}, wrapped)  # type: ignore[arg-type]
            return
        await _close(wrapped)

    async def _refuse(self, stream: trio.SocketStream) -> None:
        try:
            with trio.move_on_after(LINGER_SECONDS):
                await stream.send_all(self.refusal)
            await ConnectionStream(stream, trio.CancelScope()).aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await stream.aclose()
        finally:
            self.refusing -= 1

    def _note_refusal(self) -> None:
        self.refused_since_log += 1
        now = trio.current_time()
        if now - self.last_refusal_log >= REFUSAL_LOG_INTERVAL:
            log.warning(
                "refused %d HTTP connection(s): %d open, the --http-max-connections limit",
                self.refused_since_log,
                self.open,
            )
            self.refused_since_log = 0
            self.last_refusal_log = now

    async def drain(self) -> None:
        """Answer what is in flight, then close every connection (see the module doc).

        Every response from now on says ``Connection: close``. Idle keep-alive connections stay open
        ``IDLE_DRAIN_SECONDS`` more (or until none is left), so a request a client has just sent is answered
        and told to close rather than meeting a closed connection; hypercorn's "terminated" then closes the
        idle ones at once. (Terminated first would also close connections whose last response had already
        gone out without ``Connection: close``, and their clients' next requests would go unanswered.)
        """
        self.config.keep_alive_max_requests = 0
        if self.open == 0:
            self.all_closed.set()
        with trio.move_on_after(IDLE_DRAIN_SECONDS):
            await self.all_closed.wait()
        await self.context.terminated.set()
        for connection in list(self.http1):
            connection.close_if_idle()


async def serve_http(
    app: Any,
    config: Config,
    shutdown_trigger: Callable[[], Awaitable[Any]],
    *,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    write_timeout: float = inf,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` until ``shutdown_trigger`` returns, then drain (see the module doc) and return."""
    sockets = config.create_sockets()
    listeners = []
    binds = []
    for sock in sockets.insecure_sockets:
        sock.listen(config.backlog)
        listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
        binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
    server = _Server(app, config, max_connections, write_timeout)
    try:
        async with trio.open_nursery() as connections:
            async with trio.open_nursery() as accepting:
                for listener in listeners:
                    accepting.start_soon(server.accept, listener, connections)
                task_status.started(binds)
                await shutdown_trigger()
                accepting.cancel_scope.cancel()
            _close_listeners(listeners)  # from now on the kernel refuses new connections
            grace = config.graceful_timeout
            connections.cancel_scope.deadline = trio.current_time() + grace
            if server.open:
                log.info(
                    "answering in-flight requests on %d connection(s) before stopping (at most %g s)",
                    server.open,
                    grace,
                )
            await server.drain()
    finally:
        _close_listeners(listeners)
    if connections.cancel_scope.cancelled_caught:
        log.warning("shutdown grace of %g s ran out: in-flight requests were cut", grace)


def _close_listeners(listeners: list[trio.SocketListener]) -> None:
    for listener in listeners:
        listener.socket.close()  # synchronous, so it also happens when the service is cancelled
