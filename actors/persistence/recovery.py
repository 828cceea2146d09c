"""Recovery: the latest snapshot, then a fold of the journal's tail. Only ``evolve`` runs here.

A record that cannot be used stops recovery with a ``PoisonRecord`` naming its LSN and what is wrong
(never a traceback): the CLI prints it on one line and exits 2. The operator then runs the build that
wrote it, restores a backup, or cuts the log before it (``journal.repair.truncate_after``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Final

import attrs

from kvrouter.actors.core.events import EVENT_TAGS
from kvrouter.actors.core.evolve import evolve
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.persistence.codec import RecordFormatError, decode_record
from kvrouter.actors.persistence.snapshots import restore_snapshot
from kvrouter.journal.store import CorruptJournal, Journal

log = logging.getLogger("kvrouter.journal")

_REPAIR_HINT: Final = (
    "if a newer kvrouter wrote it, run that one; otherwise restore the data directory from a backup, "
    "or truncate the journal after lsn {before} (this loses record {lsn} and every later one), "
    "or start with --fresh (this loses everything)"
)


class PoisonRecord(CorruptJournal):
    """A record whose checksum is fine but which recovery cannot use."""

    verb = "used"

    def __init__(self, lsn: int, problem: str) -> None:
        self.lsn = lsn
        self.problem = problem
        hint = _REPAIR_HINT.format(before=lsn - 1, lsn=lsn)
        super().__init__(f"journal record at lsn {lsn} cannot be {self.verb}: {problem}. To start: {hint}")


class UndecodableRecord(PoisonRecord):
    """Unknown event tag, missing or mistyped field, a format version newer than this build."""

    verb = "decoded"


class RecordDoesNotApply(PoisonRecord):
    """``evolve`` raised: the event contradicts the state the records before it built."""

    verb = "applied"


@attrs.frozen
class Recovered:
    states: dict[ScopeKey, ScopeState]
    snapshot_lsn: int
    replayed_records: int
    last_lsn: int
    seconds: float


def replay(states: dict[ScopeKey, ScopeState], records: Iterable[tuple[int, bytes]]) -> int:
    """Fold (lsn, payload) records into ``states`` in place; returns how many were folded."""
    count = 0
    for lsn, payload in records:
        try:
            record = decode_record(payload)
        except RecordFormatError as exc:
            raise UndecodableRecord(lsn, str(exc)) from exc
        state = states.get(record.scope)
        if state is None:
            state = states[record.scope] = ScopeState(record.scope)
        for index, event in enumerate(record.events):
            try:
                evolve(state, event)
            except Exception as exc:
                problem = f"event {index} ({EVENT_TAGS[type(event)]}) of {record.scope.describe()} raised {exc!r}"
                raise RecordDoesNotApply(lsn, problem) from exc
        if not state.exists:
            del states[record.scope]
        count += 1
    return count


def recover(journal: Journal) -> Recovered:
    started = time.perf_counter()
    snapshot = journal.latest_snapshot()
    states = restore_snapshot(snapshot.payload) if snapshot else {}
    after = snapshot.lsn if snapshot else 0
    count = replay(states, journal.read(after))
    seconds = time.perf_counter() - started
    log.info(
        "recovered %d scopes: snapshot lsn %d + %d journal records (last lsn %d) in %.3f s",
        len(states),
        after,
        count,
        journal.last_lsn,
        seconds,
    )
    return Recovered(states, after, count, journal.last_lsn, seconds)
