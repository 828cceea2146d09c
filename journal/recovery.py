"""Recovery: latest snapshot + fold of the journal tail. Only ``evolve`` runs here.

A snapshot stores ``state_hash``; restoring it must reproduce that hash, which catches any drift
between ``to_snapshot`` and ``from_snapshot`` before the service serves a single request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import attrs
import orjson

from kvrouter.actors.core.evolve import fold
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.state import ScopeState
from kvrouter.journal.codec import decode_record, digest
from kvrouter.journal.store import CorruptJournal, Journal

log = logging.getLogger("kvrouter.journal")


@attrs.frozen
class Recovered:
    states: dict[ScopeKey, ScopeState]
    snapshot_lsn: int
    replayed_records: int
    last_lsn: int
    seconds: float


def restore_snapshot(payload: bytes) -> dict[ScopeKey, ScopeState]:
    document = orjson.loads(payload)
    states = {}
    for data in document["scopes"]:
        state = ScopeState.from_snapshot(data)
        states[state.scope] = state
    restored = digest([s.to_snapshot() for s in sorted(states.values(), key=lambda s: s.scope)])
    if restored != document["state_hash"]:
        raise CorruptJournal(
            f"snapshot at lsn {document['lsn']} does not restore to its recorded state hash; "
            "start with --fresh to discard the data directory, or restore it from a backup"
        )
    return states


def replay(states: dict[ScopeKey, ScopeState], records: Iterable[tuple[int, bytes]]) -> int:
    """Fold (lsn, payload) records into ``states`` in place; returns how many were folded."""
    count = 0
    for _lsn, payload in records:
        record = decode_record(payload)
        state = states.get(record.scope)
        if state is None:
            state = states[record.scope] = ScopeState(record.scope)
        fold(state, record.events)
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
