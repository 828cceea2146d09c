"""Per-rank KV-event stream health, for kvrouter's per-rank fallback to predicted blocks (``core/kv_modes.py``) and
for taking a rank out of selection when its stream stops while it has traffic (``core/kv_liveness.py``).

Shell state, never journaled: it follows applied events (a booking on a rank starts its "unanswered" clock, a
KV batch from the rank stops it) and the ranks' KV feeds (connected or not, and since when, as first seen here):
the engines' ZMQ listeners (``KvIngest``) and, with a fleet, Dynamo's event plane (``fleet/event_ingest.py``), one
rule for both (``Feeds``). A selection carries what it knows when the selection is asked (``view``: a
``StreamView``), and the scope's desk decides from it which of the scope's ranks to score on predicted blocks, and
which to leave out (``check``, on the service's clock, takes ranks out and brings them back; the service frees the
bookings of those taken out with a journaled command). Bounded by the registered ranks: entries of ranks that leave
are dropped when their worker does, and "down since" is kept only for listeners that are not connected now.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.commands import Command
from kvrouter.actors.core.events import Event, KvIndexed, KvStreamReset, RequestAdded, WorkerRemoved
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.kv_liveness import (
    BACK_EVENTS,
    BACK_RECONNECTED,
    KV_EVENTS_STOPPED,
    NS_PER_SECOND,
    KvLiveness,
    Transition,
)
from kvrouter.actors.core.kv_modes import EXACT, HEALTHY, RankMode, StreamHealth, StreamView, rank_mode
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.metric_families import Family, Labels, counter, gauge

log = logging.getLogger("kvrouter.kv_health")


class Listeners(Protocol):
    """A KV feed, as the health follows it: the engines' ZMQ listeners (``KvIngest``), or Dynamo's event plane
    (``EventPlaneIngest``: a rank has a "listener" while discovery names a publisher for it)."""

    def connected(self, worker_id: int, dp_rank: int) -> bool | None:
        """Whether the rank's listener is connected now; None when the rank has no listener."""
        ...

    def all_connected(self) -> bool:
        """Whether every listener is connected now."""
        ...

    def listening(self) -> Iterable[tuple[int, int]]:
        """The (worker id, dp rank) of every rank with a listener."""
        ...


class Feeds:
    """Several KV feeds as one ``Listeners``: a rank is answered for by the first feed that knows it (a rank has one
    feed: a discovered worker's events come over the event plane, a registered worker's from its listener)."""

    def __init__(self, first: Listeners) -> None:
        self._feeds = [first]

    def add(self, feed: Listeners) -> None:
        self._feeds.append(feed)

    def connected(self, worker_id: int, dp_rank: int) -> bool | None:
        for feed in self._feeds:
            state = feed.connected(worker_id, dp_rank)
            if state is not None:
                return state
        return None

    def all_connected(self) -> bool:
        for feed in self._feeds:  # noqa: SIM110 - a plain loop: every selection asks
            if not feed.all_connected():
                return False
        return True

    def listening(self) -> list[tuple[int, int]]:
        return [rank for feed in self._feeds for rank in feed.listening()]


