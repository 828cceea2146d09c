"""Directory: which scope holds a worker id or a reservation id, service-wide (the selection service).

Worker ids and reservation ids are service-wide, but their records live in per-scope actors. The
directory is the one place that answers "where is it" in O(1): it is kept from the events the actors
apply (it is an observer), so it agrees with applied state at every await, and rebuilt from the
recovered states at startup (recovery folds events without observers).

It also holds in-flight *claims* on reservation ids: a booking claims its id before it enters a scope's
mailbox and gives the claim back when the actor has decided (``ActorSystem.ask(on_settled=...)``); by
then the applied index holds the id if it was booked. Trio runs one task at a time, so check-and-claim
is atomic: two bookings of one id in two scopes cannot both pass, whatever the interleaving. Bookings
of one id in the *same* scope are left to that scope's actor, which decides them in mailbox order (and
answers as 1.6.1 does: 409 for a second booking, 404 for a second replay of a consumed selection).

A duplicate can still reach the applied state from outside the booking path (a replica peer's
admission, or a journal written before ids were service-wide). Such ids are kept as *shadows* behind
the first holder, so lookups stay deterministic and freeing one copy does not lose the other.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

from kvrouter.actors.core.commands import Command
from kvrouter.actors.core.decisions import Rejected
from kvrouter.actors.core.events import (
    Event,
    RequestAdded,
    RequestFreed,
    RequestsExpired,
    WorkerRemoved,
    WorkerUpserted,
)
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.selection_rules import already_reserved
from kvrouter.actors.core.state import ScopeState

Key = TypeVar("Key", bound=Hashable)


class ScopedIds(Generic[Key]):
    """id -> the scope holding it (the first, if a duplicate slipped in), plus per-scope counts."""

    __slots__ = ("_counts", "_first", "_shadows")

    def __init__(self) -> None:
        self._first: dict[Key, ScopeKey] = {}
        self._shadows: dict[Key, list[ScopeKey]] = {}  # rare: further scopes holding the same id
        self._counts: dict[ScopeKey, int] = {}

    def __len__(self) -> int:
        return len(self._first)

    def __contains__(self, key: Key) -> bool:
        return key in self._first

    def get(self, key: Key) -> ScopeKey | None:
        return self._first.get(key)

    def scopes(self, key: Key) -> tuple[ScopeKey, ...]:
        first = self._first.get(key)
        if first is None:
            return ()
        return (first, *self._shadows.get(key, ()))

    def count(self, scope: ScopeKey) -> int:
        return self._counts.get(scope, 0)

    def add(self, key: Key, scope: ScopeKey) -> None:
        first = self._first.get(key)
        if first is None:
            self._first[key] = scope
        elif first == scope:
            return  # already held there (a repeated upsert)
        else:
            shadows = self._shadows.setdefault(key, [])
            if scope in shadows:
                return
            shadows.append(scope)
        self._counts[scope] = self._counts.get(scope, 0) + 1

    def discard(self, key: Key, scope: ScopeKey) -> None:
        first = self._first.get(key)
        if first is None:
            return
        shadows = self._shadows.get(key)
        if first == scope:
            if shadows:
                self._first[key] = shadows.pop(0)
            else:
                del self._first[key]
        elif shadows and scope in shadows:
            shadows.remove(scope)
        else:
            return
        if shadows is not None and not shadows:
            del self._shadows[key]
        left = self._counts[scope] - 1
        if left:
            self._counts[scope] = left
        else:
            del self._counts[scope]

    def held_by(self, scope: ScopeKey) -> list[Key]:
        """Every id ``scope`` holds (a scan: only for rare events, and only when the count says so)."""
        if not self.count(scope):
            return []
        return [key for key in self._first if scope in self.scopes(key)]


class Directory:
    def __init__(self) -> None:
        self.workers: ScopedIds[int] = ScopedIds()
        self.reservations: ScopedIds[str] = ScopedIds()
        self._claims: dict[str, tuple[ScopeKey, int]] = {}  # ids being booked right now: (scope, bookings)

    @classmethod
    def of(cls, states: Iterable[ScopeState]) -> Directory:
        """The directory of recovered (or any applied) states, scopes in sorted order."""
        directory = cls()
        for state in sorted(states, key=lambda s: s.scope):
            directory.adopt(state)
        return directory

    def adopt(self, state: ScopeState) -> None:
        for worker_id in state.selection.catalog:
            self.workers.add(worker_id, state.scope)
        for request_id in state.slots.requests:
            self.reservations.add(request_id, state.scope)

    # -- lookups ------------------------------------------------------------------------------------

    def worker_scope(self, worker_id: int) -> ScopeKey | None:
        return self.workers.get(worker_id)

    def worker_scopes(self, worker_id: int) -> tuple[ScopeKey, ...]:
        """Normally none or one; more only if a duplicate came from an old journal (a write heals it)."""
        return self.workers.scopes(worker_id)

    def reservation_scope(self, reservation_id: str) -> ScopeKey | None:
        return self.reservations.get(reservation_id)

    # -- claims -------------------------------------------------------------------------------------

    def claim_reservation(self, reservation_id: str, scope: ScopeKey) -> Rejected | None:
        """Claim ``reservation_id`` for a booking in ``scope``: a rejection (409) if another scope holds
        or is booking it. Within one scope the actor judges duplicates itself, in mailbox order, so
        claims there only count up. Give every successful claim back with ``release_claim`` once the
        booking is decided."""
        for holder in self.reservations.scopes(reservation_id):
            if holder != scope:
                return already_reserved(reservation_id)
        claim = self._claims.get(reservation_id)
        if claim is None:
            self._claims[reservation_id] = (scope, 1)
        elif claim[0] == scope:
            self._claims[reservation_id] = (scope, claim[1] + 1)
        else:
            return already_reserved(reservation_id)
        return None

    def release_claim(self, reservation_id: str) -> None:
        claim = self._claims.pop(reservation_id, None)
        if claim is not None and claim[1] > 1:
            self._claims[reservation_id] = (claim[0], claim[1] - 1)

    @property
    def claims(self) -> int:
        """Reservation ids being booked right now."""
        return len(self._claims)

    # -- the observer -------------------------------------------------------------------------------

    def observe(self, state: ScopeState, command: Command, events: tuple[Event, ...]) -> None:
        """Called by the actor right after it applied ``events`` in ``state`` (synchronously)."""
        scope = state.scope
        for event in events:
            kind = type(event)
            if kind is RequestAdded:
                self.reservations.add(event.request_id, scope)  # type: ignore[union-attr]
            elif kind is RequestFreed:
                self.reservations.discard(event.request_id, scope)  # type: ignore[union-attr]
            elif kind is RequestsExpired:
                for request_id in event.request_ids:  # type: ignore[union-attr]
                    self.reservations.discard(request_id, scope)
            elif kind is WorkerUpserted:
                self.workers.add(event.record.worker_id, scope)  # type: ignore[union-attr]
                self._drop_vanished_reservations(state)  # a shrunk DP range drops its ranks' bookings
            elif kind is WorkerRemoved:
                self.workers.discard(event.worker_id, scope)  # type: ignore[union-attr]
                self._drop_vanished_reservations(state)

    def _drop_vanished_reservations(self, state: ScopeState) -> None:
        """Bookings on ranks a catalog change dropped leave no event of their own: compare with the state."""
        requests = state.slots.requests
        if self.reservations.count(state.scope) > len(requests):
            for reservation_id in self.reservations.held_by(state.scope):
                if reservation_id not in requests:
                    self.reservations.discard(reservation_id, state.scope)
