"""ScopeDesk: what a scope does around ``decide`` with what is not journaled. Pure.

A scope keeps three things besides its state that no event records: the round-robin position of its
selections, the pending-selection templates (``actors/core/pending.py``) and the waiting room
(``actors/core/waiting_room.py``). The desk holds them, and the rules that use them, on either side of
``decide``:

* before (``prepare``): a selection gets its random draw, its round-robin turn, a generated reservation id
  when it books without one, and the ranks to score on predicted blocks (from the stream view the shell
  stamped on it, and this scope's ranks); a selection in a scope without any schedulable worker, when no
  other scope has one either, is answered as 1.6.1 answers it; a registration gets what the other scopes
  count toward the service's rank limit; a replay of a pending selection becomes the booking its template
  describes (or is answered "not found").
* after (``decided``): an accepted selection leaves its template for a replay (a booking uses it up); a
  refused replay gives it back; a selection every busy rank turned away waits in the room when queueing is on.

What only the owner of every scope knows comes in through two objects it hands over: the scope's seeded random
source (``draws.DrawSource``) and its view of the other scopes (``Surroundings``), both read at the moment a
command is decided, never before: the actor's turn is the only place a command is checked and applied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import attrs

from kvrouter.actors.core.commands import (
    Command,
    RegisterWorker,
    Reserve,
    ReserveSelection,
    SelectDisaggregated,
    SelectWorker,
    UpsertWorker,
)
from kvrouter.actors.core.decisions import Accepted, Decision, Reason, Rejected
from kvrouter.actors.core.draws import DrawSource, drawn, generated_id
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.kv_liveness import excluded_ranks
from kvrouter.actors.core.kv_modes import HEALTHY, NO_RANKS, StreamView, predicted_ranks
from kvrouter.actors.core.pending import PendingSelections, replayed, template
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.routing_modes import MODE_ROUND_ROBIN
from kvrouter.actors.core.selection import NO_SCHEDULABLE_WORKERS_ANYWHERE
from kvrouter.actors.core.selection_rules import no_pending_selection
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.core.waiting_room import Waiter, WaitingRoom, parks

T = TypeVar("T")


class Surroundings(Protocol):
    """What the owner of a scope knows of its other scopes, read when a command of this one is decided."""

    def ranks_elsewhere(self, scope: ScopeKey) -> int:
        """What the other scopes count toward ``limits.MAX_RANKS_PER_SERVICE``."""
        ...

    def schedulable_elsewhere(self, scope: ScopeKey, use_kv_events: bool, queueing: bool) -> bool:
        """Whether another scope has a schedulable worker (under these settings)."""
        ...


class Alone:
    """The surroundings of an owner of one scope: nothing elsewhere."""

    def ranks_elsewhere(self, scope: ScopeKey) -> int:
        return 0

    def schedulable_elsewhere(self, scope: ScopeKey, use_kv_events: bool, queueing: bool) -> bool:
        return False


ALONE = Alone()


def nowhere_schedulable(state: ScopeState, config: RouterConfig, surroundings: Surroundings) -> Rejected | None:
    """1.6.1 answers a selection differently when the whole service has no schedulable worker: checked first,
    in the request's own scope (which usually has one), then in what the owner knows of the others."""
    use_kv_events, queueing = config.use_kv_events, config.queueing
    if state.exists and state.selection.schedulable(use_kv_events, queueing):
        return None
    if surroundings.schedulable_elsewhere(state.scope, use_kv_events, queueing):
        return None
    return Rejected(Reason.UNAVAILABLE, NO_SCHEDULABLE_WORKERS_ANYWHERE)


def streams_predicted(state: ScopeState, config: RouterConfig, view: StreamView, at: int) -> frozenset[WorkerRank]:
    """The scope's schedulable ranks ``view`` says to score on predicted blocks at ``at`` (``kv_modes``)."""
    if view is HEALTHY or not state.exists:
        return NO_RANKS
    workers = state.selection.schedulable(True, config.queueing)
    return predicted_ranks(workers, view, at, config.kv_events_stale_secs)


def streams_out(state: ScopeState, config: RouterConfig, view: StreamView) -> frozenset[WorkerRank]:
    """The scope's ranks a selection leaves out because their KV-event stream stopped (``kv_liveness``); none in
    approximate mode, where no stream is expected."""
    if not view.out or not config.use_kv_events or not state.exists:
        return NO_RANKS
    return excluded_ranks(view.out, state.selection.schedulable(True, config.queueing))


def without_scope(state: ScopeState, command: Command, surroundings: Surroundings) -> Command | Rejected:
    """``command`` as a scope without an actor decides it (from an empty ``state``): only the checks that read
    the surroundings apply; there is nothing to draw, remember or queue."""
    if isinstance(command, SelectWorker | SelectDisaggregated):
        refusal = nowhere_schedulable(state, command.config, surroundings)
        if refusal is not None:
            return refusal
    return command


