"""``GET /ws/decisions`` (selection service): one message per accepted selection, with why it went where it went.

One ``DecisionHub`` per process follows the service object's ``decision_changes`` (a long poll; while it
polls, the actors explain selections, as many a second as the hub can hand out: ``explain_wants``,
``actors/decision_feed.py``), renders each decision once and appends it to every matching subscriber's queue.
Messages (JSON text)::

    {"type": "ready", "seq": N}     first: decisions after seq N follow
    {"type": "decision", "seq": ..., "at_ns": ..., model_name, tenant_id, routing_group, "reserved": bool,
     "selection_id", "reservation_id", "worker_id", "dp_rank", "endpoint", "overlap", "effective_prefill_tokens",
     "potential_decode_blocks", "explain": {reason, rule, router_mode, temperature, isl_tokens, block_size,
     candidates: [...]}}
    {"type": "heartbeat"}           when idle

``seq`` numbers this process's decisions: a gap means decisions were dropped (below). The ``worker_id``,
``dp_rank``, ``overlap`` and the two load fields are the ``/select`` reply's; ``explain`` is what
``"explain": true`` adds to one. Filters: ``model_name``, ``tenant_id`` (alias ``routing_group``).

Delivery (policies named in ``docs/running-safely.md``, "Answer and stream budgets"): the hub reads the service at
most every ``interval_seconds`` (0.25 s), and less often past ``fan_out_per_second`` chunks handed out (200 a
second: with 250 subscribers, a read every 1.25 s, so its socket writes stay bounded too); the decisions of one
read go to every subscriber of one filter as one shared chunk, rendered and framed once
(``api/streams/ws_direct.py``), written straight to each waiting subscriber's socket (one write per subscriber
per read, not one task switch and ASGI send per decision). Three service-wide bounds:

* **fan-out** (conflate): the hub hands its subscribers at most ``FAN_OUT_BYTES_PER_SECOND`` all together. Each
  subscriber's share of it (the budget over the subscriber count) is credited to its filter's group at each read,
  and a chunk holds the newest decisions that fit the credit; older ones are dropped (``seq`` shows the gap). So
  one subscriber sees every decision up to ~4 MiB/s of them, and 250 subscribers cost the process what one does
  at that rate; a decision larger than a subscriber's credit (one second's share at most) is not delivered;
* **explanations** (sample): each poll tells the service, per filter, how many decisions a second the hub can
  hand out (a subscriber's share of the budget over the mean size of a decision message), and the service
  explains no more of the selections that filter matches (the rest are numbered, not explained: gaps). A
  join or leave that moves that rate by more than half, or brings a filter the poll under way did not name,
  ends that poll, so the next one asks anew;
* **pending** (drop oldest): chunks written to no socket yet (a subscriber reading slowly) are held up to
  ``QUEUE_BYTES`` per subscriber and ``PENDING_BYTES`` over all of them (each subscriber's share of it: the
  bound over the subscriber count); past it the subscriber's oldest chunks go.

Every decision a subscriber does not get is counted in ``counters.dropped``. Counters (``StreamCounters``, also
in ``GET /metrics``): ``subscribers``, ``subscribers_peak``, ``refused``, ``dropped``, ``closed_slow``,
``poll_failures``.
"""

from __future__ import annotations

import logging
import secrets
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import trio

from kvrouter.actors.decision_feed import DecisionBatch, DecisionRecord, Want
from kvrouter.actors.service_support import EVERY_SCOPE, ScopeFilter
from kvrouter.api.http import Route
from kvrouter.api.routes.operations import route
from kvrouter.api.routes.selection import explanation_view
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

DECISIONS_PATH = "/ws/decisions"
MIB = 1 << 20
FAN_OUT_BYTES_PER_SECOND = 4 * MIB
QUEUE_BYTES = 4 * MIB
PENDING_BYTES = 16 * MIB
MIN_CREDIT = 16 * 1024  # a group's credit may grow to this (or a second's share, if larger) between decisions
MAX_ELAPSED_SECONDS = 2.0  # a read after a longer pause is credited as if after this one
MESSAGE_BYTES = 1024.0  # a decision message's size, before the hub has rendered one (on the small side: more)
Fetch = Callable[[str, int, float, list[Want] | None, str], Awaitable[DecisionBatch]]


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


class _Chunk:
    """Decisions of one read for one filter: their messages, and their frames joined (made on first use)."""

    __slots__ = ("_frame", "messages", "size")

    def __init__(self, messages: list[str], size: int) -> None:
        self.messages = messages
        self.size = size
        self._frame = b""

    @property
    def frame(self) -> bytes:
        if not self._frame:
            self._frame = b"".join(text_frame(message) for message in self.messages)
        return self._frame


class _Subscriber:
    __slots__ = ("bytes", "direct", "dropped", "idle", "queue", "wake", "wanted")

    def __init__(self, wanted: ScopeFilter, direct: DirectSocket | None) -> None:
        self.wanted = wanted
        self.direct = direct  # its socket, if the hub may write frames to it itself (api/streams/ws_direct.py)
        self.idle = False  # its task waits with nothing queued: a chunk may be written directly
        self.queue: deque[_Chunk] = deque()
        self.bytes = 0
        self.dropped = 0
        self.wake = trio.Event()


