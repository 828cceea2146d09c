"""Snapshots on the real file journal, taken by a copy-on-write child process while commands keep
arriving: the snapshot is the state at its LSN, recovery from it plus the tail is the live state, a
failing child changes nothing but the log line, and large snapshots are never taken back to back.

The child's serializer is injectable: the tests hold a child at a gate (a file the parent creates)
so that commands are applied between the fork and the child's work, deterministically.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio

from kvrouter.actors.core.commands import AddRequest, FreeRequest, RegisterWorker
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.persistence.recovery import recover, replay
from kvrouter.actors.persistence.snapshots import restore_snapshot
from kvrouter.actors.ports import WallClock
from kvrouter.actors.snapshotter import (
    SnapshotFailed,
    SnapshotMethod,
    SnapshotPacing,
    SnapshotReport,
    Snapshotter,
    choose_method,
    serialize_states,
)
from kvrouter.actors.system import ActorSystem
from kvrouter.api.process.main import ServiceHandle
from kvrouter.journal.file import FileJournal
from kvrouter.journal.memory import MemoryJournal
from kvrouter.journal.scan import read_range
from kvrouter.journal.store import Durability
from kvrouter.simulations.checkers import states_digest

SCOPE = ScopeKey("m", "default")
TIMEOUT = 30  # only a hang reaches it
T = TypeVar("T")


# -- helpers ----------------------------------------------------------------------------------------


def gated(markers: Path) -> Callable[[int, list[ScopeState]], bytes]:
    """A serializer for the forked child: it announces itself (``forked-<lsn>`` holds its pid), waits
    for the file ``go``, then serialises as production does."""

    def serialize(lsn: int, states: list[ScopeState]) -> bytes:
        tmp = markers / f".forked-{lsn}"
        tmp.write_text(str(os.getpid()))
        tmp.replace(markers / f"forked-{lsn}")
        while not (markers / "go").exists():
            time.sleep(0.001)
        return serialize_states(lsn, states)

    return serialize


def at_the_gate(markers: Path) -> list[tuple[int, int]]:
    """(lsn, pid) of the children that reached the gate so far."""
    return [
        (int(path.name.removeprefix("forked-")), int(path.read_text())) for path in sorted(markers.glob("forked-*"))
    ]


async def forked_children(markers: Path, count: int = 1) -> list[tuple[int, int]]:
    """``at_the_gate``, once ``count`` children are there."""
    while len(found := at_the_gate(markers)) < count:  # noqa: ASYNC110 - another process
        await trio.sleep(0.001)
    return found


async def until(predicate: Callable[[], bool]) -> None:
    while not predicate():  # noqa: ASYNC110 - waits on the snapshot task or another process
        await trio.sleep(0.001)


class Traffic:
    """Adds (and frees a third of) requests in SCOPE; ``run`` keeps going until ``stop``."""

    def __init__(self, system: ActorSystem) -> None:
        self.system = system
        self.sent = 0
        self._stop = trio.Event()
        self._stopped = trio.Event()

    async def one(self) -> None:
        i = self.sent
        self.sent += 1
        await self.system.ask(SCOPE, AddRequest(f"r{i}", 1, i % 2, (i % 7, i), 5))
        if i % 3 == 0:
            await self.system.ask(SCOPE, FreeRequest(f"r{i}"))

    async def run(self) -> None:
        while not self._stop.is_set():
            await self.one()
        self._stopped.set()

    async def stop(self) -> None:
        """Stop ``run`` and return once its last command is applied."""
        self._stop.set()
        await self._stopped.wait()


async def with_system(
    journal: FileJournal, body: Callable[[ActorSystem, trio.Nursery], Awaitable[T]], **options: Any
) -> T:
    """Run ``body`` against a system on ``journal``, then stop as the service does (api/process/main.py): the
    actors and whatever ``body`` started first, then the journal."""
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as outer:
            await outer.start(journal.run)
            async with trio.open_nursery() as inner:
                system = ActorSystem(journal, WallClock(), **options)
                await inner.start(system.run)
                result = await body(system, inner)
                inner.cancel_scope.cancel()
            await journal.aclose()
    return result


def state_at(directory: Path, lsn: int) -> str:
    """Digest of the states the journal's records 1..lsn fold to (every segment is still on disk)."""
    states: dict[ScopeKey, ScopeState] = {}
    assert replay(states, read_range(directory, 0, lsn, lambda: 0)) == lsn
    return states_digest(list(states.values()))


def recovered_digest(directory: Path) -> str:
    return states_digest(list(recover(FileJournal.open(directory, Durability.ALWAYS)).states.values()))


def open_files(pid: int) -> list[str]:
    """What each of the process's descriptors points to (the one listing the directory vanishes)."""
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return links


def process_status(pid: int) -> dict[str, str]:
    return dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())


def staged_files(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.glob("*.tmp"))


# -- automatic snapshots ----------------------------------------------------------------------------


