"""``kvrouter journal`` in-process: what inspect reports, and the cuts truncate-after refuses (nothing changed)."""

from __future__ import annotations

import io
from functools import partial
from pathlib import Path

import trio

from kvrouter.actors.core.events import KvIndexed, KvStoredOp, PrefillCompleted, RequestAdded, WorkerRegistered
from kvrouter.actors.core.evolve import fold
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.persistence.codec import encode_record
from kvrouter.actors.persistence.journal_check import Stop, check_recovery
from kvrouter.actors.persistence.snapshots import encode_snapshot
from kvrouter.api.cli import journal as journal_cli
from kvrouter.api.process.main import lock_data_dir
from kvrouter.journal.file import FileJournal
from kvrouter.journal.store import Durability, Snapshot
from tests.support.journal_files import append_records

SCOPE = ScopeKey("m", "default")
GOOD = encode_record(SCOPE, (WorkerRegistered(1, 4, 0, 1),))
POISON = encode_record(SCOPE, (PrefillCompleted("never-added"),))


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = journal_cli.main(list(argv), out, err)
    return status, out.getvalue(), err.getvalue()


def contents(path: Path) -> dict[str, bytes]:
    """Every journal file (the LOCK file the tool takes, as the service does, is not journal content)."""
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.name != "LOCK"}


def add_zeros(path: Path, count: int) -> Path:
    (segment,) = path.glob("journal-*.log")
    segment.write_bytes(segment.read_bytes() + b"\x00" * count)
    return segment


async def test_inspect_reports_a_torn_tail_recovery_will_cut(tmp_path: Path) -> None:
    await append_records(tmp_path, [GOOD])
    segment = add_zeros(tmp_path, 7)
    before = contents(tmp_path)

    status, out, _ = run("inspect", "--data-dir", str(tmp_path))

    assert status == 0 and contents(tmp_path) == before
    assert "lsn 1  " in out and "model=m tenant_id=default: worker_registered" in out
    assert "DAMAGED" in out and "7 bytes to the end of the file" in out
    assert out.splitlines()[-1] == (
        "recovery: ok, from the first record plus 1 records to lsn 1 (1 scopes); it cuts 7 bytes at the end of "
        f"{segment.name} from byte offset {segment.stat().st_size - 7} (7 zero bytes: preallocated space or a torn "
        "append left by a crash) and logs a warning"
    )


async def test_the_recovery_check_stops_at_the_first_poison_record_within_reach(tmp_path: Path) -> None:
    await append_records(tmp_path, [GOOD, POISON, GOOD])
    stopped = check_recovery(tmp_path)
    assert stopped.stop is not None and (stopped.stop.kind, stopped.stop.lsn) == ("record", 2)
    assert stopped.last_lsn == 1
    assert check_recovery(tmp_path, upto=1).stop is None  # what a cut after lsn 1 leaves recovers
    assert check_recovery(tmp_path, upto=1).last_lsn == 1


async def test_refused_cuts_change_nothing(tmp_path: Path) -> None:
    await append_records(tmp_path, [GOOD, POISON, GOOD])
    before = contents(tmp_path)

    status, _, err = run("truncate-after", "--data-dir", str(tmp_path), "--lsn", "2", "--yes")
    assert status == 2 and "record 2 cannot be used" in err and len(err.splitlines()) == 1
    status, _, err = run("truncate-after", "--data-dir", str(tmp_path), "--lsn", "5", "--yes")
    assert status == 2 and "record 2 cannot be used" in err
    status, _, err = run("truncate-after", "--data-dir", str(tmp_path), "--lsn", "-1", "--yes")
    assert status == 2 and "--lsn='-1' must be between 0 and" in err
    with lock_data_dir(tmp_path):  # as a running service holds it
        status, _, err = run("truncate-after", "--data-dir", str(tmp_path), "--lsn", "1", "--yes")
    assert status == 2 and "is in use by a running kvrouter; stop it first" in err
    assert contents(tmp_path) == before


def test_a_missing_directory_is_one_line(tmp_path: Path) -> None:
    status, out, err = run("inspect", "--data-dir", str(tmp_path / "nope"))
    assert (status, out) == (2, "")
    assert err == (
        f"kvrouter journal inspect: --data-dir {tmp_path / 'nope'} is not a directory; "
        "pass the data directory of a stopped service\n"
    )


def test_stop_kinds_name_their_repair(tmp_path: Path) -> None:
    line = journal_cli._stop_line(Stop("gap", 5, "records 5..6 are missing"), tmp_path)
    repair = f"kvrouter journal truncate-after --data-dir {tmp_path} --lsn 4 --yes"
    assert line == f"records 5..6 are missing; cut before it: {repair}"


