"""The pending-selection cache: what a ``/select`` with a ``selection_id`` would book, kept for a
later ``POST /reservations`` that names only the id (the 1.6.1 replay form).

Per scope, owned by its actor, never journaled (a cache: after a restart a replay answers 404, as
the reference's does after its restart). Bounded by count and age; overflow policy: evict the
oldest entry.
"""

from __future__ import annotations

import attrs

from kvrouter.actors.core.commands import Reserve

DEFAULT_TTL_SECONDS = 120.0
DEFAULT_MAX_ENTRIES = 4096


@attrs.frozen
class PendingSelection:
    reservation: Reserve  # with an empty reservation id: the replay supplies it
    stored_at: int


class PendingSelections:
    def __init__(self, *, ttl_seconds: float = DEFAULT_TTL_SECONDS, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self._ttl_ns = int(ttl_seconds * 1e9)
        self._max_entries = max_entries
        self._entries: dict[str, PendingSelection] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, selection_id: str, reservation: Reserve, now: int) -> None:
        self._entries.pop(selection_id, None)  # latest wins, and moves to the young end
        self._entries[selection_id] = PendingSelection(reservation, now)
        while len(self._entries) > self._max_entries:
            del self._entries[next(iter(self._entries))]

    def take(self, selection_id: str, now: int) -> Reserve | None:
        entry = self._entries.pop(selection_id, None)
        if entry is None or now - entry.stored_at > self._ttl_ns:
            return None
        return entry.reservation

    def give_back(self, selection_id: str, reservation: Reserve, stored_at: int) -> None:
        """A failed booking leaves the entry where it was (as the reference does)."""
        self._entries.setdefault(selection_id, PendingSelection(reservation, stored_at))

    def discard(self, selection_id: str) -> None:
        self._entries.pop(selection_id, None)