async def test_snapshots_bound_the_replayed_tail(tmp_path: Path) -> None:
    journal = FileJournal.open(tmp_path, Durability.ALWAYS)

    async def body(system: ActorSystem, nursery: trio.Nursery) -> str:
        assert system.snapshotter.method is SnapshotMethod.FORK
        await system.ask(SCOPE, RegisterWorker(1, 16, 0, 2))
        traffic = Traffic(system)
        while system.snapshots_taken < 4 or traffic.sent < 120:  # pacing spaces them: keep the load on
            await traffic.one()
        return states_digest(system.states())

    live = await with_system(journal, body, snapshot_every_records=25)
    recovered = recover(FileJournal.open(tmp_path, Durability.ALWAYS))
    assert recovered.snapshot_lsn > 3 * 25  # most of the history is in the snapshot...
    assert recovered.replayed_records < recovered.snapshot_lsn  # ...and only the tail is replayed
    assert states_digest(list(recovered.states.values())) == live


async def test_a_snapshot_taken_while_commands_keep_arriving_is_the_state_at_its_lsn(tmp_path: Path) -> None:
    directory, markers = tmp_path / "journal", tmp_path / "markers"
    markers.mkdir()
    journal = FileJournal.open(directory, Durability.OFF)
    taken: list[SnapshotReport] = []
    forked_at = 0

    async def body(system: ActorSystem, nursery: trio.Nursery) -> str:
        nonlocal forked_at
        await system.ask(SCOPE, RegisterWorker(1, 16, 0, 2))
        traffic = Traffic(system)
        for _ in range(30):
            await traffic.one()
        nursery.start_soon(traffic.run)

        async def take() -> None:
            taken.append(await system.snapshot())

        nursery.start_soon(take)
        [(forked_at, _)] = await forked_children(markers)
        await until(lambda: journal.last_lsn >= forked_at + 50)  # applied after the fork
        (markers / "go").touch()
        await until(lambda: bool(taken))
        await traffic.stop()
        return states_digest(system.states())

    snapshotter = Snapshotter(journal, SnapshotMethod.FORK, serialize=gated(markers))
    live = await with_system(journal, body, snapshot_every_records=10**9, snapshotter=snapshotter)

    [report] = taken
    assert report.lsn == forked_at and report.method is SnapshotMethod.FORK
    assert journal.last_lsn > report.lsn + 50
    snapshot = FileJournal.open(directory, Durability.OFF).latest_snapshot()
    assert snapshot is not None and snapshot.lsn == report.lsn and len(snapshot.payload) == report.payload_bytes
    restored = restore_snapshot(snapshot.payload)
    assert states_digest(list(restored.values())) == state_at(directory, report.lsn)
    assert recovered_digest(directory) == live
    assert staged_files(directory) == []


# -- failures ---------------------------------------------------------------------------------------


def raises(lsn: int, states: list[ScopeState]) -> bytes:
    raise MemoryError("no room for the copy")


def dies(lsn: int, states: list[ScopeState]) -> bytes:
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable")


def hangs(lsn: int, states: list[ScopeState]) -> bytes:
    while True:
        time.sleep(1)


@pytest.mark.parametrize(
    ("serialize", "reason"),
    [
        (raises, "exited with status 1: MemoryError: no room for the copy"),
        (dies, "was killed by SIGKILL"),
        (hangs, r"was killed by SIGKILL: killed after 0\.2 s"),
    ],
    ids=["raises", "killed", "stuck"],
)
async def test_a_failing_child_leaves_the_previous_snapshot_and_the_service_running(
    tmp_path: Path, serialize: Callable[[int, list[ScopeState]], bytes], reason: str
) -> None:
    journal = FileJournal.open(tmp_path, Durability.ALWAYS)

    async def body(system: ActorSystem, nursery: trio.Nursery) -> str:
        await system.ask(SCOPE, RegisterWorker(1, 16, 0, 2))
        traffic = Traffic(system)
        for _ in range(20):
            await traffic.one()
        good = await system.snapshot()
        before = journal.latest_snapshot()
        for _ in range(20):
            await traffic.one()

        system.snapshotter = Snapshotter(journal, SnapshotMethod.FORK, serialize=serialize, child_timeout=0.2)
        with pytest.raises(SnapshotFailed, match=reason):
            await system.snapshot()

        assert journal.latest_snapshot() == before and before is not None and before.lsn == good.lsn
        assert staged_files(tmp_path) == []
        assert (system.snapshots_taken, system.snapshots_failed) == (1, 1)
        for _ in range(5):  # still serving
            await traffic.one()
        return states_digest(system.states())

    live = await with_system(journal, body, snapshot_every_records=10**9)
    assert recovered_digest(tmp_path) == live


async def test_a_failed_automatic_snapshot_is_logged_and_retried_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal = FileJournal.open(tmp_path, Durability.ALWAYS)

    async def body(system: ActorSystem, nursery: trio.Nursery) -> None:
        await system.ask(SCOPE, RegisterWorker(1, 16, 0, 2))
        traffic = Traffic(system)
        while system.snapshots_failed == 0:
            await traffic.one()
        for _ in range(30):  # the threshold is crossed again, but the retry waits SNAPSHOT_RETRY_SECONDS
            await traffic.one()
        assert system.snapshots_failed == 1

    snapshotter = Snapshotter(journal, SnapshotMethod.FORK, serialize=raises)
    await with_system(journal, body, snapshot_every_records=10, snapshotter=snapshotter)
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert record.getMessage().startswith("snapshot failed, the previous one stays")
    assert "MemoryError: no room for the copy" in record.getMessage()
    assert journal.latest_snapshot() is None


