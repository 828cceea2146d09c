"""Per-rank KV-event stream health, for kvrouter's per-rank fallback to predicted blocks (``core/kv_modes.py``).

Shell state, never journaled: it follows applied events (a booking on a rank starts its "unanswered" clock, a
KV batch from the rank stops it) and the ranks' listeners (connected or not, and since when, as first seen
here). A selection carries what it knows when the selection is asked (``view``: a ``StreamView``), and the
scope's desk decides from it which of the scope's ranks to score on predicted blocks. Bounded by the registered
ranks: entries of ranks that leave are dropped when their worker does, and "down since" is kept only for
listeners that are not connected now.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.commands import Command
from kvrouter.actors.core.events import Event, KvIndexed, KvStreamReset, RequestAdded, WorkerRemoved
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.kv_modes import EXACT, HEALTHY, RankMode, StreamHealth, StreamView, rank_mode
from kvrouter.actors.core.state import ScopeState


class Listeners(Protocol):
    """The KV listeners, as the health follows them (``KvIngest`` is one)."""

    def connected(self, worker_id: int, dp_rank: int) -> bool | None:
        """Whether the rank's listener is connected now; None when the rank has no listener."""
        ...

    def all_connected(self) -> bool:
        """Whether every listener is connected now."""
        ...

    def listening(self) -> Iterable[tuple[int, int]]:
        """The (worker id, dp rank) of every rank with a listener."""
        ...


class KvHealth:
    def __init__(self, listeners: Listeners, stale_after_secs: float) -> None:
        self._listeners = listeners
        self.stale_after_secs = stale_after_secs
        self._unanswered: dict[ScopeKey, dict[WorkerRank, int]] = {}  # first booking since the rank's last batch
        self._down_since: dict[WorkerRank, int] = {}  # listeners not connected now: first seen so

    def observe(self, state: ScopeState, command: Command, events: tuple[Event, ...]) -> None:
        scope = state.scope
        for event in events:
            if isinstance(event, RequestAdded):
                unanswered = self._unanswered.setdefault(scope, {})
                unanswered.setdefault(WorkerRank(event.worker_id, event.dp_rank), event.at)
            elif isinstance(event, KvIndexed) and event.seq is not None:
                self._answered(scope, WorkerRank(event.worker_id, event.dp_rank))
                self._answered(scope, WorkerRank(event.worker_id, event.stream_rank))
            elif isinstance(event, KvStreamReset):
                self._answered(scope, WorkerRank(event.worker_id, event.dp_rank))
            elif isinstance(event, WorkerRemoved):
                unanswered = self._unanswered.get(scope, {})
                for rank in [r for r in unanswered if r.worker_id == event.worker_id]:
                    self._answered(scope, rank)
                for rank in [r for r in self._down_since if r.worker_id == event.worker_id]:
                    del self._down_since[rank]

    def _answered(self, scope: ScopeKey, rank: WorkerRank) -> None:
        unanswered = self._unanswered.get(scope)
        if unanswered is not None and unanswered.pop(rank, None) is not None and not unanswered:
            del self._unanswered[scope]

    def view(self, scope: ScopeKey, now: int) -> StreamView:
        """What a selection in ``scope`` asked at ``now`` carries: the listeners down (and since when), and the
        scope's connected ranks with a booking their stream has not answered. Every selection asks, so the usual
        case (everything connected, nothing unanswered) costs a pass over the listeners' states and no copy."""
        if self.stale_after_secs <= 0:
            return HEALTHY  # the fallback is off
        listeners = self._listeners
        unanswered = self._unanswered.get(scope)
        healthy = not self._down_since and listeners.all_connected()
        if healthy and not unanswered:
            return HEALTHY
        down = () if healthy else tuple(self._refresh(now).items())
        waiting: tuple[tuple[WorkerRank, int], ...] = ()
        if unanswered:
            connected = listeners.connected
            waiting = tuple((rank, at) for rank, at in unanswered.items() if connected(rank.worker_id, rank.dp_rank))
        return StreamView(down, waiting)

    def modes(self, scope: ScopeKey, record: WorkerRecord, now: int) -> dict[WorkerRank, RankMode]:
        """Each rank's mode now, rank by rank (``GET /workers``): the definition ``view`` carries to selections."""
        down = self._refresh(now)
        unanswered = self._unanswered.get(scope, {})
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
