"""``GET /ws/loads``: every matching (worker, dp_rank) load, then one message per change, conflated per scope.

One ``LoadHub`` per process follows the service object's ``load_changes`` (a long poll: the actors only bump
a per-scope version, ``actors/load_feed.py``), renders each changed scope's message once, and marks it
pending for every subscriber whose filter matches. A subscriber keeps only the latest message per scope
(``pending``: scope -> message), so one that reads slowly gets the newest state, never a backlog, and costs
the actors nothing; each intermediate state it skipped is counted (``conflated``). A subscriber that is waiting
with nothing queued is not woken at all: the hub frames the message once and writes the same bytes to each such
subscriber's socket itself (``api/streams/ws_direct.py``: ~20 us per subscriber instead of ~120 us through its task and
hypercorn); one whose socket cannot take it now gets it queued, as above. Messages (JSON text)::

    {"type": "snapshot", "scopes": [SCOPE, ...]}      first, every matching scope, sorted
    {"type": "update", **SCOPE}                       then one per change of a scope
    {"type": "heartbeat"}                             when idle

``SCOPE`` is the scope's ``GET /loads`` content plus ``seq``, the scope's load version: it grows by one with
each applied change that may move its loads, so a gap between two messages of a scope means intermediate
states were conflated. Slot tracker: ``{model_name, tenant_id, routing_group, seq, loads: [GET /loads rows]}``;
selection service: a ``GET /loads`` partition plus ``seq``. A scope that is gone (its last worker left) is
sent once with ``loads: []``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import trio

from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.load_feed import LoadChange, LoadChanges
from kvrouter.actors.select_service import PartitionLoads
from kvrouter.actors.service_support import ScopeFilter
from kvrouter.api.http import Route
from kvrouter.api.routes.operations import route
from kvrouter.api.routes.selection import partition_view
from kvrouter.api.routes.slot_tracker import load_row
from kvrouter.api.routes.support import scope_fields
from kvrouter.api.streams.live import (
    DEFAULT_STREAMS,
    POLL_SECONDS,
    RETRY_SECONDS,
    Pump,
    Sender,
    StreamCounters,
    StreamMetrics,
    StreamSettings,
    refuse_plain_get,
    serve_subscriber,
)
from kvrouter.api.streams.ws_direct import DirectSocket, text_frame

log = logging.getLogger("kvrouter.api.streams")

LOADS_PATH = "/ws/loads"
Fetch = Callable[[str, int, float], Awaitable[LoadChanges]]
Render = Callable[[LoadChange], dict[str, Any]]


class _Subscriber:
    __slots__ = ("conflated", "direct", "idle", "last_sent", "pending", "wake", "wanted")

    def __init__(self, wanted: ScopeFilter, direct: DirectSocket | None) -> None:
        self.wanted = wanted
        self.direct = direct  # its socket, if the hub may write frames to it itself (api/streams/ws_direct.py)
        self.idle = False  # its task waits with nothing queued: a new message may be written directly
        self.last_sent = 0.0  # when it was last sent something (heartbeats fill silences)
        self.pending: dict[ScopeKey, str] = {}  # the latest unsent message per scope
        self.wake = trio.Event()
        self.conflated = 0


class LoadHub:
    """A process's follower of one service's loads (see the module doc). ``counters`` (``StreamCounters``):
    ``subscribers`` (now), ``subscribers_peak``, ``refused`` (over the limit, 1013), ``dropped`` (intermediate
    states a subscriber skipped, conflated into a newer one), ``closed_slow`` (1008), ``poll_failures``."""

    def __init__(
        self,
        fetch: Fetch,
        render: Render,
        settings: StreamSettings = DEFAULT_STREAMS,
        metrics: StreamMetrics | None = None,
    ) -> None:
        self._fetch = fetch
        self._render = render
        self.settings = settings
        self.counters = StreamCounters("loads", metrics)
        self._epoch = ""
        self._cursor = 0
        self._scopes: dict[ScopeKey, str] = {}  # the latest SCOPE json of every listed scope
        self._versions: dict[ScopeKey, int] = {}
        self._subscribers: set[_Subscriber] = set()
        self._synced = trio.Event()  # the hub is current (a poll answered since the first subscriber came)
        self.pump = Pump(self._poll)
        self.updates = 0  # scope messages built
        self.written_directly = 0  # messages written to a subscriber's socket by the hub (api/streams/ws_direct.py)

    async def _poll(self) -> None:
        failing = False
        while True:
            timeout = POLL_SECONDS if self._synced.is_set() else 0.0
            try:
                changes = await self._fetch(self._epoch, self._cursor, timeout)
            except Exception as exc:
                self.counters.poll_failures += 1
                if not failing:
                    log.warning("the load stream cannot read the service's loads (retrying every 1 s): %s", exc)
                failing = True
                await trio.sleep(RETRY_SECONDS)
                continue
            failing = False
            delivered = self._apply(changes)
            if changes.changes:  # the changes meanwhile: one update per scope
                settings = self.settings
                await trio.sleep(max(settings.interval_seconds, delivered / settings.fan_out_per_second))

    def _apply(self, changes: LoadChanges) -> int:
        """Publish each changed scope; returns the messages handed to subscribers."""
        delivered = 0
        if changes.reset:
            gone = set(self._scopes)
            for change in changes.changes:
                gone.discard(change.scope)
            for scope in sorted(gone):
                version = self._versions.get(scope, 0) + 1
                delivered += self._publish(LoadChange(scope, version, None))
        for change in changes.changes:
            delivered += self._publish(change)
        self._epoch, self._cursor = changes.epoch, changes.cursor
        self._synced.set()
        return delivered

    def _publish(self, change: LoadChange) -> int:
        """Render the scope's message once; write its frame (framed once) to each matching subscriber that is
        waiting with nothing queued and whose socket takes it now, else mark it pending (returns how many)."""
        scope = change.scope
        body = self._render(change)
        body["seq"] = change.version
        scope_json = orjson.dumps(body).decode()
        self.updates += 1
        if change.loads is None:
            self._scopes.pop(scope, None)
            self._versions.pop(scope, None)
        else:
            self._scopes[scope] = scope_json
            self._versions[scope] = change.version
        message = '{"type":"update",' + scope_json[1:]
        delivered = conflated = written = 0
        frame = b""
        now = 0.0
        for subscriber in self._subscribers:
            if not subscriber.wanted(scope):
                continue
            delivered += 1
            direct = subscriber.direct
            if subscriber.idle and direct is not None:
                if not frame:
                    frame, now = text_frame(message), trio.current_time()
                if direct.write(frame):
                    written += 1
                    subscriber.last_sent = now
                    if direct.unsent:  # its task writes the rest before anything else
                        subscriber.idle = False
                        subscriber.wake.set()
                    continue
            if scope in subscriber.pending:
                subscriber.conflated += 1
                conflated += 1
            subscriber.pending[scope] = message
            subscriber.idle = False
            subscriber.wake.set()
        self.written_directly += written
        self.counters.drop(conflated)
        return delivered

    def _join(self, wanted: ScopeFilter, direct: DirectSocket | None) -> tuple[_Subscriber, str]:
        """A new subscriber and its snapshot, in one step (no change can fall in between)."""
        subscriber = _Subscriber(wanted, direct)
        self._subscribers.add(subscriber)
        parts = [self._scopes[scope] for scope in sorted(self._scopes) if wanted(scope)]
        return subscriber, '{"type":"snapshot","scopes":[' + ",".join(parts) + "]}"

    def _leave(self, subscriber: _Subscriber) -> None:
        self._subscribers.discard(subscriber)
        if not self._subscribers:
            self._synced = trio.Event()  # nobody polls now: the next subscriber waits for a fresh poll

    async def _stream(self, wanted: ScopeFilter, sender: Sender) -> None:
        await self._synced.wait()
        subscriber, snapshot = self._join(wanted, sender.direct)
        heartbeat = self.settings.heartbeat_seconds
        try:
            await sender.text(snapshot)
            subscriber.last_sent = trio.current_time()
            while True:
                if not subscriber.pending:
                    subscriber.idle = True  # until woken, the hub may write to the socket itself
                    with trio.move_on_at(subscriber.last_sent + heartbeat):
                        await subscriber.wake.wait()
                    subscriber.idle = False
                subscriber.wake = trio.Event()
                await sender.flush()  # the rest of a frame the hub wrote in part, if any
                if subscriber.pending:
                    batch, subscriber.pending = subscriber.pending, {}
                    for message in batch.values():
                        await sender.text(message)
                elif trio.current_time() < subscriber.last_sent + heartbeat:
                    continue  # woken to flush, or the hub wrote to the socket meanwhile: not idle
                else:
                    await sender.heartbeat()
                subscriber.last_sent = trio.current_time()
        finally:
            self._leave(subscriber)

    def route(self) -> Route:
        """``GET /ws/loads`` with the query filters of ``GET /loads``."""

        async def websocket(scope: dict[str, Any], receive: Any, send: Any, stopping: trio.Event | None) -> None:
            await serve_subscriber(
                scope,
                receive,
                send,
                stopping,
                counters=self.counters,
                settings=self.settings,
                what="load",
                pump=self.pump,
                stream=self._stream,
            )

        return route("watch_loads", refuse_plain_get, websocket=websocket)


def slot_load_view(change: LoadChange) -> dict[str, Any]:
    """A slot tracker scope: its scope fields and its ``GET /loads`` rows."""
    rows = [load_row(change.scope, load) for load in change.loads or ()]
    return {**scope_fields(change.scope), "loads": rows}


def partition_load_view(change: LoadChange) -> dict[str, Any]:
    """A selection service partition as ``GET /loads`` lists it (a gone one with no loads)."""
    partition = PartitionLoads(change.scope, change.loads or [], change.pending_count, change.pending_isl_tokens)
    return partition_view(partition)


def slot_loads_route(
    service: Any, settings: StreamSettings = DEFAULT_STREAMS, metrics: StreamMetrics | None = None
) -> tuple[LoadHub, Route]:
    hub = LoadHub(service.load_changes, slot_load_view, settings, metrics)
    return hub, hub.route()


def partition_loads_route(
    service: Any, settings: StreamSettings = DEFAULT_STREAMS, metrics: StreamMetrics | None = None
) -> tuple[LoadHub, Route]:
    hub = LoadHub(service.load_changes, partition_load_view, settings, metrics)
    return hub, hub.route()