async def test_recovery_from_a_snapshot_replays_only_the_records_after_it(tmp_path: Path) -> None:
    journal = await trio.to_thread.run_sync(partial(FileJournal.open, tmp_path, Durability.ALWAYS))
    async with trio.open_nursery() as nursery:
        await nursery.start(journal.run)
        journal.append(GOOD)
        state = fold(ScopeState(SCOPE), [WorkerRegistered(1, 4, 0, 1)])
        await journal.write_snapshot(Snapshot(1, encode_snapshot(1, [state.to_snapshot()])))
        journal.append(encode_record(SCOPE, (WorkerRegistered(2, 4, 0, 1),)))
        journal.append(POISON)
        await journal.aclose()

    check = check_recovery(tmp_path)
    assert (check.snapshot_lsn, check.replayed, check.last_lsn, check.scopes) == (1, 1, 2, 1)
    assert check.stop == Stop("record", 3, check.stop.problem if check.stop else "", movable=True)
    status, out, _ = run("inspect", "--data-dir", str(tmp_path))
    assert status == 1 and "snapshot lsn 1  " in out and out.count("  ok\n") == 1

    status, out, _ = run("truncate-after", "--data-dir", str(tmp_path), "--lsn", "2", "--yes")
    assert status == 0 and out.splitlines()[-1] == (
        "recovery: ok, from snapshot lsn 1 plus 1 records to lsn 2 (1 scopes)"
    )


# -- a damaged record with intact records after it: the cut counts and names what it drops; quarantine -------

BOOKINGS = [encode_record(SCOPE, (RequestAdded(f"req-{n}", 1, 0, (n,), 4, 1_000 + n),)) for n in range(3)]  # lsns 3..5
KV = encode_record(SCOPE, (KvIndexed(1, 0, 0, 7, (KvStoredOp(0, None, ((11, 12),)),)),))  # lsn 2, as older builds wrote


async def damaged_history(path: Path) -> None:
    """A registration, a KV record an older build wrote (not marked rebuildable) whose payload then took a bit
    flip, and three bookings after it."""
    await append_records(path, [GOOD, KV, *BOOKINGS])
    flip_bit(path / "journal-00000000000000000001.log", 16 + len(GOOD) + 16 + 40)


def flip_bit(segment: Path, offset: int) -> None:
    data = bytearray(segment.read_bytes())
    data[offset] ^= 0x04
    segment.write_bytes(bytes(data))


async def test_the_dry_run_counts_what_the_cut_removes_and_names_the_client_writes(tmp_path: Path) -> None:
    await damaged_history(tmp_path)
    before = contents(tmp_path)

    status, out, _ = run("truncate-after", "--data-dir", str(tmp_path), "--lsn", "1")

    assert status == 0 and contents(tmp_path) == before
    lines = out.splitlines()
    assert lines[0].startswith("would keep records up to lsn 1, remove 3 records and 1 damaged, ")  # before: 0
    assert lines[1] == "among them, acknowledged client writes: 3 bookings (req-0, req-1, req-2)"
    assert lines[2] == (
        "record 2 is damaged and the records after it are intact: to lose only that one, run "
        f"`kvrouter journal quarantine --data-dir {tmp_path} --lsn 2 --yes` instead"
    )
    status, out, _ = run("truncate-after", "--data-dir", str(tmp_path), "--lsn", "1", "--yes")
    assert status == 0 and "among them, acknowledged client writes: 3 bookings (req-0, req-1, req-2)" in out
    assert check_recovery(tmp_path).last_lsn == 1


async def test_quarantine_moves_the_damaged_record_out_and_keeps_the_bookings(tmp_path: Path) -> None:
    await damaged_history(tmp_path)
    status, out, _ = run("inspect", "--data-dir", str(tmp_path))
    assert status == 1 and "lsn 5  " in out  # inspect reads on past the damage
    assert (
        f"recovery: STOPS at lsn 2: record 2 is damaged (checksum mismatch in journal-00000000000000000001.log at "
        f"byte offset {16 + len(GOOD)}); move only it out of the log: kvrouter journal quarantine --data-dir "
        f"{tmp_path} --lsn 2 --yes"
    ) in out
    before = contents(tmp_path)

    status, out, _ = run("quarantine", "--data-dir", str(tmp_path), "--lsn", "2")
    assert status == 0 and contents(tmp_path) == before
    kept = tmp_path / "quarantine-00000000000000000002.frame"
    assert out.splitlines()[0] == (
        f"would move record 2 (damaged: checksum mismatch; {16 + len(KV)} bytes in journal-00000000000000000001.log "
        f"at byte offset {16 + len(GOOD)}) to {kept} and leave a placeholder in its place; every other record stays"
    )
    assert out.splitlines()[-1] == "dry run: nothing changed; add --yes to quarantine"

    status, out, _ = run("quarantine", "--data-dir", str(tmp_path), "--lsn", "2", "--yes")
    assert status == 0 and out.startswith(f"quarantined: moved record 2 (damaged: checksum mismatch; {16 + len(KV)}")
    assert out.splitlines()[-1] == (
        "recovery: ok, from the first record plus 4 records to lsn 5 (1 scopes); it passes over 1 damaged "
        "rebuildable or quarantined records (lsn 2)"
    )
    assert kept.read_bytes() == before["journal-00000000000000000001.log"][16 + len(GOOD) : 32 + len(GOOD) + len(KV)]

    status, _, err = run("quarantine", "--data-dir", str(tmp_path), "--lsn", "3", "--yes")
    assert status == 2 and err.startswith("kvrouter journal quarantine: cannot quarantine lsn 3: record 3 is intact")


async def test_quarantine_takes_a_record_recovery_cannot_use(tmp_path: Path) -> None:
    await append_records(tmp_path, [GOOD, POISON, GOOD])

    status, out, _ = run("quarantine", "--data-dir", str(tmp_path), "--lsn", "2", "--yes")

    assert status == 0 and "(intact, but recovery cannot use it;" in out
    assert out.splitlines()[-1].startswith("recovery: ok, from the first record plus 2 records to lsn 3")
