"""Per-rank KV-event stream health, for kvrouter's per-rank fallback to predicted blocks (``core/kv_modes.py``).

Shell state, never journaled: it follows applied events (a booking on a rank starts its "unanswered" clock, a
KV batch from the rank stops it) and the rank's listener (connected or not, and since when, as first seen
here), and hands the pure rule the timestamps. Bounded by the registered ranks: entries of ranks that leave
are dropped when their worker does.
"""

from __future__ import annotations

from collections.abc import Callable

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.commands import Command
from kvrouter.actors.core.events import Event, KvIndexed, KvStreamReset, RequestAdded, WorkerRemoved
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.kv_modes import EXACT, KvMode, RankMode, StreamHealth, rank_mode
from kvrouter.actors.core.state import ScopeState

NO_RANKS: frozenset[WorkerRank] = frozenset()

# Whether a rank's listener is connected: True / False, or None when it has no listener.
ListenerConnected = Callable[[int, int], bool | None]


class KvHealth:
    def __init__(
        self, connected: ListenerConnected, stale_after_secs: float, all_connected: Callable[[], bool] | None = None
    ) -> None:
        self._connected = connected
        # Whether every listener (of every rank) is connected now, when the caller can tell at once: then a
        # selection with nothing unanswered and nothing seen down asks no rank.
        self._all_connected = all_connected
        self.stale_after_secs = stale_after_secs
        self._unanswered: dict[tuple[ScopeKey, WorkerRank], int] = {}  # first booking since the last batch
        self._down_since: dict[tuple[ScopeKey, WorkerRank], int] = {}  # first seen not connected

    def observe(self, state: ScopeState, command: Command, events: tuple[Event, ...]) -> None:
        scope = state.scope
        for event in events:
            if isinstance(event, RequestAdded):
                self._unanswered.setdefault((scope, WorkerRank(event.worker_id, event.dp_rank)), event.at)
            elif isinstance(event, KvIndexed) and event.seq is not None:
                self._unanswered.pop((scope, WorkerRank(event.worker_id, event.dp_rank)), None)
                self._unanswered.pop((scope, WorkerRank(event.worker_id, event.stream_rank)), None)
            elif isinstance(event, KvStreamReset):
                self._unanswered.pop((scope, WorkerRank(event.worker_id, event.dp_rank)), None)
            elif isinstance(event, WorkerRemoved):
                for key in [k for k in (*self._unanswered, *self._down_since) if k[1].worker_id == event.worker_id]:
                    self._unanswered.pop(key, None)
                    self._down_since.pop(key, None)

    def mode(self, scope: ScopeKey, rank: WorkerRank, now: int) -> RankMode:
        key = (scope, rank)
        connected = self._connected(rank.worker_id, rank.dp_rank)
        if connected is None:
            return EXACT  # no listener at all: the worker is not schedulable with KV events anyway
        if connected:
            self._down_since.pop(key, None)
        else:
            self._down_since.setdefault(key, now)
        health = StreamHealth(connected, self._down_since.get(key), self._unanswered.get(key))
        return rank_mode(health, now, self.stale_after_secs)

    def modes(self, scope: ScopeKey, record: WorkerRecord, now: int) -> dict[WorkerRank, RankMode]:
        return {rank: self.mode(scope, rank, now) for rank in record.ranks}

    def predicted_ranks(self, state: ScopeState, workers: tuple[WorkerRecord, ...], now: int) -> frozenset[WorkerRank]:
        """The ranks of ``workers`` to score on predicted blocks now.

        Every selection asks this for every rank, so the common case is kept cheap: a connected rank with no
        unanswered booking is exact whatever the time (``rank_mode``), and only forgets when it was seen down;
        any other rank goes through ``mode`` (which also notes when a rank was first seen down)."""
        if self.stale_after_secs <= 0:
            return NO_RANKS
        scope, connected_now, unanswered, down_since = state.scope, self._connected, self._unanswered, self._down_since
        if not unanswered and not down_since and self._all_connected is not None and self._all_connected():
            return NO_RANKS  # each rank is connected or has no listener: exact (below), nothing to forget
        predicted = []
        for record in workers:
            for rank in record.ranks:
                connected = connected_now(rank.worker_id, rank.dp_rank)
                if connected is None:
                    continue  # no listener: exact (``mode``)
                if connected and (not unanswered or (scope, rank) not in unanswered):
                    if down_since:
                        down_since.pop((scope, rank), None)
                    continue
                if self.mode(scope, rank, now).mode is KvMode.PREDICTED:
                    predicted.append(rank)
        return frozenset(predicted) if predicted else NO_RANKS
