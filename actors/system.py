"""ActorSystem: routes commands to scope actors, starts them on demand, retires dissolved ones.

It also owns the time-driven work that must enter actors as commands (stale-request expiry) and
the snapshot policy, so that recovery time stays bounded: a snapshot is due every
``snapshot_every_records`` records or ``snapshot_every_bytes`` bytes, at most one is in flight, and
``SnapshotPacing`` keeps large ones apart. How a snapshot is taken without stopping the service
(a copy-on-write child process) is ``actors/snapshotter.py``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import trio

from kvrouter.actors.actor import ScopeActor
from kvrouter.actors.core.commands import SCOPE_CREATING, Command, ExpireStale, SelectWorker
from kvrouter.actors.core.decide import decide
from kvrouter.actors.core.decisions import Decision
from kvrouter.actors.core.events import Event
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.mailbox import ENQUEUE_TIMEOUT, Envelope, Overloaded
from kvrouter.actors.ports import Clock
from kvrouter.actors.snapshotter import (
    SnapshotFailed,
    SnapshotMethod,
    SnapshotPacing,
    SnapshotReport,
    Snapshotter,
    choose_method,
)
from kvrouter.journal.store import Journal

log = logging.getLogger("kvrouter.actors")

EXPIRY_AGE_NS = 300 * 1_000_000_000  # the reference's stale-request age
EXPIRY_SWEEP_SECONDS = 30.0  # sweep twice per reference interval: stale requests go by ~330 s
SNAPSHOT_EVERY_RECORDS = 50_000
SNAPSHOT_EVERY_BYTES = 64 * 1024 * 1024
MAX_SCOPES = 10_000  # (model, tenant) scopes are client input: cap them (policy: reject, 503)


class ActorSystem:
    def __init__(
        self,
        journal: Journal,
        clock: Clock,
        states: dict[ScopeKey, ScopeState] | None = None,
        *,
        snapshot_every_records: int = SNAPSHOT_EVERY_RECORDS,
        snapshot_every_bytes: int = SNAPSHOT_EVERY_BYTES,
        expiry_sweep_seconds: float = EXPIRY_SWEEP_SECONDS,
        encode_snapshots_in_thread: bool = True,
        snapshot_method: SnapshotMethod | None = None,
        snapshotter: Snapshotter | None = None,
        snapshot_pacing: SnapshotPacing | None = None,
        seed: int | str = 0,
        pending_options: dict[str, Any] | None = None,
    ) -> None:
        self.journal = journal
        self.clock = clock
        self.actors: dict[ScopeKey, ScopeActor] = {}
        self._recovered = states or {}
        self._nursery: trio.Nursery | None = None
        self._snapshot_due = trio.Event()
        self.snapshot_every_records = snapshot_every_records
        self.snapshot_every_bytes = snapshot_every_bytes
        self._expiry_sweep_seconds = expiry_sweep_seconds
        self.snapshots_taken = 0
        self.snapshots_failed = 0
        self.last_snapshot: SnapshotReport | None = None
        self.seed = seed  # root of every scope's random source
        # Observers of applied decisions (the replica publisher): called synchronously by the
        # actor right after fold, so they must not block; each keeps its own bounded queue.
        self.observers: list[Callable[[ScopeState, Command, tuple[Event, ...]], None]] = []
        self.pending_options = pending_options or {}
        # Production takes snapshots off the loop (a forked child, else a thread encodes); simulations
        # pass encode_snapshots_in_thread=False to take them inline, at a deterministic point of virtual time.
        if snapshotter is None:
            method = snapshot_method or choose_method(journal, off_loop=encode_snapshots_in_thread)
            snapshotter = Snapshotter(journal, method)
        self.snapshotter = snapshotter
        self.snapshot_pacing = snapshot_pacing or SnapshotPacing()
        self._snapshot_lock = trio.Lock()  # at most one snapshot in flight

    async def run(self, *, task_status: trio.TaskStatus[ActorSystem] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for state in self._recovered.values():
                self._start(state)
            self._recovered = {}
            nursery.start_soon(self._expire_periodically)
            nursery.start_soon(self._snapshot_when_due)
            task_status.started(self)

    # -- commands ---------------------------------------------------------------------------------

    async def ask(self, scope: ScopeKey, command: Command) -> Decision:
        """Apply ``command`` in ``scope`` and return its decision once it is durable."""
        actor = self.actors.get(scope)
        if actor is None:
            if not isinstance(command, SCOPE_CREATING):
                # No scope: the core answers from an empty state (not found, or a no-op).
                return decide(ScopeState(scope), command)
            if len(self.actors) >= MAX_SCOPES:
                raise Overloaded(f"too many scopes (limit {MAX_SCOPES})")
            actor = self._start(ScopeState(scope))
        envelope = Envelope(command)
        try:
            actor.outbox.send_nowait(envelope)
        except trio.WouldBlock:
            # A cancelled trio send has no effect, so a timeout here means "not applied".
            with trio.move_on_after(ENQUEUE_TIMEOUT) as waited:
                await actor.outbox.send(envelope)
            if waited.cancelled_caught:
                raise Overloaded(f"mailbox of {scope.describe()} is full") from None
        await envelope.done.wait()
        if envelope.lsn > self.journal.durable_lsn:
            await self.journal.wait_durable(envelope.lsn)  # only after a journal failure: raises
        assert envelope.decision is not None
        return envelope.decision

    def query(self, scope: ScopeKey, command: SelectWorker) -> Decision:
        """Answer a non-booking selection without a mailbox round trip (see ScopeActor.query)."""
        actor = self.actors.get(scope)
        if actor is None:
            return decide(ScopeState(scope), command)
        return actor.query(command)

    async def submit(self, scope: ScopeKey, command: Command) -> None:
        """Enqueue without waiting for the decision; waits while the mailbox is full (policy:
        block the producer). Dropped if the scope is gone (its worker left)."""
        actor = self.actors.get(scope)
        if actor is not None:
            with contextlib.suppress(trio.ClosedResourceError):  # retired while we waited
                await actor.outbox.send(Envelope(command))

    # -- reads ------------------------------------------------------------------------------------

    def state(self, scope: ScopeKey) -> ScopeState | None:
        actor = self.actors.get(scope)
        return actor.state if actor is not None and actor.state.exists else None

    def states(self) -> list[ScopeState]:
        return sorted((a.state for a in self.actors.values() if a.state.exists), key=lambda s: s.scope)

    async def read_barrier(self) -> None:
        """Wait until everything a read may have seen is durable (reads never show lost writes)."""
        await self.journal.wait_durable(self.journal.last_lsn)

    # -- actor lifecycle --------------------------------------------------------------------------

    def _start(self, state: ScopeState) -> ScopeActor:
        assert self._nursery is not None, "ActorSystem.run has not started"
        actor = ScopeActor(self, state)
        self.actors[state.scope] = actor  # inserted before any await: starting cannot race
        self._nursery.start_soon(actor.run)
        return actor

    def retire(self, actor: ScopeActor) -> None:
        if self.actors.get(actor.state.scope) is actor:
            del self.actors[actor.state.scope]
        actor.outbox.close()

    def after_turn(self) -> None:
        if self._snapshot_needed():
            self._snapshot_due.set()

    def _snapshot_needed(self) -> bool:
        return (
            self.journal.records_since_snapshot >= self.snapshot_every_records
            or self.journal.bytes_since_snapshot >= self.snapshot_every_bytes
        )

    # -- time-driven work -------------------------------------------------------------------------

    async def _expire_periodically(self) -> None:
        while True:
            await trio.sleep(self._expiry_sweep_seconds)
            at = self.clock.now_ns()
            # One scope at a time, in a fixed order, so the journal's interleaving is a pure
            # function of the inputs (simulations compare journals byte for byte).
            for scope in sorted(self.actors):
                try:
                    await self.ask(scope, ExpireStale(EXPIRY_AGE_NS, at=at))
                except Overloaded:
                    log.warning("expiry skipped for %s: mailbox full", scope.describe())

    async def _snapshot_when_due(self) -> None:
        while True:
            await self._snapshot_due.wait()
            earliest = self.snapshot_pacing.earliest_start()
            if trio.current_time() < earliest:
                await trio.sleep_until(earliest)  # pacing: not back to back
            self._snapshot_due = trio.Event()
            if not self._snapshot_needed():
                continue  # set before the previous snapshot finished, which covered it
            try:
                await self.snapshot()
            except (SnapshotFailed, OSError) as exc:
                log.error(
                    "snapshot failed, the previous one stays (restarts replay a longer log; retrying in %.0f s; "
                    "if it keeps failing, check free disk space and memory): %s",
                    self.snapshot_pacing.earliest_start() - trio.current_time(),
                    exc,
                )

    async def snapshot(self) -> SnapshotReport:
        """Capture every scope at the journal's last LSN (no await in between), persist it.

        One at a time; the pacing policy hears of every attempt, this one included.
        """
        async with self._snapshot_lock:
            started = trio.current_time()
            succeeded = False
            try:
                report = await self.snapshotter.take(self._capture)
                succeeded = True
            finally:
                self.snapshot_pacing.record(started, trio.current_time(), succeeded=succeeded)
                self.snapshots_failed += not succeeded
        self.snapshots_taken += 1
        self.last_snapshot = report
        log.info(
            "snapshot at lsn %d (%s): %d scopes, %d bytes, event loop held %.1f ms, %.2f s in all",
            report.lsn,
            report.method.value,
            report.scopes,
            report.payload_bytes,
            report.loop_pause * 1e3,
            report.duration,
        )
        return report

    def _capture(self) -> tuple[int, list[ScopeState]]:
        return self.journal.last_lsn, self.states()
