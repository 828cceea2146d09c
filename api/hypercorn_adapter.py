"""Per-request costs of hypercorn's trio HTTP/1.1 connection, removed from outside hypercorn.

Hypercorn 0.18's ``TCPServer`` keeps a connection's keep-alive timer as a task it cancels when a request
head arrives and starts again (``nursery.start``, a task and a handshake) after every response; and it
hands the socket each response in three sends (head, body, and the empty end of a content-length body),
each under its send lock and each a system call (on loopback ~10 % of a small request's CPU apiece).
``AdaptedTCPServer`` keeps one timer task for the connection's whole life and moves its deadline instead,
and does not send empty data. A whole response (``send_whole_response``: the app has its body in hand)
goes to the socket as one write: its head, as h11 serialised it, waits for its body (``CorkedH11Protocol``).
A response whose body is still to come (a proxied stream) is sent as before, head first. Nothing else
changes: the same bytes in the same order, the timer firing in the same states, for the same reasons,
with hypercorn's own close.

It relies on hypercorn internals (``TCPServer.idle_task`` and how ``run``/``protocol_send`` call it,
``_initiate_server_close``, ``_read_data``, ``RawData``, ``H11Protocol.stream_send``/``_send_h11_event``
and the ``send`` chain from the ASGI ``send`` to the protocol), so it is pinned: with any hypercorn other
than ``HYPERCORN_VERSION`` it stands aside (``ACTIVE`` is false: hypercorn's own timer and sends, and the
server logs a warning), and tests/api/test_hypercorn_adapter.py fails loudly on another version and
checks every internal used here.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Awaitable, Callable
from importlib.metadata import version
from itertools import chain
from typing import Any

import h11
import trio
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol.events import Body, EndBody, Response
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import HTTPStream
from hypercorn.trio.task_group import TaskGroup, _handle
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import AppWrapper, LifespanState

from kvrouter.api.fast_h1 import FastH1Connection

HYPERCORN_VERSION = "0.18.0"  # the version whose internals this module was written and tested against


INSTALLED_VERSION = version("hypercorn")
ACTIVE = INSTALLED_VERSION == HYPERCORN_VERSION


def inactive_reason() -> str | None:
    """One line for the log when the adapter stands aside, else None."""
    if ACTIVE:
        return None
    return (
        f"hypercorn {INSTALLED_VERSION} is installed; kvrouter's HTTP adapter is written for {HYPERCORN_VERSION} "
        "and stands aside (hypercorn's own keep-alive timer and sends: correct, slower). "
        f"Install hypercorn=={HYPERCORN_VERSION} for the faster path."
    )


class KeepAliveTimer:
    """hypercorn's ``TrioSingleTask`` for the idle timer (same ``restart``/``stop``), as one long-lived task.

    ``restart`` (a response went out: the connection is idle) sets the deadline ``keep_alive_timeout``
    from now, or now if the server is terminating; ``stop`` (a request head arrived) clears it. Neither
    starts or cancels a task, and neither moves the watching cancel scope's deadline later (each move is a
    heap operation in trio's deadline queue, twice per request): ``restart`` only brings it earlier, and a
    watcher woken before the connection's real deadline looks again and waits for what is left. When the
    deadline passes while idle, or the server terminates while idle, the connection is closed as
    hypercorn's own timer does. ``close`` ends the task (the connection stopped reading).
    """

    def __init__(self, server: TCPServer) -> None:
        self._server = server
        self._deadline = math.inf  # when an idle connection closes; inf while a request is in flight
        self._idle = False
        self._scope: trio.CancelScope | None = None
        self._started = False
        self._closed = False

    async def restart(self, task_group: Any, action: Callable[[], Awaitable[None]]) -> None:
        # ``action`` is hypercorn's own timer body (TCPServer._idle_timeout); its effect is reproduced in _watch.
        self._idle = True
        if self._server.context.terminated.is_set():
            deadline = -math.inf
        else:
            deadline = trio.current_time() + self._server.config.keep_alive_timeout
        self._deadline = deadline
        scope = self._scope
        if scope is not None and scope.deadline > deadline:
            scope.deadline = deadline
        if not self._started and not self._closed:
            self._started = True
            task_group.spawn(self._watch)

    async def stop(self) -> None:
        self._idle = False
        self._deadline = math.inf  # the scope may wake early: it then finds the connection busy and waits on

    def close(self) -> None:
        self._closed = True
        self._idle = False
        if self._scope is not None:
            self._scope.cancel()

    async def _watch(self) -> None:
        terminated = self._server.context.terminated
        while not self._closed:
            with trio.CancelScope(deadline=self._deadline) as scope:
                self._scope = scope
                await terminated.wait()
                if not self._idle:
                    await trio.sleep_forever()  # terminating while a request is in flight: restart() fires us
            self._scope = None
            # Idle, and the deadline passed or the server is terminating: close. Otherwise a request arrived,
            # the deadline moved on, or close() was called: look again.
            if self._idle and (trio.current_time() >= self._deadline or terminated.is_set()):
                with trio.CancelScope(shield=True):
                    await self._server._initiate_server_close()
                return


class CorkedH11Protocol(H11Protocol):
    """hypercorn's HTTP/1.1 protocol, writing a whole response's head and body as one send (and checking a
    request for a protocol switch only when it could ask for one).

    ``cork()`` (by ``send_whole_response``, just before the app's ``http.response.start``) makes the next
    final response head wait, serialised by h11 exactly as hypercorn does, for the body or end of body
    that follows it; both go out in one ``RawData``. Anything else sent meanwhile sends the head first.
    A connection's ``H11Protocol`` becomes one of these when it starts reading (``AdaptedTCPServer``).
    """

    _corked = False
    _held = b""

    def cork(self) -> None:
        self._corked = True

    async def uncork(self) -> None:
        """Send a held head (the app sent no body after it); stop holding."""
        self._corked = False
        if self._held:
            held, self._held = self._held, b""
            await self.send(RawData(data=held))

    async def stream_send(self, event: StreamEvent) -> None:
        kind = type(event)
        if self._corked:
            if kind is Response and event.status_code >= 200 and not self._held:  # type: ignore[attr-defined]
                # As H11Protocol.stream_send builds it, serialised now, sent with what follows.
                headers = list(chain(event.headers, self.config.response_headers("h11")))  # type: ignore[attr-defined]
                if self.keep_alive_requests >= self.config.keep_alive_max_requests:
                    headers.append((b"connection", b"close"))
                response = h11.Response(headers=headers, status_code=event.status_code)  # type: ignore[attr-defined]
                try:
                    self._held = self.connection.send(response)
                except h11.LocalProtocolError:
                    if self.connection.their_state != h11.ERROR:
                        raise
                return
            if self._held and (kind is Body or kind is EndBody):
                self._corked = False
                held, self._held = self._held, b""
                following = h11.Data(data=event.data) if kind is Body else h11.EndOfMessage()  # type: ignore[attr-defined]
                try:
                    data = self.connection.send(following)
                except h11.LocalProtocolError:
                    await self.send(RawData(data=held))
                    if self.connection.their_state != h11.ERROR:
                        raise
                    return
                await self.send(RawData(data=held + data))
                return
            await self.uncork()
        await super().stream_send(event)

    async def _check_protocol(self, event: h11.Request) -> None:
        # hypercorn switches to HTTP/2 only for an ``Upgrade: h2c`` header or the HTTP/2 preface (method PRI);
        # h11 gives header names lower-cased.
        if event.method == b"PRI" or any(name == b"upgrade" for name, _ in event.headers):
            await super()._check_protocol(event)

    async def _send_h11_event(self, event: Any) -> None:
        if self._held:  # (an error response of the reading side: never between a held head and its body)
            await self.uncork()
        await super()._send_h11_event(event)


def corkable(send: Any) -> CorkedH11Protocol | None:
    """The protocol behind an ASGI ``send`` of hypercorn's HTTP/1.1 stream, if it can cork (else None)."""
    stream = getattr(send, "__self__", None)
    if type(stream) is not HTTPStream:
        return None
    protocol = getattr(stream.send, "__self__", None)
    return protocol if type(protocol) is CorkedH11Protocol else None


async def send_whole_response(send: Any, start: dict[str, Any], body: dict[str, Any]) -> None:
    """Send ``start`` then its final ``body`` message (``more_body`` false), as one write where the
    connection can (kvrouter's plain HTTP/1.1 path, or hypercorn's HTTP/1.1 under ``AdaptedTCPServer``),
    else as two ASGI sends."""
    plain = getattr(send, "__self__", None)
    if type(plain) is FastH1Connection:
        await plain.send_whole(start, body)
        return
    protocol = corkable(send) if ACTIVE else None
    if protocol is None:
        await send(start)
        await send(body)
        return
    protocol.cork()
    try:
        await send(start)
        await send(body)
    finally:
        await protocol.uncork()


class Inbox:
    """What a connection's reading side hands one app task (ASGI ``receive``), as hypercorn's memory channel
    does, without the scheduler turns: a put with room, or a receive with a message waiting, returns at once.

    Bounded as hypercorn's channel (``max_app_queue_size`` messages): a put waits while it is full (a body
    arriving faster than the app reads it holds the reading, overflow policy *block the sender*); a receive
    waits while it is empty. Both waits are cancellable.
    """

    __slots__ = ("_limit", "_messages", "_waiting_for_message", "_waiting_for_room")

    def __init__(self, limit: int) -> None:
        self._limit = max(limit, 1)
        self._messages: deque[Any] = deque()
        self._waiting_for_message = trio.lowlevel.ParkingLot()
        self._waiting_for_room = trio.lowlevel.ParkingLot()

    async def put(self, message: Any) -> None:
        while len(self._messages) >= self._limit:
            await self._waiting_for_room.park()
        self._messages.append(message)
        if self._waiting_for_message:
            self._waiting_for_message.unpark()

    async def receive(self) -> Any:
        while not self._messages:
            await self._waiting_for_message.park()
        message = self._messages.popleft()
        if self._waiting_for_room:
            self._waiting_for_room.unpark()
        return message


class InboxTaskGroup(TaskGroup):
    """hypercorn's connection task group, each app task fed through an ``Inbox`` instead of a memory channel
    (its ``spawn_app`` otherwise as hypercorn's: the app run by hypercorn's ``_handle``, in the connection's
    nursery). A connection's ``TaskGroup`` becomes one of these when it starts reading."""

    async def spawn_app(
        self, app: AppWrapper, config: Config, scope: Any, send: Callable[[Any], Awaitable[None]]
    ) -> Callable[[Any], Awaitable[None]]:
        inbox = Inbox(config.max_app_queue_size)
        self.spawn(_handle, app, config, scope, inbox.receive, send, trio.to_thread.run_sync, trio.from_thread.run)
        return inbox.put


class AdaptedTCPServer(TCPServer):
    """hypercorn's trio connection with the keep-alive timer above and no empty sends (see the module doc)."""

    def __init__(
        self,
        app: AppWrapper,
        config: Config,
        context: WorkerContext,
        state: LifespanState,
        stream: trio.SSLStream[trio.SocketStream],
    ) -> None:
        super().__init__(app, config, context, state, stream)
        if ACTIVE:
            self.idle_task = KeepAliveTimer(self)  # type: ignore[assignment]

    async def protocol_send(self, event: Event) -> None:
        if ACTIVE and type(event) is RawData:
            data = event.data
            if not data:
                return  # the end of a content-length body: h11 has nothing to write, and a send costs a turn
            # A stream that can write without waiting (kvrouter's, ``write_now``) takes what fits now, with no
            # lock turn, when no send is in progress (hypercorn's lock is free and no earlier write is unfinished):
            # the same bytes in the same order. What it could not take at once is written under the lock as
            # before (it goes before anything sent later); a failed write is left to that path to report.
            write_now = getattr(self.stream, "write_now", None)
            if write_now is not None and not self.send_lock.locked() and write_now(data):
                if self.stream.unsent:
                    await super().protocol_send(RawData(data=b""))
                return
        await super().protocol_send(event)

    async def _read_data(self) -> None:
        # ``run`` has made the protocol by now: one that can cork a whole response (same class, one more method).
        protocol = getattr(self.protocol, "protocol", None)
        if ACTIVE and type(protocol) is H11Protocol:
            protocol.__class__ = CorkedH11Protocol
        if ACTIVE and type(self._task_group) is TaskGroup:
            self._task_group.__class__ = InboxTaskGroup
        try:
            if ACTIVE:
                await self._read_loop()
            else:
                await super()._read_data()
        finally:
            if isinstance(self.idle_task, KeepAliveTimer):
                self.idle_task.close()

    async def _read_loop(self) -> None:
        """hypercorn's read loop (``TCPServer._read_data``: read, hand the bytes to the protocol, stop at the
        end of the stream, at a broken or closed stream or after ``read_timeout`` of silence, then tell the
        protocol it is closed), each read's timeout a cancel scope's deadline instead of ``fail_after``'s
        generator-based context manager."""
        timeout = self.config.read_timeout or math.inf
        receive_some, handle = self.stream.receive_some, self.protocol.handle
        while True:
            with trio.CancelScope(deadline=trio.current_time() + timeout) as waited:
                try:
                    data = await receive_some(MAX_RECV)
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    break
            if waited.cancelled_caught:
                break  # silent for read_timeout
            await handle(RawData(bytes(data)))
            if data == b"":
                break
        await handle(Closed())