async def test_when_fork_fails_the_snapshot_is_copied_on_the_loop_instead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse() -> int:
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    journal = FileJournal.open(tmp_path, Durability.ALWAYS)
    taken: list[SnapshotReport] = []

    async def body(system: ActorSystem, nursery: trio.Nursery) -> str:
        await system.ask(SCOPE, RegisterWorker(1, 16, 0, 2))
        monkeypatch.setattr(os, "fork", refuse)
        taken.append(await system.snapshot())
        return states_digest(system.states())

    live = await with_system(journal, body, snapshot_every_records=10**9)
    assert taken[0].method is SnapshotMethod.THREAD
    assert any("fork failed" in r.getMessage() for r in caplog.records)
    assert recovered_digest(tmp_path) == live


# -- what the child keeps from the service ----------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
async def test_the_child_holds_no_socket_lock_or_signal_handler_of_the_service(
    slot_tracker: ServiceHandle, tmp_path: Path
) -> None:
    system = slot_tracker.system
    markers = tmp_path / "markers"
    markers.mkdir()
    system.snapshotter = Snapshotter(system.journal, SnapshotMethod.FORK, serialize=gated(markers))
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(system.snapshot)
            [(_, pid)] = await forked_children(markers)
            links = open_files(pid)
            caught = process_status(pid)
            parent_links = open_files(os.getpid())
            (markers / "go").touch()
    assert any(link.startswith("socket:") for link in parent_links)  # what there was to close
    assert any(link.endswith("/LOCK") for link in parent_links)
    assert len(links) <= 4, links  # stdin, stdout, stderr and the report pipe
    assert not [link for link in links if link.startswith(("socket:", "anon_inode:")) or link.endswith("/LOCK")]
    handled = int(caught["SigCgt"], 16)
    assert not handled & (1 << (signal.SIGINT - 1)) and not handled & (1 << (signal.SIGTERM - 1))
    assert system.snapshots_taken == 1


# -- pacing -----------------------------------------------------------------------------------------


def test_pacing_waits_in_proportion_to_the_last_snapshot() -> None:
    pacing = SnapshotPacing(factor=4, retry_seconds=30)
    assert pacing.earliest_start() == float("-inf")
    pacing.record(100.0, 102.5, succeeded=True)
    assert pacing.earliest_start() == 102.5 + 4 * 2.5
    pacing.record(200.0, 200.0, succeeded=True)  # an instant (inline) snapshot is never delayed
    assert pacing.earliest_start() == 200.0
    pacing.record(300.0, 301.0, succeeded=False)  # a quick failure still waits retry_seconds
    assert pacing.earliest_start() == 331.0
    pacing.record(400.0, 410.0, succeeded=False)
    assert pacing.earliest_start() == 450.0
    with pytest.raises(ValueError, match=">= 0"):
        SnapshotPacing(factor=-1)


async def test_large_snapshots_are_not_taken_back_to_back(tmp_path: Path) -> None:
    directory, markers = tmp_path / "journal", tmp_path / "markers"
    markers.mkdir()
    journal = FileJournal.open(directory, Durability.OFF)
    taken: list[SnapshotReport] = []

    async def body(system: ActorSystem, nursery: trio.Nursery) -> None:
        await system.ask(SCOPE, RegisterWorker(1, 16, 0, 2))
        traffic = Traffic(system)
        for _ in range(5):
            await traffic.one()
        await forked_children(markers)
        for _ in range(40):  # the threshold is crossed many times over while the child works
            await traffic.one()
        assert len(at_the_gate(markers)) == 1  # at most one in flight
        (markers / "go").touch()
        await until(lambda: system.snapshots_taken == 1)
        assert system.last_snapshot is not None
        taken.append(system.last_snapshot)
        while system.snapshots_taken < 2:
            await traffic.one()
        taken.append(system.last_snapshot)

    await with_system(
        journal,
        body,
        snapshot_every_records=5,
        snapshotter=Snapshotter(journal, SnapshotMethod.FORK, serialize=gated(markers)),
        snapshot_pacing=SnapshotPacing(factor=2.0),
    )
    first, second = taken
    assert second.started >= first.finished + 2.0 * first.duration


def test_simulations_snapshot_inline_and_memory_journals_never_fork(tmp_path: Path) -> None:
    assert choose_method(MemoryJournal(), off_loop=False) is SnapshotMethod.INLINE
    assert choose_method(MemoryJournal(), off_loop=True) is SnapshotMethod.THREAD
    assert choose_method(FileJournal.open(tmp_path, Durability.OFF), off_loop=True) is SnapshotMethod.FORK
    with pytest.raises(ValueError, match="SnapshotStaging"):
        Snapshotter(MemoryJournal(), SnapshotMethod.FORK)
