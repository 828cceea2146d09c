"""BookedScopes: which scope holds a reservation booked through this replica, so its next commands go to that
scope's owner alone.

A reservation's commands (``/reservations/{id}/prefill_complete``, ``/output_block``, ``DELETE``) name no scope.
Without more knowledge a replica that does not serve the reservation asks every other member which holds it (two
requests on a three-replica cluster, one of them wasted, and one more on each member that answers 404). A
booking forwarded through this replica to its scope's owner (a selection that books, ``POST /reservations``)
shows the id and the scope together: noted here, the reservation's later commands through this replica go to the
scope's owner (in its shared batches), and only a 404 there (the owner changed and lost nothing: it was released
meanwhile, or never known) falls back to asking everyone.

Bounded in bytes (ids are the client's strings, of any length): at most ``max_bytes``, counting each id's length
and ``ENTRY_OVERHEAD`` for its entry and string objects; each scope is held once, however many reservations it
has (its names are counted once too). Overflow policy ``forget-oldest``: the reservations noted longest ago are
forgotten first (their commands then ask every member, as before). A release answered through this replica
forgets its id.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any, Final

from kvrouter.actors.core.ids import ScopeKey

MAX_BYTES: Final = 8 * 1024 * 1024
ENTRY_OVERHEAD: Final = 200  # bytes counted per id beside its length: the map's entry, the str object's header
OVERFLOW_POLICY: Final = "forget-oldest"


class BookedScopes:
    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._scopes: collections.OrderedDict[str, ScopeKey] = collections.OrderedDict()
        self._held: dict[ScopeKey, list[Any]] = {}  # each scope once: [the one copy kept, its reservations here]
        self.bytes = 0
        self.forgotten = 0  # ids forgotten by the overflow policy

    def __len__(self) -> int:
        return len(self._scopes)

    def note(self, reservation_id: str, scope: ScopeKey) -> None:
        size = len(reservation_id) + ENTRY_OVERHEAD
        if size + _scope_size(scope) > self.max_bytes:
            return
        if reservation_id in self._scopes:
            self.forget(reservation_id)
        held = self._held.get(scope)
        if held is None:
            held = self._held[scope] = [scope, 0]
            self.bytes += _scope_size(scope)
        held[1] += 1
        self._scopes[reservation_id] = held[0]
        self.bytes += size
        while self.bytes > self.max_bytes:
            oldest = next(iter(self._scopes))
            self.forget(oldest)
            self.forgotten += 1

    def note_answer(self, answer: Any, scope: ScopeKey) -> None:
        """Every reservation id a booking's JSON answer names (a selection that books, a reservation; the parts
        of a disaggregated selection): held in ``scope``."""
        for reservation_id in _reservation_ids(answer):
            self.note(reservation_id, scope)

    def scope_of(self, reservation_id: str) -> ScopeKey | None:
        return self._scopes.get(reservation_id)

    def forget(self, reservation_id: str) -> None:
        scope = self._scopes.pop(reservation_id, None)
        if scope is None:
            return
        self.bytes -= len(reservation_id) + ENTRY_OVERHEAD
        held = self._held[scope]
        held[1] -= 1
        if held[1] == 0:
            del self._held[scope]
            self.bytes -= _scope_size(scope)


def _scope_size(scope: ScopeKey) -> int:
    return len(scope.model_name) + len(scope.tenant_id) + ENTRY_OVERHEAD


def _reservation_ids(answer: Any, depth: int = 0) -> Iterator[str]:
    """The ``reservation_id`` strings of a booking's answer, at its top level and in the objects it holds (a
    disaggregated selection's parts), two levels deep at most."""
    if type(answer) is dict:
        value = answer.get("reservation_id")
        if type(value) is str:
            yield value
        if depth < 2:
            for inner in answer.values():
                if type(inner) in (dict, list):
                    yield from _reservation_ids(inner, depth + 1)
    elif type(answer) is list and depth < 2:
        for inner in answer:
            yield from _reservation_ids(inner, depth + 1)
