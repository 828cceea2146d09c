"""Recovery: old journals still recover, and a record it cannot use stops it with a named, one-line error."""

from __future__ import annotations

import logging
from pathlib import Path

import orjson
import pytest
import trio
from golden_samples import (
    GOLDEN,
    HISTORY,
    SNAPSHOT_LSN,
    history_states,
    sample_states_written_by,
    snapshot_path,
)

from kvrouter.actors.core.events import EVENT_TAGS, PrefillCompleted
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.persistence.codec import digest, encode_record
from kvrouter.actors.persistence.recovery import (
    PoisonRecord,
    RecordDoesNotApply,
    UndecodableRecord,
    recover,
)
from kvrouter.actors.persistence.snapshots import SNAPSHOT_VERSION, UnreadableSnapshot, encode_snapshot
from kvrouter.api.cli.main import main as cli_main
from kvrouter.journal.file import FileJournal
from kvrouter.journal.layout import snapshot_name
from kvrouter.journal.memory import MemoryJournal
from kvrouter.journal.repair import RecordInfo, inspect_records, truncate_after
from kvrouter.journal.store import CorruptJournal, Durability, Snapshot


def history_records() -> list[bytes]:
    return [encode_record(scope, (event,)) for scope, events in HISTORY.items() for event in events]


def states_digest(states: dict[ScopeKey, object]) -> str:
    return digest([states[scope].to_snapshot() for scope in sorted(states)])  # type: ignore[attr-defined]


def memory_journal(payloads: list[bytes], snapshot: Snapshot | None = None) -> MemoryJournal:
    journal = MemoryJournal()
    for payload in payloads:
        journal.append(payload)
    if snapshot is not None:
        trio.run(journal.write_snapshot, snapshot)
    return journal


def test_a_journal_of_version_zero_records_recovers_like_a_current_one() -> None:
    """A journal written before format versions existed (records without "v") still recovers."""
    v0_payloads = (GOLDEN / "journals" / "history.v0.jsonl").read_bytes().splitlines()
    assert len(v0_payloads) == sum(map(len, HISTORY.values()))
    assert all("v" not in orjson.loads(payload) for payload in v0_payloads)

    old = recover(memory_journal(v0_payloads))
    new = recover(memory_journal(history_records()))

    expected = {state.scope: state for state in history_states()}
    assert states_digest(new.states) == states_digest(expected)
    # Fields added since (record version 2: worker_role, expected_output_tokens) recover as their defaults,
    # as in the states a version-2 snapshot held.
    before = {state.scope: state for state in sample_states_written_by(2)}
    assert states_digest(old.states) == states_digest(before)


@pytest.mark.parametrize("version", range(1, SNAPSHOT_VERSION + 1))
def test_recovery_starts_from_the_golden_snapshot(version: int) -> None:
    payload = snapshot_path(version).read_bytes()
    journal = memory_journal([b"covered by the snapshot"] * SNAPSHOT_LSN, Snapshot(SNAPSHOT_LSN, payload))
    recovered = recover(journal)
    assert (recovered.snapshot_lsn, recovered.replayed_records) == (SNAPSHOT_LSN, 0)
    expected = sample_states_written_by(version)
    assert states_digest(recovered.states) == states_digest({s.scope: s for s in expected})


@pytest.mark.parametrize(
    ("poison", "problem"),
    [
        (b'{"v":1,"scope":["m","t"],"events":[{"type":"teleported","worker_id":1}]}', "unknown event tag 'teleported'"),
        (b'{"v":9,"scope":["m","t"],"events":[]}', "record format version 9 is newer than this build reads"),
        (b"\xff\xfe not json", "not a journal record"),
    ],
    ids=["unknown-tag", "newer-version", "not-json"],
)
def test_an_undecodable_record_stops_recovery_naming_its_lsn(poison: bytes, problem: str) -> None:
    payloads = history_records()[:3]
    journal = memory_journal([*payloads, poison, *payloads])

    with pytest.raises(UndecodableRecord) as raised:
        recover(journal)

    error = raised.value
    assert isinstance(error, PoisonRecord) and isinstance(error, CorruptJournal)  # the CLI's exit-2 family
    assert error.lsn == 4 and problem in error.problem
    message = str(error)
    assert message.startswith("journal record at lsn 4 cannot be decoded: ") and "\n" not in message
    assert "`kvrouter journal truncate-after --data-dir DIR --lsn 3 --yes`" in message and "backup" in message


