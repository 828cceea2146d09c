"""Recovery: the latest snapshot, then a fold of the journal's tail. Only ``evolve`` runs here.

A record that cannot be used stops recovery with a ``PoisonRecord`` naming its LSN and what is wrong
(never a traceback): the CLI prints it on one line and exits 2. The operator then runs the build that
wrote it, restores a backup, or cuts the log before it (``kvrouter journal truncate-after``, ``api/journal_cli.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Final

import attrs

from kvrouter.actors.core.events import EVENT_TAGS
from kvrouter.actors.core.evolve import evolve
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.persistence.codec import RecordFormatError, decode_record
from kvrouter.actors.persistence.snapshots import restore_snapshot
from kvrouter.journal.file import FileJournal
from kvrouter.journal.store import CorruptJournal, Journal

log = logging.getLogger("kvrouter.journal")

_REPAIR_HINT: Final = (
    "if a newer kvrouter wrote it, run that one; otherwise cut the log before it with "
    "`kvrouter journal truncate-after --data-dir {data_dir} --lsn {before} --yes` (this loses record {lsn} and "
    "every later one; `kvrouter journal inspect --data-dir {data_dir}` lists them), restore the data directory "
    "from a backup, or start with --fresh (this loses everything)"
)


class PoisonRecord(CorruptJournal):
    """A record whose checksum is fine but which recovery cannot use."""

    verb = "used"

    def __init__(self, lsn: int, problem: str, data_dir: Path | None = None) -> None:
        self.lsn = lsn
        self.problem = problem
        hint = _REPAIR_HINT.format(before=lsn - 1, lsn=lsn, data_dir=data_dir or "DIR")
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


def replay(
    states: dict[ScopeKey, ScopeState], records: Iterable[tuple[int, bytes]], data_dir: Path | None = None
) -> int:
    """Fold (lsn, payload) records into ``states`` in place; returns how many were folded.

    ``data_dir`` is named in the repair command of a PoisonRecord's message.
    """
    count = 0
    for lsn, payload in records:
        try:
            record = decode_record(payload)
        except RecordFormatError as exc:
            raise UndecodableRecord(lsn, str(exc), data_dir) from exc
        state = states.get(record.scope)
        if state is None:
            state = states[record.scope] = ScopeState(record.scope)
        for index, event in enumerate(record.events):
            try:
                evolve(state, event)
            except Exception as exc:
                problem = f"event {index} ({EVENT_TAGS[type(event)]}) of {record.scope.describe()} raised {exc!r}"
                raise RecordDoesNotApply(lsn, problem, data_dir) from exc
        if not state.exists:
            del states[record.scope]
        count += 1
    return count


def recover(journal: Journal) -> Recovered:
    started = time.perf_counter()
    snapshot = journal.latest_snapshot()
    states = restore_snapshot(snapshot.payload) if snapshot else {}
    after = snapshot.lsn if snapshot else 0
    data_dir = journal.path if isinstance(journal, FileJournal) else None
    count = replay(states, journal.read(after), data_dir)
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