class KvHealth:
    """``stale_after_secs`` (0: off) drives the fallback to predicted blocks; ``out_after_secs`` (0: off) takes a
    rank out of selection (``core/kv_liveness.py``), which also needs the bookings it keeps, so both share them."""

    def __init__(self, listeners: Listeners, stale_after_secs: float, out_after_secs: float = 0.0) -> None:
        self._listeners: Listeners = listeners
        self.stale_after_secs = stale_after_secs
        self.liveness = KvLiveness(out_after_secs)
        self._down_since: dict[WorkerRank, int] = {}  # listeners not connected now: first seen so

    def add_feed(self, feed: Listeners) -> None:
        """Follow the ranks ``feed`` speaks for too (Dynamo's event plane, next to the KV listeners). Without one, the
        listeners are asked directly: a selection costs what it did."""
        feeds = self._listeners if isinstance(self._listeners, Feeds) else Feeds(self._listeners)
        feeds.add(feed)
        self._listeners = feeds

    def observe(self, state: ScopeState, command: Command, events: tuple[Event, ...]) -> None:
        scope = state.scope
        liveness = self.liveness
        for event in events:
            if isinstance(event, RequestAdded):
                liveness.booked(scope, WorkerRank(event.worker_id, event.dp_rank), event.at)
            elif isinstance(event, KvIndexed) and event.seq is not None:
                self._heard(liveness.heard(scope, WorkerRank(event.worker_id, event.dp_rank)))
                self._heard(liveness.heard(scope, WorkerRank(event.worker_id, event.stream_rank)))
            elif isinstance(event, KvStreamReset):
                self._heard(liveness.heard(scope, WorkerRank(event.worker_id, event.dp_rank)))
            elif isinstance(event, WorkerRemoved):
                liveness.forget_worker(scope, event.worker_id)
                for rank in [r for r in self._down_since if r.worker_id == event.worker_id]:
                    del self._down_since[rank]

    def _heard(self, back: Transition | None) -> None:
        if back is not None:
            log.warning(
                "worker %d dp_rank %d (%s) back in selection: its KV events resumed",
                back.rank.worker_id,
                back.rank.dp_rank,
                back.scope.describe(),
            )

    def check(self, now: int) -> list[Transition]:
        """Ranks taken out of selection, or back, at ``now`` (``KvLiveness.check``); each logged in one line. The
        caller frees the bookings of those taken out."""
        connected = self._listeners.connected
        changes = self.liveness.check(now, lambda rank: connected(rank.worker_id, rank.dp_rank))
        for change in changes:
            rank = change.rank
            if change.out:
                log.warning(
                    "worker %d dp_rank %d (%s) out of selection: no KV events for %.1f s after a booking; "
                    "its bookings are freed",
                    rank.worker_id,
                    rank.dp_rank,
                    change.scope.describe(),
                    change.silent_ns / NS_PER_SECOND,
                )
            else:
                log.warning(
                    "worker %d dp_rank %d (%s) back in selection: its KV stream reconnected",
                    rank.worker_id,
                    rank.dp_rank,
                    change.scope.describe(),
                )
        return changes

    def view(self, scope: ScopeKey, now: int) -> StreamView:
        """What a selection in ``scope`` asked at ``now`` carries: the listeners down (and since when), and the
        scope's connected ranks with a booking their stream has not answered. Every selection asks, so the usual
        case (everything connected, nothing unanswered) costs a pass over the listeners' states and no copy."""
        liveness = self.liveness
        out = tuple(liveness.out(scope)) if liveness.any_out() else ()
        if self.stale_after_secs <= 0:
            return StreamView(out=out) if out else HEALTHY  # the fallback is off
        listeners = self._listeners
        unanswered = liveness.unanswered(scope)
        healthy = not self._down_since and listeners.all_connected()
        if healthy and not unanswered and not out:
            return HEALTHY
        down = () if healthy else tuple(self._refresh(now).items())
        waiting: tuple[tuple[WorkerRank, int], ...] = ()
        if unanswered:
            connected = listeners.connected
            waiting = tuple((rank, at) for rank, at in unanswered.items() if connected(rank.worker_id, rank.dp_rank))
        return StreamView(down, waiting, out)

    def modes(self, scope: ScopeKey, record: WorkerRecord, now: int) -> dict[WorkerRank, RankMode]:
        """Each rank's mode now, rank by rank (``GET /workers``): the definition ``view`` carries to selections."""
        down = self._refresh(now)
        unanswered = self.liveness.unanswered(scope)
        modes = {}
        for rank in record.ranks:
            connected = self._listeners.connected(rank.worker_id, rank.dp_rank)
            if connected is None:
                modes[rank] = EXACT  # no listener at all: the worker is not schedulable with KV events anyway
                continue
            health = StreamHealth(connected, down.get(rank), unanswered.get(rank))
            modes[rank] = rank_mode(health, now, self.stale_after_secs)
        return modes

    def _refresh(self, now: int) -> dict[WorkerRank, int]:
        """Note every listener not connected now (first seen so at ``now`` unless seen before), forget the rest."""
        connected = self._listeners.connected
        before = self._down_since
        down = {}
        for worker_id, dp_rank in self._listeners.listening():
            if connected(worker_id, dp_rank) is False:
                rank = WorkerRank(worker_id, dp_rank)
                down[rank] = before.get(rank, now)
        self._down_since = down
        return down

    def outages(self, scope: ScopeKey, record: WorkerRecord, now: int) -> dict[str, dict[str, object]]:
        """Per dp rank of ``record`` out of selection, why and since when (``GET /workers``'s ``out_of_selection``):
        times in Unix seconds, as the service's clock stamps them."""
        out = self.liveness.out(scope)
        shown: dict[str, dict[str, object]] = {}
        for rank in record.ranks:
            outage = out.get(rank)
            if outage is None:
                continue
            shown[str(rank.dp_rank)] = {
                "reason": KV_EVENTS_STOPPED,
                "detail": f"no KV events for {(outage.out_since_ns - outage.silent_since_ns) / NS_PER_SECOND:.1f} s "
                "after a booking; back when they resume",
                "silent_since": round(outage.silent_since_ns / NS_PER_SECOND, 3),
                "out_since": round(outage.out_since_ns / NS_PER_SECOND, 3),
                "out_for_secs": round(max(0, now - outage.out_since_ns) / NS_PER_SECOND, 3),
            }
        return shown

    def families(self) -> list[Family]:
        """``/metrics``: ranks taken out of selection and back since the start, and those out now."""
        liveness = self.liveness
        if not liveness.enabled:
            return []
        returned: dict[Labels, float] = {(cause,): float(n) for cause, n in liveness.counts.returned.items()}
        for cause in (BACK_EVENTS, BACK_RECONNECTED):
            returned.setdefault((cause,), 0.0)
        return [
            counter(
                "kvrouter_kv_stream_outages",
                "Ranks taken out of selection because their KV events stopped while they had traffic",
                ("reason",),
                {(KV_EVENTS_STOPPED,): float(liveness.counts.taken_out)},
            ),
            counter(
                "kvrouter_kv_stream_returns",
                "Ranks back in selection after an outage, by cause (events resumed, stream reconnected)",
                ("cause",),
                returned,
            ),
            gauge(
                "kvrouter_ranks_out_of_selection", "Ranks out of selection now", (), {(): float(liveness.out_count())}
            ),
        ]
