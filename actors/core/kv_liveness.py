"""KV-stream liveness: which ranks are out of selection because their KV-event stream stopped while they had traffic.

Pure: the shell stamps every call with the time (``now``, wall-clock nanoseconds) and says which ranks have a KV
listener and whether it is connected; nothing here reads a clock. An engine that serves a request stores blocks and
says so on its stream, so a booking its stream leaves unanswered for ``timeout`` means the engine (or its
publisher) stopped: the rank is taken out of selection (its bookings are freed by a journaled command the shell
sends, ``FreeRankBookings``) and comes back when its stream speaks again. ``docs/workers.md#dead-kv-streams``
describes it for operators.

Per (scope, rank):

- **in** → **out**: the rank has a KV listener (an engine's ZMQ listener, or a publisher on Dynamo's event plane:
  the shell treats both alike), and its earliest booking since its last batch is ``timeout`` old (``check``). A
  rank without a listener (a worker fed over HTTP only, or in approximate mode) is never taken out: nothing is
  expected of it, as in 1.6.1.
- **out** → **in**: a batch (or a stream reset: the publisher restarted) arrived from it (``heard``), or its listener
  connected again after it was seen disconnected while out (``check``: a new connection is a publisher that is
  back; if it still does not answer bookings it is taken out again).
- **out** → gone: its listener is gone (the worker was removed, or lost its KV endpoint): nothing is counted.

Not journaled: after a restart every rank starts in, and one whose stream is still dead is taken out again a
``timeout`` after its next booking. Bounded by the ranks with a listener: ``check`` drops every entry of a rank
that has none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import attrs

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.ids import ScopeKey, WorkerRank

NS_PER_SECOND = 1_000_000_000
NO_RANKS: frozenset[WorkerRank] = frozenset()

KV_EVENTS_STOPPED = "kv_events_stopped"  # the cause of every taking-out (``/workers``, ``/metrics``)
BACK_EVENTS = "kv_events_resumed"  # the causes of a return
BACK_RECONNECTED = "kv_stream_reconnected"


@attrs.frozen
class Outage:
    """One rank out of selection: since when its stream was silent, and since when it is out."""

    silent_since_ns: int  # the earliest booking its stream left unanswered
    out_since_ns: int
    disconnected: bool = False  # its listener was seen not connected since it went out


@attrs.frozen
class Transition:
    """A rank taken out (``out``) or back in; ``cause`` is one of the constants above."""

    scope: ScopeKey
    rank: WorkerRank
    out: bool
    cause: str
    silent_ns: int = 0  # out: how long its stream had been silent after a booking


@attrs.define
class LivenessCounts:
    """Since the process started (``/metrics``)."""

    taken_out: int = 0
    returned: dict[str, int] = attrs.Factory(dict)  # by cause


Connected = Callable[[WorkerRank], bool | None]  # whether the rank's listener is connected; None: it has none


class KvLiveness:
    def __init__(self, timeout_secs: float) -> None:
        self.timeout_ns = round(timeout_secs * NS_PER_SECOND) if timeout_secs > 0 else 0
        self._unanswered: dict[ScopeKey, dict[WorkerRank, int]] = {}  # first booking since the rank's last batch
        self._out: dict[ScopeKey, dict[WorkerRank, Outage]] = {}
        self.counts = LivenessCounts()

    @property
    def enabled(self) -> bool:
        return self.timeout_ns > 0

    # -- what the scope's applied events say -----------------------------------------------------------

    def booked(self, scope: ScopeKey, rank: WorkerRank, at: int) -> None:
        """A request was booked on ``rank`` at ``at``: its stream should answer (the first such booking counts)."""
        self._unanswered.setdefault(scope, {}).setdefault(rank, at)

    def heard(self, scope: ScopeKey, rank: WorkerRank) -> Transition | None:
        """A batch (or a stream reset) came from ``rank``: every booking is answered; an out rank comes back."""
        unanswered = self._unanswered.get(scope)
        if unanswered is not None and unanswered.pop(rank, None) is not None and not unanswered:
            del self._unanswered[scope]
        return self._back(scope, rank, BACK_EVENTS)

    def forget_worker(self, scope: ScopeKey, worker_id: int) -> None:
        """The worker left the scope: nothing of its ranks is kept (it is neither out nor back)."""
        for table in (self._unanswered, self._out):
            ranks = table.get(scope)
            if ranks is None:
                continue
            for rank in [r for r in ranks if r.worker_id == worker_id]:
                del ranks[rank]
            if not ranks:
                del table[scope]

    # -- reads ------------------------------------------------------------------------------------------

    def unanswered(self, scope: ScopeKey) -> Mapping[WorkerRank, int]:
        return self._unanswered.get(scope, {})

    def out(self, scope: ScopeKey) -> Mapping[WorkerRank, Outage]:
        """The scope's ranks out of selection now; empty in the common case."""
        return self._out.get(scope, {})

    def any_out(self) -> bool:
        return bool(self._out)

    def out_count(self) -> int:
        return sum(map(len, self._out.values()))

    # -- the clock ------------------------------------------------------------------------------------

    def check(self, now: int, connected: Connected) -> list[Transition]:
        """Take out the ranks whose stream has left a booking unanswered for the timeout, and bring back the out
        ranks whose listener connected again after a disconnection; in scope then rank order (deterministic)."""
        if not self.enabled:
            return []
        changes: list[Transition] = []
        for scope in sorted(self._out):
            changes.extend(self._follow_outages(scope, connected))
        for scope in sorted(self._unanswered):
            unanswered = self._unanswered[scope]
            for rank in sorted(unanswered):
                since = unanswered[rank]
                if now - since < self.timeout_ns or connected(rank) is None:
                    continue
                del unanswered[rank]  # its bookings are freed with it
                self._out.setdefault(scope, {})[rank] = Outage(since, now)
                self.counts.taken_out += 1
                changes.append(Transition(scope, rank, True, KV_EVENTS_STOPPED, now - since))
            if not unanswered:
                del self._unanswered[scope]
        return changes

    def _follow_outages(self, scope: ScopeKey, connected: Connected) -> list[Transition]:
        changes = []
        outages = self._out[scope]
        for rank in sorted(outages):
            state = connected(rank)
            if state is None:
                del outages[rank]  # no listener any more: nothing to wait for
            elif state is False and not outages[rank].disconnected:
                outages[rank] = attrs.evolve(outages[rank], disconnected=True)
            elif state is True and outages[rank].disconnected:
                back = self._back(scope, rank, BACK_RECONNECTED)
                if back is not None:
                    changes.append(back)
        if not outages:
            self._out.pop(scope, None)
        return changes

    def _back(self, scope: ScopeKey, rank: WorkerRank, cause: str) -> Transition | None:
        outages = self._out.get(scope)
        if outages is None or outages.pop(rank, None) is None:
            return None
        if not outages:
            del self._out[scope]
        self.counts.returned[cause] = self.counts.returned.get(cause, 0) + 1
        return Transition(scope, rank, False, cause)


def excluded_ranks(out: tuple[WorkerRank, ...], schedulable: Iterable[WorkerRecord]) -> frozenset[WorkerRank]:
    """The ranks a selection leaves out: the out ones among the schedulable ranks, unless they are all out. Then
    none is left out (fail open): a fleet is never emptied on a guess, and the ranks are scored on their predicted
    blocks as before (``kv_modes``)."""
    if not out:
        return NO_RANKS
    ranks = {rank for record in schedulable for rank in record.ranks}
    excluded = frozenset(rank for rank in out if rank in ranks)
    return excluded if excluded and len(excluded) < len(ranks) else NO_RANKS