def test_an_event_that_does_not_apply_stops_recovery_naming_its_lsn() -> None:
    scope = next(iter(HISTORY))
    records = history_records()[:3]  # two workers and request req-a on the slot tracker scope
    poison = encode_record(scope, (PrefillCompleted("never-added"),))
    journal = memory_journal([*records, poison])

    with pytest.raises(RecordDoesNotApply) as raised:
        recover(journal)

    error = raised.value
    assert error.lsn == 4
    assert error.problem.startswith(f"event 0 ({EVENT_TAGS[PrefillCompleted]}) of {scope.describe()} raised KeyError")
    assert str(error).startswith("journal record at lsn 4 cannot be applied: ")


def test_a_snapshot_that_does_not_restore_stops_recovery_naming_its_lsn() -> None:
    document = orjson.loads(snapshot_path(1).read_bytes())
    document["state_hash"] = "f" * 64
    journal = memory_journal([b"x"] * SNAPSHOT_LSN, Snapshot(SNAPSHOT_LSN, orjson.dumps(document)))
    with pytest.raises(UnreadableSnapshot, match=f"snapshot at lsn {SNAPSHOT_LSN} cannot be restored"):
        recover(journal)


POISON = b'{"v":1,"scope":["m","t"],"events":[{"type":"warp"}]}'


def write_file_journal(path: Path, payloads: list[bytes]) -> None:
    journal = FileJournal.open(path, Durability.ALWAYS)

    async def write() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            for payload in payloads:
                journal.append(payload)
            await journal.aclose()

    trio.run(write)


def test_the_cli_reports_a_poison_record_in_one_line_and_exits_2(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_file_journal(tmp_path, [*history_records()[:2], POISON])
    caplog.set_level(logging.ERROR)

    status = cli_main(["slot-tracker", "--data-dir", str(tmp_path), "--port", "0"])

    assert status == 2
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None
    line = errors[0].getMessage()
    assert line.startswith("cannot start: journal record at lsn 3 cannot be decoded: event 0 has an unknown event tag")
    assert "\n" not in line


def test_an_operator_finds_the_poison_record_and_cuts_the_journal_before_it(tmp_path: Path) -> None:
    records = history_records()
    write_file_journal(tmp_path, [*records[:5], POISON, *records[5:8]])
    with pytest.raises(UndecodableRecord) as raised:
        recover(FileJournal.open(tmp_path, Durability.ALWAYS))

    found = {entry.lsn: entry for entry in inspect_records(tmp_path) if isinstance(entry, RecordInfo)}
    assert found[raised.value.lsn].head == POISON[:32]  # what the operator sees for the named lsn
    truncate_after(tmp_path, raised.value.lsn - 1)

    recovered = recover(FileJournal.open(tmp_path, Durability.ALWAYS))
    assert recovered.last_lsn == 5
    expected = recover(memory_journal(records[:5])).states
    assert states_digest(recovered.states) == states_digest(expected)


def test_a_rotten_newest_snapshot_recovers_the_same_state_from_the_previous_one(tmp_path: Path) -> None:
    records = history_records()
    journal = FileJournal.open(tmp_path, Durability.ALWAYS)

    async def write() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(journal.run)
            for lsn, payload in enumerate(records, 1):
                journal.append(payload)
                if lsn in (6, 15):  # snapshots as the service takes them: the state folded so far
                    await journal.wait_durable(lsn)
                    states = recover(memory_journal(records[:lsn])).states
                    scopes = [states[scope].to_snapshot() for scope in sorted(states)]
                    await journal.write_snapshot(Snapshot(lsn, encode_snapshot(lsn, scopes)))
            await journal.aclose()

    trio.run(write)
    newest = tmp_path / snapshot_name(15)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # bit rot: the frame's checksum no longer matches
    newest.write_bytes(bytes(data))

    recovered = recover(FileJournal.open(tmp_path, Durability.ALWAYS))

    assert (recovered.snapshot_lsn, recovered.replayed_records) == (6, len(records) - 6)
    assert states_digest(recovered.states) == states_digest({s.scope: s for s in history_states()})
