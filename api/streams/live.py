"""What the live streams (``GET /ws/loads``, ``GET /ws/decisions``) share: their settings, the plumbing of one
subscriber connection (admission, heartbeats, stalls, the service stopping, a plain GET), and the pump that
keeps a process's hub current.

A hub (one per process and stream) follows the service through a long-polling service-object method, so
it works the same in one process and in a front process (``--fronts N``), where that method is a call to
the actor process. The poll runs only while someone subscribes: each subscriber's connection offers to
pump, and exactly one of them does at a time (when it leaves, another takes over), so the hub needs no
task of its own and stops polling with its last subscriber.

Subscriber connections (policies named in the README, "Live streams and kvrouter watch"):

* at most ``max_subscribers`` per stream and process; one more is accepted and closed at once with
  1013 (try again later);
* a message is sent when there is one, else a heartbeat ``{"type": "heartbeat"}`` every
  ``heartbeat_seconds``; the client must send something (any message, or a ping) at least every
  ``--http-body-timeout-secs`` (30 s), else the server closes the connection as silent;
* a subscriber whose socket took longer than ``stall_seconds`` to accept one message is hopelessly
  behind: it is closed with 1008 and a reason once that message is out (a socket that takes nothing at
  all is cut by the HTTP write timeout, ``--http-write-timeout-secs``);
* client messages are read and ignored (hypercorn closes one over 1 MiB with 1009);
* when the service stops, every subscriber is closed with 1001.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import orjson
import trio

from kvrouter.actors.service_support import ScopeFilter
from kvrouter.api.http import JSON, HttpError, Request, Response, error_response
from kvrouter.api.routes.metrics import FrontMetrics
from kvrouter.api.routes.support import scope_filter
from kvrouter.api.streams.answer_budget import DEFAULT_BUDGETS, AnswerBudgets
from kvrouter.api.streams.ws_direct import DirectSocket, direct_socket

log = logging.getLogger("kvrouter.api.streams")

DEFAULT_MAX_SUBSCRIBERS = 256
HEARTBEAT_SECONDS = 10.0
STALL_SECONDS = 10.0
UPDATE_INTERVAL_SECONDS = 0.25
# Scope messages a load hub hands to its subscribers per second, all together: past it the hub reads the
# service less often (one update per scope covers more changes), so a process's cost for its subscribers
# stays bounded however many there are (100 subscribers of one scope: an update every 0.5 s).
FAN_OUT_PER_SECOND = 200.0
POLL_SECONDS = 1.5  # a hub's long poll: the service answers within 2 s even when idle
RETRY_SECONDS = 1.0  # after a failed poll
CLOSE_GOING_AWAY = 1001
CLOSE_TOO_SLOW = 1008
CLOSE_TRY_LATER = 1013
HEARTBEAT = orjson.dumps({"type": "heartbeat"}).decode()
STOPPING = "the service is stopping: reconnect once it is back"
PLAIN_GET = "this route speaks WebSocket: open it with a WebSocket upgrade (see the README's live streams)"


@attrs.frozen
class StreamSettings:
    """Bounds of the live streams, per stream and process (``--stream-max-subscribers``); and of the answers of
    ``POST /batch`` and the command stream (``answers``: ``api/streams/answer_budget.py``)."""

    max_subscribers: int = DEFAULT_MAX_SUBSCRIBERS
    heartbeat_seconds: float = HEARTBEAT_SECONDS
    stall_seconds: float = STALL_SECONDS
    # A hub reads the service at most this often: changes in between are one update per scope (conflated), so
    # the work per subscriber is bounded by this rate, not by the service's write rate.
    interval_seconds: float = UPDATE_INTERVAL_SECONDS
    fan_out_per_second: float = FAN_OUT_PER_SECOND
    answers: AnswerBudgets = DEFAULT_BUDGETS


DEFAULT_STREAMS = StreamSettings()


class StreamMetrics:
    """The live streams' figures in ``GET /metrics`` (``FrontMetrics``: summed over ``--fronts`` processes),
    labelled by ``stream`` (``loads``, ``decisions``); counted as things happen, from the hubs."""

    def __init__(self, front: FrontMetrics) -> None:
        self.subscribers = front.gauge("kvrouter_stream_subscribers", "Connected live-stream subscribers", ("stream",))
        self.refused = front.counter(
            "kvrouter_stream_refused", "Subscribers refused over --stream-max-subscribers (closed 1013)", ("stream",)
        )
        self.dropped = front.counter(
            "kvrouter_stream_dropped",
            "Messages a subscriber never got: load states conflated into a newer one, decisions dropped (oldest)",
            ("stream",),
        )
        self.closed_slow = front.counter(
            "kvrouter_stream_closed_slow", "Subscribers closed as hopelessly behind (1008)", ("stream",)
        )

    @classmethod
    def of(cls, front: FrontMetrics) -> StreamMetrics:
        """One per ``FrontMetrics`` (its registry takes each name once)."""
        found = getattr(front, "_stream_metrics", None)
        if found is None:
            found = cls(front)
            front._stream_metrics = found  # type: ignore[attr-defined]
        return found


class StreamCounters:
    """A hub's counters: plain attributes (read them directly), mirrored into ``GET /metrics`` if given."""

    def __init__(self, stream: str, metrics: StreamMetrics | None) -> None:
        self.subscribers = 0
        self.subscribers_peak = 0
        self.refused = 0
        self.dropped = 0  # load states conflated, or decisions dropped
        self.closed_slow = 0
        self.poll_failures = 0
        self._gauge = metrics.subscribers.labels(stream) if metrics is not None else None
        self._refused = metrics.refused.labels(stream) if metrics is not None else None
        self._dropped = metrics.dropped.labels(stream) if metrics is not None else None
        self._slow = metrics.closed_slow.labels(stream) if metrics is not None else None

    def joined(self) -> None:
        self.subscribers += 1
        self.subscribers_peak = max(self.subscribers_peak, self.subscribers)
        if self._gauge is not None:
            self._gauge.inc()

    def left(self) -> None:
        self.subscribers -= 1
        if self._gauge is not None:
            self._gauge.dec()

    def refuse(self) -> None:
        self.refused += 1
        if self._refused is not None:
            self._refused.inc()

    def drop(self, count: int) -> None:
        if count:
            self.dropped += count
            if self._dropped is not None:
                self._dropped.inc(count)

    def closed(self, closing: Closing | None) -> None:
        if closing is not None and closing.code == CLOSE_TOO_SLOW:
            self.closed_slow += 1
            if self._slow is not None:
                self._slow.inc()


