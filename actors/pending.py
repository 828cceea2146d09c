"""The pending-selection cache: what a ``/select`` with a ``selection_id`` would book, kept for a
later ``POST /reservations`` that names only the id (the 1.6.1 replay form).

Per scope, owned by its actor, never journaled (a cache: after a restart a replay answers 404, as
the reference's does after its restart). Bounded by count and age per scope, and in bytes across the
whole service (one ``SelectionCacheBudget`` shared by every scope's cache, ``--selection-cache-max-bytes``,
256 MiB as in the reference). Overflow policy: the scope that stores evicts its own oldest entries
until the service is within budget, the new entry last; an entry bigger than the whole budget is not
kept (its replay answers 404, as an evicted one does).
"""

from __future__ import annotations

import attrs

from kvrouter.actors.core.commands import Reserve

DEFAULT_TTL_SECONDS = 120.0
DEFAULT_MAX_ENTRIES = 4096
DEFAULT_MAX_BYTES = 256 * 1024 * 1024

# Estimated cost of one entry: the objects around it, then each hash as a Python int in a tuple.
ENTRY_OVERHEAD_BYTES = 512
BYTES_PER_HASH = 36


class SelectionCacheBudget:
    """Bytes held by every scope's pending-selection cache together (an estimate, see entry_bytes)."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.used = 0


def entry_bytes(selection_id: str, reservation: Reserve) -> int:
    hashes = len(reservation.sequence_hashes) + len(reservation.local_hashes)
    return ENTRY_OVERHEAD_BYTES + len(selection_id) + len(reservation.session_id or "") + BYTES_PER_HASH * hashes


@attrs.frozen
class PendingSelection:
    reservation: Reserve  # with an empty reservation id: the replay supplies it
    stored_at: int
    size: int


class PendingSelections:
    def __init__(
        self,
        *,
        ttl_seconds: float = DEFAULT_TTL_SECONDS,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        budget: SelectionCacheBudget | None = None,
    ) -> None:
        self._ttl_ns = int(ttl_seconds * 1e9)
        self._max_entries = max_entries
        self._budget = budget if budget is not None else SelectionCacheBudget()
        self._entries: dict[str, PendingSelection] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, selection_id: str, reservation: Reserve, now: int) -> None:
        self.discard(selection_id)  # latest wins, and moves to the young end
        self._store(selection_id, PendingSelection(reservation, now, entry_bytes(selection_id, reservation)))

    def take(self, selection_id: str, now: int) -> Reserve | None:
        entry = self._pop(selection_id)
        if entry is None or now - entry.stored_at > self._ttl_ns:
            return None
        return entry.reservation

    def give_back(self, selection_id: str, reservation: Reserve, stored_at: int) -> None:
        """A failed booking leaves the entry where it was (as the reference does)."""
        if selection_id not in self._entries:
            self._store(selection_id, PendingSelection(reservation, stored_at, entry_bytes(selection_id, reservation)))

    def discard(self, selection_id: str) -> None:
        self._pop(selection_id)

    def _store(self, selection_id: str, entry: PendingSelection) -> None:
        if entry.size > self._budget.max_bytes:
            return
        self._entries[selection_id] = entry
        self._budget.used += entry.size
        while self._entries and (len(self._entries) > self._max_entries or self._budget.used > self._budget.max_bytes):
            self._pop(next(iter(self._entries)))

    def _pop(self, selection_id: str) -> PendingSelection | None:
        entry = self._entries.pop(selection_id, None)
        if entry is not None:
            self._budget.used -= entry.size
        return entry
