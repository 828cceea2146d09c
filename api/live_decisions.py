"""``GET /ws/decisions`` (selection service): one message per accepted selection, with why it went where it went.

One ``DecisionHub`` per process follows the service object's ``decision_changes`` (a long poll; while it
polls, the actors explain each selection, ``actors/decision_feed.py``), renders each decision once and
appends it to every matching subscriber's queue. Messages (JSON text)::

    {"type": "ready", "seq": N}     first: decisions after seq N follow
    {"type": "decision", "seq": ..., "at_ns": ..., model_name, tenant_id, routing_group, "reserved": bool,
     "selection_id", "reservation_id", "worker_id", "dp_rank", "endpoint", "overlap", "effective_prefill_tokens",
     "potential_decode_blocks", "explain": {reason, rule, router_mode, temperature, isl_tokens, block_size,
     candidates: [...]}}
    {"type": "heartbeat"}           when idle

``seq`` numbers this process's decisions: a gap means decisions were dropped (below). The ``worker_id``,
``dp_rank``, ``overlap`` and the two load fields are the ``/select`` reply's; ``explain`` is what
``"explain": true`` adds to one. Filters: ``model_name``, ``tenant_id`` (alias ``routing_group``).

Bounds: each subscriber's queue holds at most ``QUEUE_MESSAGES`` decisions and ``QUEUE_BYTES`` bytes; policy:
drop oldest (a subscriber reading slowly sees the newest decisions, with gaps in ``seq``), counted per
subscriber and in ``counters.dropped``. Counters (``StreamCounters``, also in ``GET /metrics``): ``subscribers``,
``subscribers_peak``, ``refused``, ``dropped``, ``closed_slow``, ``poll_failures``.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import trio

from kvrouter.actors.decision_feed import DecisionBatch, DecisionRecord
from kvrouter.actors.service_support import ScopeFilter
from kvrouter.api.http import Route
from kvrouter.api.live_streams import (
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
from kvrouter.api.operation_routes import route
from kvrouter.api.route_support import scope_fields
from kvrouter.api.select_routes import explanation_view

log = logging.getLogger("kvrouter.api.streams")

DECISIONS_PATH = "/ws/decisions"
QUEUE_MESSAGES = 1024
QUEUE_BYTES = 4 * 1024 * 1024
Fetch = Callable[[str, int, float], Awaitable[DecisionBatch]]


def decision_view(record: DecisionRecord) -> dict[str, Any]:
    explanation = record.explanation
    return {
        "type": "decision",
        "seq": record.seq,
        "at_ns": record.at,
        **scope_fields(record.scope),
        "reserved": record.reserved,
        "selection_id": record.selection_id,
        "reservation_id": record.reservation_id,
        "worker_id": explanation.worker_id,
        "dp_rank": explanation.dp_rank,
        "endpoint": record.endpoint,
        "overlap": record.overlap,
        "effective_prefill_tokens": record.effective_prefill_tokens,
        "potential_decode_blocks": record.potential_decode_blocks,
        "explain": explanation_view(explanation),
    }


class _Subscriber:
    __slots__ = ("bytes", "dropped", "queue", "wake", "wanted")

    def __init__(self, wanted: ScopeFilter) -> None:
        self.wanted = wanted
        self.queue: deque[str] = deque()
        self.bytes = 0
        self.dropped = 0
        self.wake = trio.Event()


class DecisionHub:
    def __init__(
        self, fetch: Fetch, settings: StreamSettings = DEFAULT_STREAMS, metrics: StreamMetrics | None = None
    ) -> None:
        self._fetch = fetch
        self.settings = settings
        self.counters = StreamCounters("decisions", metrics)
        self._epoch = ""
        self._cursor = 0
        self._subscribers: set[_Subscriber] = set()
        self._synced = trio.Event()
        self.pump = Pump(self._poll)
        self.decisions = 0  # decision messages rendered

    async def _poll(self) -> None:
        failing = False
        while True:
            wait = POLL_SECONDS if self._synced.is_set() else 0.0
            try:
                batch = await self._fetch(self._epoch, self._cursor, wait)
            except Exception as exc:
                self.counters.poll_failures += 1
                if not failing:
                    log.warning("the decision stream cannot read the service's decisions (retrying every 1 s): %s", exc)
                failing = True
                await trio.sleep(RETRY_SECONDS)
                continue
            failing = False
            self._apply(batch)
            if batch.records:
                await trio.sleep(self.settings.interval_seconds)  # the decisions meanwhile come in one batch

    def _apply(self, batch: DecisionBatch) -> None:
        if batch.missed and batch.epoch == self._epoch:
            for subscriber in self._subscribers:
                subscriber.dropped += batch.missed
            self.counters.drop(batch.missed * len(self._subscribers))
        for record in batch.records:
            message = orjson.dumps(decision_view(record)).decode()
            self.decisions += 1
            for subscriber in self._subscribers:
                if subscriber.wanted(record.scope):
                    self._enqueue(subscriber, message)
        self._epoch, self._cursor = batch.epoch, batch.cursor
        self._synced.set()

    def _enqueue(self, subscriber: _Subscriber, message: str) -> None:
        """Append; beyond the queue's bounds the oldest decisions go (counted)."""
        subscriber.queue.append(message)
        subscriber.bytes += len(message)
        while len(subscriber.queue) > QUEUE_MESSAGES or (subscriber.bytes > QUEUE_BYTES and len(subscriber.queue) > 1):
            subscriber.bytes -= len(subscriber.queue.popleft())
            subscriber.dropped += 1
            self.counters.drop(1)
        subscriber.wake.set()

    def _leave(self, subscriber: _Subscriber) -> None:
        self._subscribers.discard(subscriber)
        if not self._subscribers:
            self._synced = trio.Event()

    async def _stream(self, wanted: ScopeFilter, sender: Sender) -> None:
        await self._synced.wait()
        subscriber = _Subscriber(wanted)
        self._subscribers.add(subscriber)
        try:
            await sender.text(orjson.dumps({"type": "ready", "seq": self._cursor}).decode())
            while True:
                with trio.move_on_after(self.settings.heartbeat_seconds):
                    await subscriber.wake.wait()
                if not subscriber.queue:
                    await sender.heartbeat()
                    continue
                subscriber.wake = trio.Event()
                while subscriber.queue:
                    message = subscriber.queue.popleft()
                    subscriber.bytes -= len(message)
                    await sender.text(message)
        finally:
            self._leave(subscriber)

    def route(self) -> Route:
        async def websocket(scope: dict[str, Any], receive: Any, send: Any, stopping: trio.Event | None) -> None:
            await serve_subscriber(
                scope,
                receive,
                send,
                stopping,
                counters=self.counters,
                settings=self.settings,
                what="decision",
                pump=self.pump,
                stream=self._stream,
            )

        return route("watch_decisions", refuse_plain_get, websocket=websocket)


def decisions_route(
    service: Any, settings: StreamSettings = DEFAULT_STREAMS, metrics: StreamMetrics | None = None
) -> tuple[DecisionHub, Route]:
    hub = DecisionHub(service.decision_changes, settings, metrics)
    return hub, hub.route()
