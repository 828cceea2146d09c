"""``kvrouter journal`` in-process: what inspect reports, and the cuts truncate-after refuses (nothing changed)."""

from __future__ import annotations

import io
from functools import partial
from pathlib import Path

import trio

from kvrouter.actors.core.events import PrefillCompleted, WorkerRegistered
from kvrouter.actors.core.evolve import fold
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.persistence.codec import encode_record
from kvrouter.actors.persistence.journal_check import Stop, check_recovery
from kvrouter.actors.persistence.snapshots import encode_snapshot
from kvrouter.api import journal_cli
from kvrouter.api.main import lock_data_dir
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
    assert check.stop == Stop("record", 3, check.stop.problem if check.stop else "")
    status, out, _ = run("inspect", "--data-dir", str(tmp_path))
    assert status == 1 and "snapshot lsn 1  " in out and out.count("  ok\n") == 1

    status, out, _ = run("truncate-after", "--data-dir", str(tmp_path), "--lsn", "2", "--yes")
    assert status == 0 and out.splitlines()[-1] == (
        "recovery: ok, from snapshot lsn 1 plus 1 records to lsn 2 (1 scopes)"
    )