class ScopeDesk(Generic[T]):
    """One scope's desk; ``T`` is the shell's ticket for a waiting selection (what answers its asker)."""

    __slots__ = ("draws", "pending", "room", "state", "surroundings", "turns")

    def __init__(
        self,
        state: ScopeState,
        draws: DrawSource,
        pending: PendingSelections,
        room: WaitingRoom[T],
        surroundings: Surroundings = ALONE,
    ) -> None:
        self.state = state
        self.draws = draws
        self.pending = pending
        self.room = room
        self.surroundings = surroundings
        # Round-robin selections taken in this scope: the next one's position (not journaled; a restart starts
        # the cycle over, which spreads load just as well).
        self.turns = 0

    # -- before deciding ------------------------------------------------------------------------------

    def prepare(self, command: Command) -> Command | Rejected:
        """``command`` as it is decided, or the answer it gets without being decided."""
        step = _PREPARE.get(command.__class__)
        return command if step is None else step(self, command)

    def _select(self, command: SelectWorker) -> SelectWorker | Rejected:
        config = command.config
        refusal = nowhere_schedulable(self.state, config, self.surroundings)
        if refusal is not None:
            return refusal
        reservation_id = command.reservation_id
        draws = self.draws
        if command.reserve and reservation_id is None:
            reservation_id = command.selection_id or generated_id(draws)
        streams = command.streams
        predicted = streams_predicted(self.state, config, streams, command.at)
        out = streams_out(self.state, config, streams) if streams.out else NO_RANKS
        return drawn(command, draws.random(), reservation_id, self._turn(config), predicted, out)

    def _select_disaggregated(self, command: SelectDisaggregated) -> SelectDisaggregated | Rejected:
        config = command.config
        refusal = nowhere_schedulable(self.state, config, self.surroundings)
        if refusal is not None:
            return refusal
        draws = self.draws
        reservation_id = command.reservation_id if command.reservation_id is not None else generated_id(draws)
        draw, decode_draw = draws.random(), draws.random()
        return attrs.evolve(
            command,
            reservation_id=reservation_id,
            draw=draw,
            decode_draw=decode_draw,
            turn=self._turn(config),
            predicted_ranks=streams_predicted(self.state, config, command.streams, command.at),
            out_ranks=streams_out(self.state, config, command.streams),
        )

    def _register(self, command: RegisterWorker | UpsertWorker) -> RegisterWorker | UpsertWorker:
        return attrs.evolve(command, ranks_elsewhere=self.surroundings.ranks_elsewhere(self.state.scope))

    def _replay(self, command: ReserveSelection) -> Reserve | Rejected:
        kept = self.pending.take(command.selection_id, command.at)
        if kept is None:
            return no_pending_selection(self.state, command.selection_id)
        return replayed(kept, command.selection_id, command.at)

    def _turn(self, config: RouterConfig) -> int:
        """The round-robin position of this selection; only round-robin selections advance it."""
        if config.router_mode != MODE_ROUND_ROBIN:
            return 0
        turn, self.turns = self.turns, self.turns + 1
        return turn

    # -- after deciding -------------------------------------------------------------------------------

    def decided(self, asked: Command, command: Command, decision: Decision, ticket: T | None) -> Decision | None:
        """What ``asked`` (decided as ``command``) is answered; None when it waits in the room instead (only with a
        ``ticket``: its asker is still there to be answered later)."""
        kind = asked.__class__
        if kind is SelectWorker:
            assert isinstance(command, SelectWorker)
            if type(decision) is Accepted:
                self._remember(command, decision)
            elif ticket is not None and parks(decision, command):
                refusal = self.room.park(ticket, command)
                if refusal is None:
                    return None  # answered when a rank frees up (or the asker's deadline passes)
                return Rejected(Reason.OVERLOADED, refusal)
        elif kind is ReserveSelection:
            if type(decision) is not Accepted:
                self.unapplied(asked, command)  # a failed booking leaves the entry where it was
        elif kind is Reserve:
            assert isinstance(asked, Reserve)
            self.pending.discard(asked.reservation_id)
        return decision

    def unapplied(self, asked: Command, command: Command) -> None:
        """``command`` was not applied (refused, or the journal failed): a replayed template goes back."""
        if isinstance(asked, ReserveSelection) and isinstance(command, Reserve):
            kept = attrs.evolve(command, reservation_id="", at=0)  # what ``replayed`` filled in, taken out again
            self.pending.give_back(asked.selection_id, kept, asked.at)

    def _remember(self, command: SelectWorker, decision: Accepted) -> None:
        selection_id = command.selection_id
        if not selection_id:
            return
        if command.reserve:
            self.pending.discard(selection_id)  # booked: a replay of the same id would book it twice
        else:
            self.pending.put(selection_id, template(command, decision.reply), command.at)

    # -- the waiting room -----------------------------------------------------------------------------

    def waiting(self) -> list[Waiter[T]]:
        """The waiting selections to ask again, in policy order (the room drops those whose askers left)."""
        return self.room.in_order()

    def readmitted(self, waiter: Waiter[T], last_at: int) -> SelectWorker:
        """A waiter's selection asked again, at the latest time the scope has seen (the core reads no clock)."""
        command = waiter.command
        return attrs.evolve(command, at=max(command.at, last_at))

    def admitted(self, waiter: Waiter[T], command: SelectWorker, decision: Decision) -> Decision | None:
        """What the waiter is answered now; None when every rank is still busy (it and those after it wait)."""
        if parks(decision, command):
            return None
        self.room.remove(waiter)
        if type(decision) is Accepted:
            self._remember(command, decision)
        return decision

    def dropped(self, waiter: Waiter[T]) -> None:
        """The waiter leaves without an answer from the core (the journal failed)."""
        self.room.remove(waiter)


_PREPARE: dict[type, Callable[[Any, Any], Any]] = {
    SelectWorker: ScopeDesk._select,
    SelectDisaggregated: ScopeDesk._select_disaggregated,
    RegisterWorker: ScopeDesk._register,
    UpsertWorker: ScopeDesk._register,
    ReserveSelection: ScopeDesk._replay,
}
# The commands ``prepare`` changes, and those ``decided`` looks at: any other goes past the desk as it is, so a
# caller on a hot path (the actor's batches of lifecycle commands) may skip the calls for them.
PREPARED = frozenset(_PREPARE)
CONCLUDED = frozenset({SelectWorker, ReserveSelection, Reserve})
