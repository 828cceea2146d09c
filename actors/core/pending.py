"""The pending-selection cache: what a ``/select`` with a ``selection_id`` would book, kept for a
later ``POST /reservations`` that names only the id (the 1.6.1 replay form). Pure.

Per scope, owned by its actor, never journaled (a cache: after a restart a replay answers 404, as
the reference's does after its restart). Bounded by count and age per scope, and in bytes across the
whole service (one ``SelectionCacheBudget`` shared by every scope's cache, ``--selection-cache-max-bytes``,
256 MiB as in the reference). Overflow policy: the scope that stores evicts its own oldest entries
until the service is within budget, the new entry last; an entry bigger than the whole budget is not
kept (its replay answers 404, as an evicted one does).

What is kept is a template: the ``Reserve`` that books exactly what the selection chose (``template``), with
an empty reservation id; the replay fills in the id and its time (``replayed``). Booked right away, it books
what ``/select_and_reserve`` would have booked with the same draw.
"""

from __future__ import annotations

import attrs

from kvrouter.actors.core.commands import Reserve, SelectWorker
from kvrouter.actors.core.selection_rules import Selection, tracked_output

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


def template(command: SelectWorker, chosen: Selection) -> Reserve:
    """The booking a later replay of this selection makes: the chosen rank, the prompt's hashes and loads as
    the selection weighed them, its session and prediction settings. The reservation id is the replay's."""
    return Reserve(
        "",
        chosen.worker_id,
        chosen.dp_rank,
        chosen.sequence_hashes,
        chosen.isl_tokens,
        effective_prefill_tokens=chosen.effective_prefill_tokens if chosen.track_prefill_tokens else None,
        track_prefill_tokens=chosen.track_prefill_tokens,
        local_hashes=chosen.local_hashes,
        approx_ttl_ns=chosen.approx_ttl_ns,
        expected_output_tokens=tracked_output(command.config, command.options.expected_output_tokens),
        track_active_blocks=chosen.track_active_blocks,
        session_id=chosen.session_id,
        session_ttl_ns=chosen.session_ttl_ns,
        writer_id=chosen.writer_id,
        max_predicted_blocks=chosen.max_predicted_blocks,
        predicted_prune_target=chosen.predicted_prune_target,
    )


def replayed(kept: Reserve, selection_id: str, at: int) -> Reserve:
    """The template booked under the replay's id (the selection id) at the replay's time."""
    return attrs.evolve(kept, reservation_id=selection_id, at=at)