class _Group:
    """The subscribers of one filter: they get the same chunks, paid from one credit (see the module doc)."""

    __slots__ = ("credit", "members")

    def __init__(self, credit: float) -> None:
        self.members: set[_Subscriber] = set()
        self.credit = credit  # bytes it may be handed now


class DecisionHub:
    def __init__(
        self, fetch: Fetch, settings: StreamSettings = DEFAULT_STREAMS, metrics: StreamMetrics | None = None
    ) -> None:
        self._fetch = fetch
        self.settings = settings
        self.counters = StreamCounters("decisions", metrics)
        self._epoch = ""
        self._cursor = 0
        self._groups: dict[ScopeFilter, _Group] = {}
        self._subscribers = 0
        self._synced = trio.Event()
        self._last_read = 0.0
        self._pause = settings.interval_seconds  # the hub's pause after its last read with decisions
        self._reader = secrets.token_hex(8)  # this hub, to the service's explanation budget
        self._message_bytes = MESSAGE_BYTES  # the mean size of a decision message (moving average)
        self._asked: tuple[float, frozenset[ScopeFilter]] = (0.0, frozenset())  # what the poll under way asked
        self._fetching: trio.CancelScope | None = None  # the poll under way
        self.pump = Pump(self._poll)
        self.decisions = 0  # decision messages rendered
        self.pending = 0  # bytes of chunks queued for subscribers, all together
        self.sent_bytes = 0  # bytes of decisions handed to subscribers (written or queued)
        self.written_directly = 0  # chunks written to a subscriber's socket by the hub (api/streams/ws_direct.py)

    async def _poll(self) -> None:
        failing = False
        while True:
            wait = POLL_SECONDS if self._synced.is_set() else 0.0
            wants = self.explain_wants()
            self._asked = (wants[0].per_second, frozenset(want.wanted for want in wants))
            fetching = self._fetching = trio.CancelScope()
            try:
                with fetching:
                    batch = await self._fetch(self._epoch, self._cursor, wait, wants, self._reader)
            except Exception as exc:
                self._fetching = None
                self.counters.poll_failures += 1
                if not failing:
                    log.warning("the decision stream cannot read the service's decisions (retrying every 1 s): %s", exc)
                failing = True
                await trio.sleep(RETRY_SECONDS)
                continue
            self._fetching = None
            if fetching.cancelled_caught:
                continue  # the subscriber count moved the rate (``_rate_moved``): poll again at once
            failing = False
            handed = self._apply(batch)
            if batch.records:  # the decisions meanwhile come in one batch; past the chunk rate, less often
                settings = self.settings
                self._pause = max(settings.interval_seconds, handed / settings.fan_out_per_second)
                await trio.sleep(self._pause)

    def _per_second(self) -> float:
        """The decisions a second one filter's subscribers can be handed: a subscriber's share of the fan-out
        budget over the mean message size (one subscriber's, with none yet)."""
        return FAN_OUT_BYTES_PER_SECOND / max(self._subscribers, 1) / self._message_bytes

    def explain_wants(self) -> list[Want]:
        """What this hub asks the service to explain at most: each filter's rate (every scope's, with no
        subscriber yet: the first is about to join)."""
        per_second = self._per_second()
        return [Want(wanted, per_second) for wanted in self._groups] or [Want(EVERY_SCOPE, per_second)]

    def _rate_moved(self) -> None:
        """After a join or a leave: a poll under way that asked for less than half or more than twice the rate
        now, or did not name a filter now used (nor every scope), is ended (``_poll`` asks again)."""
        if self._fetching is None:
            return
        asked, filters = self._asked
        moved = not asked / 2 <= self._per_second() <= asked * 2
        if moved or (EVERY_SCOPE not in filters and not filters.issuperset(self._groups)):
            self._fetching.cancel()

    def _apply(self, batch: DecisionBatch) -> int:
        """Hand ``batch`` out (see the module doc); returns the chunks handed to subscribers."""
        if batch.missed and batch.epoch == self._epoch:
            for group in self._groups.values():
                for subscriber in group.members:
                    subscriber.dropped += batch.missed
            self.counters.drop(batch.missed * self._subscribers)
        now = trio.current_time()
        elapsed = min(max(now - self._last_read, self.settings.interval_seconds), MAX_ELAPSED_SECONDS)
        self._last_read = now
        if self._subscribers:
            share = FAN_OUT_BYTES_PER_SECOND / self._subscribers
            for group in self._groups.values():
                group.credit = min(group.credit + share * elapsed, _most_credit(share * max(1.0, self._pause)))
        handed = 0
        if batch.records and self._subscribers:
            messages = [(record.scope, orjson.dumps(decision_view(record)).decode()) for record in batch.records]
            self.decisions += len(messages)
            mean = sum(len(message) for _, message in messages) / len(messages)
            self._message_bytes = 0.75 * self._message_bytes + 0.25 * mean
            for wanted, group in self._groups.items():
                handed += self._publish(group, [message for scope, message in messages if wanted(scope)])
        self._epoch, self._cursor = batch.epoch, batch.cursor
        self._synced.set()
        return handed

    def _publish(self, group: _Group, matching: list[str]) -> int:
        """The newest of ``matching`` that fit the group's credit, as one chunk to each member (see the module
        doc); the rest are dropped (counted). Returns the chunks handed out."""
        if not matching:
            return 0
        kept: list[str] = []
        size = 0
        for message in reversed(matching):
            if size + len(message) > group.credit:
                break
            kept.append(message)
            size += len(message)
        kept.reverse()
        group.credit -= size
        self.counters.drop((len(matching) - len(kept)) * len(group.members))
        if not kept:
            for subscriber in group.members:
                subscriber.dropped += len(matching)
            return 0
        chunk = _Chunk(kept, size)
        written = 0
        for subscriber in group.members:
            subscriber.dropped += len(matching) - len(kept)
            self.sent_bytes += size
            direct = subscriber.direct
            if subscriber.idle and direct is not None and direct.write(chunk.frame):
                written += 1
                if direct.unsent:  # its task writes the rest before anything else
                    subscriber.idle = False
                    subscriber.wake.set()
                continue
            self._enqueue(subscriber, chunk)
        self.written_directly += written
        return len(group.members)

    def _enqueue(self, subscriber: _Subscriber, chunk: _Chunk) -> None:
        """Append; beyond the subscriber's bound (its share of PENDING_BYTES, at most QUEUE_BYTES) its oldest
        chunks go (counted)."""
        queue = subscriber.queue
        queue.append(chunk)
        subscriber.bytes += chunk.size
        self.pending += chunk.size
        bound = min(QUEUE_BYTES, PENDING_BYTES // max(self._subscribers, 1))
        while len(queue) > 1 and subscriber.bytes > bound:
            old = queue.popleft()
            subscriber.bytes -= old.size
            self.pending -= old.size
            subscriber.dropped += len(old.messages)
            self.counters.drop(len(old.messages))
        subscriber.idle = False
        subscriber.wake.set()

    def _join(self, wanted: ScopeFilter, direct: DirectSocket | None) -> _Subscriber:
        subscriber = _Subscriber(wanted, direct)
        group = self._groups.get(wanted)
        if group is None:  # a new filter starts with a full credit (a second's share)
            group = self._groups[wanted] = _Group(_most_credit(FAN_OUT_BYTES_PER_SECOND / (self._subscribers + 1)))
        group.members.add(subscriber)
        self._subscribers += 1
        self._rate_moved()
        return subscriber

    def _leave(self, subscriber: _Subscriber) -> None:
        group = self._groups[subscriber.wanted]
        group.members.discard(subscriber)
        if not group.members:
            del self._groups[subscriber.wanted]
        self._subscribers -= 1
        self.pending -= subscriber.bytes
        subscriber.queue.clear()
        subscriber.bytes = 0
        if not self._subscribers:
            self._synced = trio.Event()
        self._rate_moved()

    async def _stream(self, wanted: ScopeFilter, sender: Sender) -> None:
        await self._synced.wait()
        subscriber = self._join(wanted, sender.direct)
        heartbeat = self.settings.heartbeat_seconds
        try:
            await sender.text(orjson.dumps({"type": "ready", "seq": self._cursor}).decode())
            last_sent = trio.current_time()
            while True:
                if not subscriber.queue:
                    subscriber.idle = True  # until woken, the hub may write to the socket itself
                    with trio.move_on_at(last_sent + heartbeat):
                        await subscriber.wake.wait()
                    subscriber.idle = False
                subscriber.wake = trio.Event()
                await sender.flush()  # the rest of a chunk the hub wrote in part, if any
                if subscriber.queue:
                    while subscriber.queue:
                        chunk = subscriber.queue.popleft()
                        subscriber.bytes -= chunk.size
                        self.pending -= chunk.size
                        await _send_chunk(sender, chunk)
                elif trio.current_time() < last_sent + heartbeat:
                    continue  # woken to flush, or the hub wrote to the socket meanwhile: not idle
                else:
                    await sender.heartbeat()
                last_sent = trio.current_time()
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


def _most_credit(share: float) -> float:
    """The most credit a group may hold: its share over a second (or the hub's pause, if longer), or
    MIN_CREDIT."""
    return max(share, MIN_CREDIT)


async def _send_chunk(sender: Sender, chunk: _Chunk) -> None:
    """A chunk by its task: its frames in one write where the socket takes them, else message by message."""
    direct = sender.direct
    if direct is not None and direct.write(chunk.frame):
        await sender.flush()
        return
    for message in chunk.messages:
        await sender.text(message)


def decisions_route(
    service: Any, settings: StreamSettings = DEFAULT_STREAMS, metrics: StreamMetrics | None = None
) -> tuple[DecisionHub, Route]:
    hub = DecisionHub(service.decision_changes, settings, metrics)
    return hub, hub.route()