class Closing(Exception):
    """Ends a subscriber's connection with this close code and reason."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class Pump:
    """Runs ``poll`` while at least one subscriber offers to (``offer``), one at a time."""

    def __init__(self, poll: Callable[[], Awaitable[None]]) -> None:
        self._poll = poll
        self._running = False
        self._ended = trio.Event()

    async def offer(self) -> None:
        """Pump when nobody else does; return only when cancelled (the subscriber left)."""
        while True:
            if self._running:
                await self._ended.wait()
                continue
            self._running = True
            self._ended = trio.Event()
            try:
                await self._poll()
            finally:
                self._running = False
                self._ended.set()


class Sender:
    """A subscriber's side of the socket: each message timed against the stall bound, heartbeats when idle.
    ``direct``: the socket itself, where a hub may write frames without this task (``api/streams/ws_direct.py``)."""

    def __init__(self, send: Any, settings: StreamSettings, direct: DirectSocket | None = None) -> None:
        self._send = send
        self.settings = settings
        self.direct = direct
        self.messages = 0

    async def text(self, data: str) -> None:
        started = trio.current_time()
        await self._send({"type": "websocket.send", "text": data})
        self.messages += 1
        self._check(started)

    async def flush(self) -> None:
        """Write the rest of a frame a hub wrote in part (timed as one message), if any."""
        if self.direct is not None and self.direct.unsent:
            started = trio.current_time()
            await self.direct.flush()
            self._check(started)

    def _check(self, started: float) -> None:
        took = trio.current_time() - started
        if took > self.settings.stall_seconds:
            raise Closing(
                CLOSE_TOO_SLOW,
                f"too slow: one message took {took:.0f} s to send (bound {self.settings.stall_seconds:g} s)",
            )

    async def heartbeat(self) -> None:
        await self.text(HEARTBEAT)


async def deny(scope: dict[str, Any], send: Any, response: Response) -> None:
    """Refuse an upgrade with a plain HTTP answer (ASGI's denial extension), else by closing before accepting."""
    if "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close"})
        return
    headers = [(b"content-length", str(len(response.body)).encode()), (b"content-type", JSON)]
    await send({"type": "websocket.http.response.start", "status": response.status, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": response.body})


async def refuse_plain_get(request: Request) -> Response:
    raise HttpError(426, PLAIN_GET, ((b"upgrade", b"websocket"),))


async def serve_connection(
    receive: Any,
    send: Any,
    stopping: trio.Event | None,
    *,
    admitted: bool,
    full_reason: str,
    pump: Pump,
    stream: Callable[[Sender], Awaitable[None]],
    settings: StreamSettings,
    direct: DirectSocket | None = None,
) -> Closing | None:
    """Accept the upgrade, then run ``stream`` (which sends until it raises ``Closing``) while pumping the hub,
    reading (and ignoring) client messages; close as the module doc says. Returns how the service closed the
    connection (None: the client left first)."""
    if (await receive())["type"] != "websocket.connect":
        return None
    await send({"type": "websocket.accept"})
    if not admitted:
        refusal = Closing(CLOSE_TRY_LATER, full_reason)
        await send({"type": "websocket.close", "code": refusal.code, "reason": refusal.reason[:120]})
        return refusal
    sender = Sender(send, settings, direct)
    closing: Closing | None = None
    async with trio.open_nursery() as nursery:

        async def read_until_gone() -> None:
            while (await receive())["type"] != "websocket.disconnect":
                pass
            nursery.cancel_scope.cancel()

        async def run_stream() -> None:
            nonlocal closing
            try:
                await stream(sender)
            except Closing as stop:
                closing = stop
            nursery.cancel_scope.cancel()

        async def close_when_stopping() -> None:
            nonlocal closing
            assert stopping is not None
            await stopping.wait()
            closing = Closing(CLOSE_GOING_AWAY, STOPPING)
            nursery.cancel_scope.cancel()

        nursery.start_soon(read_until_gone)
        nursery.start_soon(pump.offer)
        nursery.start_soon(run_stream)
        if stopping is not None:
            nursery.start_soon(close_when_stopping)
    if closing is not None:
        await send({"type": "websocket.close", "code": closing.code, "reason": closing.reason[:120]})
    return closing


def bad_request(exc: HttpError) -> Response:
    return error_response(exc.status, exc.message)


async def serve_subscriber(
    scope: dict[str, Any],
    receive: Any,
    send: Any,
    stopping: trio.Event | None,
    *,
    counters: StreamCounters,
    settings: StreamSettings,
    what: str,
    pump: Pump,
    stream: Callable[[ScopeFilter, Sender], Awaitable[None]],
) -> None:
    """A hub's WebSocket handler: the filters (a bad one refuses the upgrade with 400), the subscriber limit
    (1013), then ``stream`` until the connection ends; counted in ``counters``."""
    try:
        wanted = scope_filter(Request("GET", scope["path"], scope.get("query_string", b""), b""))
    except HttpError as exc:
        await deny(scope, send, bad_request(exc))
        return
    limit = settings.max_subscribers
    admitted = counters.subscribers < limit
    if admitted:
        counters.joined()
    else:
        counters.refuse()
    try:
        closed = await serve_connection(
            receive,
            send,
            stopping,
            admitted=admitted,
            full_reason=f"{limit} {what} subscribers already (--stream-max-subscribers): try again later",
            pump=pump,
            stream=lambda sender: stream(wanted, sender),
            settings=settings,
            direct=direct_socket(scope, send),
        )
    finally:
        if admitted:
            counters.left()
    counters.closed(closed)
