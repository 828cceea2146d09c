"""How many blocks each scope's KV-event index evicted (trimmed) or refused at its cap, since this process started.

An observer of live decisions (recovery folds without observers), so these are process counters: they start at
zero at each start, as a metrics exporter's counters do. Per scope for metrics, per rank for ``/workers``.
Bounded: a rank's entry goes with its worker; scopes are capped (``limits.MAX_SCOPES``).
"""

from __future__ import annotations

from kvrouter.actors.core.commands import Command
from kvrouter.actors.core.events import Event, KvBlocksRefused, KvIndexTrimmed, WorkerRemoved
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.state import ScopeState


class IndexCounters:
    __slots__ = ("by_rank", "by_scope")

    def __init__(self) -> None:
        # (evicted, refused) blocks
        self.by_scope: dict[ScopeKey, tuple[int, int]] = {}
        self.by_rank: dict[tuple[ScopeKey, WorkerRank], tuple[int, int]] = {}

    def observe(self, state: ScopeState, command: Command, events: tuple[Event, ...]) -> None:
        for event in events:
            if isinstance(event, KvIndexTrimmed):
                self._add(state.scope, WorkerRank(event.worker_id, event.dp_rank), event.blocks, 0)
            elif isinstance(event, KvBlocksRefused):
                self._add(state.scope, WorkerRank(event.worker_id, event.dp_rank), 0, event.blocks)
            elif isinstance(event, WorkerRemoved) and self.by_rank:
                gone = [key for key in self.by_rank if key[0] == state.scope and key[1].worker_id == event.worker_id]
                for key in gone:
                    del self.by_rank[key]

    def worker(self, scope: ScopeKey, ranks: tuple[WorkerRank, ...]) -> tuple[int, int]:
        """(evicted, refused) blocks of these ranks of one worker."""
        evicted = refused = 0
        for rank in ranks:
            e, r = self.by_rank.get((scope, rank), (0, 0))
            evicted += e
            refused += r
        return evicted, refused

    def _add(self, scope: ScopeKey, rank: WorkerRank, evicted: int, refused: int) -> None:
        e, r = self.by_scope.get(scope, (0, 0))
        self.by_scope[scope] = (e + evicted, r + refused)
        e, r = self.by_rank.get((scope, rank), (0, 0))
        self.by_rank[(scope, rank)] = (e + evicted, r + refused)
