"""Recovery: the latest snapshot, then a fold of the journal's tail. Only ``evolve`` runs here.

A record that cannot be used stops recovery with a ``PoisonRecord`` naming its LSN and what is wrong
(never a traceback): the CLI prints it on one line and exits 2. The operator then runs the build that
wrote it, restores a backup, moves that one record out (``kvrouter journal quarantine``) or cuts the log
before it (``kvrouter journal truncate-after``, ``api/cli/journal.py``).

A damaged record of a worker's KV events (journaled as rebuildable: ``actors/actor.py``) does not stop it: the
journal passes over it (``Journal.skipped_records``), and recovery moves the KV-event watermarks back to where
they stood before it, so the listeners ask the workers to replay what it held. That is said in one WARNING line
and counted (``kvrouter_journal_damaged_records_skipped``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Final

import attrs

from kvrouter.actors.core.events import EVENT_TAGS
from kvrouter.actors.core.evolve import evolve
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.persistence.codec import RecordFormatError, decode_record
from kvrouter.actors.persistence.snapshots import restore_snapshot
from kvrouter.journal.file import FileJournal
from kvrouter.journal.store import CorruptJournal, Journal, SkippedRecord

log = logging.getLogger("kvrouter.journal")

_REPAIR_HINT: Final = (
    "if a newer kvrouter wrote it, run that one; otherwise cut the log before it with "
    "`kvrouter journal truncate-after --data-dir {data_dir} --lsn {before} --yes` (this loses record {lsn} and "
    "every later one; `kvrouter journal inspect --data-dir {data_dir}` lists them), move only this record out of "
    "the log with `kvrouter journal quarantine --data-dir {data_dir} --lsn {lsn} --yes` (it is kept in a file "
    "beside the log), restore the data directory from a backup, or start with --fresh (this loses everything)"
)
SHOWN_SKIPPED = 5  # lsns named in the startup warning


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
    skipped_records: int = 0  # damaged rebuildable records and quarantine placeholders passed over
    rewound_streams: int = 0  # KV-event watermarks moved back for the workers to replay a skipped record


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
    skipped = [record for record in journal.skipped_records if record.lsn > after]
    marks = _WatermarksBefore(skipped[0].lsn if skipped else None, states)
    count = replay(states, marks.watch(journal.read(after)), data_dir)
    rewound = marks.rewind() if skipped else 0
    if skipped:
        _log_skipped(skipped, rewound, data_dir)
    seconds = time.perf_counter() - started
    log.info(
        "recovered %d scopes: snapshot lsn %d + %d journal records (last lsn %d) in %.3f s",
        len(states),
        after,
        count,
        journal.last_lsn,
        seconds,
    )
    return Recovered(states, after, count, journal.last_lsn, seconds, len(skipped), rewound)


class _WatermarksBefore:
    """The KV-event watermarks of every scope as they stood just before the first skipped record, taken while
    the replay passes it, and put back afterwards (``SelectionState.rewind_streams``). Which stream a damaged
    record belonged to cannot be read from it, so every stream replays from there: more than needed, never less."""

    def __init__(self, lsn: int | None, states: dict[ScopeKey, ScopeState]) -> None:
        self.lsn = lsn
        self.states = states
        self.before: dict[ScopeKey, dict[WorkerRank, int]] | None = None

    def watch(self, records: Iterable[tuple[int, bytes]]) -> Iterator[tuple[int, bytes]]:
        for lsn, payload in records:
            if self.before is None and self.lsn is not None and lsn > self.lsn:
                self.before = self._take()
            yield lsn, payload

    def rewind(self) -> int:
        before = self.before if self.before is not None else self._take()
        return sum(state.selection.rewind_streams(before.get(scope, {})) for scope, state in self.states.items())

    def _take(self) -> dict[ScopeKey, dict[WorkerRank, int]]:
        return {scope: dict(state.selection.kv_watermarks) for scope, state in self.states.items()}


def _log_skipped(skipped: list[SkippedRecord], rewound: int, data_dir: Path | None) -> None:
    """One line for the damaged ones (a WARNING), one for quarantine placeholders (INFO)."""
    damaged = [record for record in skipped if not record.quarantined]
    placeholders = [record.lsn for record in skipped if record.quarantined]
    if damaged:
        first = damaged[0]
        named = ", ".join(str(record.lsn) for record in damaged[:SHOWN_SKIPPED])
        more = f" and {len(damaged) - SHOWN_SKIPPED} more" if len(damaged) > SHOWN_SKIPPED else ""
        log.warning(
            "journal: skipped %d damaged record%s of workers' KV events (lsn %s%s; the first in %s at byte offset "
            "%d, checksum mismatch): %d KV-event stream%s resume%s from before it, so the workers replay what it "
            "held. `kvrouter journal quarantine --data-dir %s --lsn %d --yes` moves it out of the log (kept beside it)",
            len(damaged),
            "" if len(damaged) == 1 else "s",
            named,
            more,
            first.segment,
            first.offset,
            rewound,
            "" if rewound == 1 else "s",
            "s" if rewound == 1 else "",
            data_dir or "DIR",
            first.lsn,
        )
    if placeholders:
        log.info(
            "journal: %d quarantined record%s skipped (lsn %s): moved out by `kvrouter journal quarantine`",
            len(placeholders),
            "" if len(placeholders) == 1 else "s",
            ", ".join(map(str, placeholders[:SHOWN_SKIPPED])) + (" ..." if len(placeholders) > SHOWN_SKIPPED else ""),
        )
