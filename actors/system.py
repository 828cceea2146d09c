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
import math
import random
import secrets
from collections.abc import Callable, Sequence
from typing import Any, cast

import trio

from kvrouter.actors.actor import JOURNAL_GONE, ActorPorts, LastWrite, Observer, ScopeActor
from kvrouter.actors.core.commands import (
    SCOPE_CREATING,
    Command,
    ExpireStale,
    IngestKvBatch,
    RegisterWorker,
    RemoveWorker,
    SelectWorker,
    UnregisterWorker,
    UpsertWorker,
)
from kvrouter.actors.core.decide import decide
from kvrouter.actors.core.decisions import Decision, Reason, Rejected
from kvrouter.actors.core.desk import without_scope
from kvrouter.actors.core.events import Event
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.limits import MAX_INDEX_BLOCKS_PER_SCOPE, MAX_SCOPES
from kvrouter.actors.core.pending import PendingSelections
from kvrouter.actors.core.selection_rules import service_weight
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.deadlines import Deadlines
from kvrouter.actors.decision_feed import DecisionFeed
from kvrouter.actors.mailbox import ENQUEUE_TIMEOUT, Batch, Envelope, JournalUnavailable, Overloaded, ReplyTimeout
from kvrouter.actors.operator_log import log_operator_events
from kvrouter.actors.ports import Clock
from kvrouter.actors.snapshotter import (
    SnapshotFailed,
    SnapshotMethod,
    SnapshotPacing,
    SnapshotReport,
    Snapshotter,
    choose_method,
)
from kvrouter.journal.store import Journal, JournalFenced, SnapshotRefused

log = logging.getLogger("kvrouter.actors")

EXPIRY_AGE_NS = 300 * 1_000_000_000  # the reference's stale-request age
EXPIRY_SWEEP_SECONDS = 30.0  # sweep twice per reference interval: stale requests go by ~330 s
SNAPSHOT_EVERY_RECORDS = 50_000
SNAPSHOT_EVERY_BYTES = 64 * 1024 * 1024
# The only commands that change a scope's ranks (what it counts toward the service's rank limit) or its
# schedulable workers (whether it counts toward "a schedulable worker anywhere").
_RANK_COMMANDS = (RegisterWorker, UnregisterWorker, UpsertWorker, RemoveWorker)
# Every (use_kv_events, queueing) pair a selection can be asked under: the scopes with a schedulable worker are
# kept for each.
_SCHEDULING = ((False, False), (False, True), (True, False), (True, True))


def queue_timeout(seconds: float) -> str:
    return f"every eligible worker stayed busy for {seconds:g} s while the request waited in the queue"


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
        reply_deadline: float = math.inf,
        max_index_blocks_per_scope: int = MAX_INDEX_BLOCKS_PER_SCOPE,
    ) -> None:
        self.journal = journal
        self.clock = clock
        self._actors: dict[ScopeKey, ScopeActor] = {}
        self._recovered = states or {}
        self._nursery: trio.Nursery | None = None
        self._snapshot_due = trio.Event()
        self.snapshot_every_records = snapshot_every_records
        self.snapshot_every_bytes = snapshot_every_bytes
        self._expiry_sweep_seconds = expiry_sweep_seconds
        self.snapshots_taken = 0
        self.snapshots_failed = 0
        # Commands refused because their scope's mailbox stayed full (Overloaded), per live scope, for metrics.
        self.mailbox_rejections: dict[ScopeKey, int] = {}
        self.last_snapshot: SnapshotReport | None = None
        self.seed = seed  # root of every scope's random source
        # Observers of applied decisions (replica publisher, directory, KV ingest): called synchronously
        # by the actor right after fold, so they must not block; each keeps its own bounded queue.
        self.observers: list[Observer] = [log_operator_events, self._count_ranks]
        # Each scope's weight toward limits.MAX_RANKS_PER_SERVICE (its ranks, and its rankless catalog workers),
        # kept from applied decisions; a registration is checked against it in the actor, before journaling.
        self._rank_weights: dict[ScopeKey, int] = {s: service_weight(st) for s, st in self._recovered.items()}
        self._ranks_total = sum(self._rank_weights.values())
        # The scopes with a schedulable worker, per (use_kv_events, queueing), kept from applied decisions as the
        # weights are: a selection in a scope without one asks it (in the actor, right before deciding) whether
        # any other scope has one, instead of reading every scope's state from the request's task.
        self._schedulable: dict[tuple[bool, bool], set[ScopeKey]] = {key: set() for key in _SCHEDULING}
        for state in self._recovered.values():
            self._set_schedulable(state)
        # The KV-event index cap of each scope (actors/core/index_bounds.py), carried by each KV command.
        self.max_index_blocks_per_scope = max_index_blocks_per_scope
        self.pending_options = pending_options or {}
        # Every ask waits at most this long for its durable decision (then ReplyTimeout); the command
        # itself goes on. Infinite by default: simulations and tests opt in.
        self.deadlines = Deadlines(reply_deadline)
        # Set once the journal can no longer be written: every ask fails at once from then on.
        self.failure: BaseException | None = None
        # Explained selections, while someone reads them (GET /ws/decisions, actors/decision_feed.py).
        self.decisions = DecisionFeed()
        # Told when a scope's queue of waiting selections changes (its pending counts; GET /ws/loads).
        self.queue_observers: list[Callable[[ScopeKey], None]] = []
        self._ports = ActorPorts(
            journal,
            self.observers,
            self.after_turn,
            self.retire,
            surroundings=self,
            decisions=self.decisions,
            queue_observers=self.queue_observers,
            last_write=LastWrite(journal.last_lsn),  # what was there before this process started: all of it
        )
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
                self._start(state, last_write_lsn=0)  # everything recovered is durable
            self._recovered = {}
            nursery.start_soon(self._expire_periodically)
            nursery.start_soon(self._snapshot_when_due)
            nursery.start_soon(self.deadlines.run)
            task_status.started(self)

    def halt(self, failure: BaseException) -> None:
        """The journal failed for good: refuse every further command (the owner is stopping the service)."""
        if self.failure is None:
            self.failure = failure

    # -- commands ---------------------------------------------------------------------------------

    async def ask(self, scope: ScopeKey, command: Command, *, on_settled: Callable[[], None] | None = None) -> Decision:
        """Apply ``command`` in ``scope`` and return its decision once it is durable.

        ``on_settled`` is called as soon as the decision is made (or refused), before durability: an
        in-flight claim ends there. Raises Overloaded (not applied), ReplyTimeout (no durable decision
        within the reply deadline; it may still be applied) or JournalUnavailable (not acknowledged).
        """
        envelope = Envelope(command, on_settled)
        immediate = await self._post(scope, envelope)
        if immediate is not None:
            return immediate
        self.deadlines.track(envelope)
        try:
            await envelope.done.wait()
        except trio.Cancelled:
            envelope.abandoned = True  # if it waits in the scope's queue, it is dropped there, never applied
            raise
        if envelope.timed_out:
            if envelope.queued:  # still waiting for a rank: it never will be applied now
                return Rejected(Reason.OVERLOADED, queue_timeout(self.deadlines.seconds))
            raise self.reply_timeout(f"{type(command).__name__} in {scope.describe()}")
        if envelope.failure is not None:
            raise JournalUnavailable(envelope.failure)
        if envelope.lsn > self.journal.durable_lsn:  # a decision that wrote nothing, on writes not yet durable
            with trio.move_on_after(self.deadlines.seconds):
                await self.wait_durable(envelope.lsn)  # (or a journal failure: raises)
                assert envelope.decision is not None
                return envelope.decision
            raise self.reply_timeout(f"{type(command).__name__} in {scope.describe()}")
        assert envelope.decision is not None
        return envelope.decision

    async def ask_many(self, commands: Sequence[tuple[ScopeKey, Command]]) -> list[Decision | Exception]:
        """Apply ``commands`` (slot tracker writes: ``BATCHABLE``) and return each one's decision, in order,
        once all of them are durable; a command that was not applied or not acknowledged gets the exception
        ``ask`` would raise for it (Overloaded, ReplyTimeout, JournalUnavailable) in its place.

        The same effect as asking each in list order, one after another's submission (the commands of one
        scope are decided in list order; scopes are independent), at a fraction of the cost: the commands of
        each scope go into its mailbox as one ``Batch`` (one post, one durability callback, one deadline).
        """
        results: list[Decision | Exception | None] = [None] * len(commands)
        by_scope: dict[ScopeKey, list[int]] = {}
        for index, (scope, _) in enumerate(commands):
            by_scope.setdefault(scope, []).append(index)
        posted: list[tuple[Batch, list[int], ScopeKey]] = []
        for scope, indices in by_scope.items():
            try:
                batch, batched = await self._post_batch(scope, [commands[i][1] for i in indices], indices, results)
            except (Overloaded, JournalUnavailable) as exc:
                for i in indices:
                    if results[i] is None:
                        results[i] = exc
                continue
            if batch is not None:
                self.deadlines.track(batch)
                posted.append((batch, batched, scope))
        for batch, batched, scope in posted:
            await batch.done.wait()
            durable = self.journal.durable_lsn
            late: ReplyTimeout | None = None
            for i, decision, lsn in zip(batched, list(batch.decisions), list(batch.lsns), strict=False):
                if lsn <= durable:
                    results[i] = decision
                elif batch.timed_out:
                    late = late or self.reply_timeout(f"a batch of {len(batched)} commands in {scope.describe()}")
                    results[i] = late
                else:
                    try:
                        await self.wait_durable(lsn)  # a barrier (a decision that wrote nothing), or a failure
                        results[i] = decision
                    except JournalUnavailable as gone:
                        results[i] = gone
            for i in batched[len(batch.decisions) :]:
                if batch.failure is not None:
                    results[i] = JournalUnavailable(batch.failure)
                else:  # past the deadline before it was decided: it may still be applied
                    late = late or self.reply_timeout(f"a batch of {len(batched)} commands in {scope.describe()}")
                    results[i] = late
        return cast(list[Decision | Exception], results)  # every slot is filled above

    async def _post_batch(
        self, scope: ScopeKey, commands: list[Command], indices: list[int], results: list[Any]
    ) -> tuple[Batch | None, list[int]]:
        """Put ``commands`` of ``scope`` in its mailbox as one batch, answering at once those that come before
        the scope exists (from an empty state, as ``_enqueue`` does); the batch (or None) and its indices."""
        if self.failure is not None:
            raise JournalUnavailable(self.failure)
        actor = self._actors.get(scope)
        start = 0
        while actor is None and start < len(commands):
            command = commands[start]
            if not isinstance(command, SCOPE_CREATING):
                results[indices[start]] = self._decide_alone(scope, command)
            elif len(self._actors) >= MAX_SCOPES:
                results[indices[start]] = Rejected(
                    Reason.CONFLICT,
                    f"the service holds {len(self._actors)} (model, tenant) scopes, the limit of {MAX_SCOPES} "
                    f"scopes per service; {scope.describe()} is not created",
                )
            else:
                actor = self._start(ScopeState(scope), last_write_lsn=self._ports.last_write.lsn)
                break
            start += 1
        if actor is None:
            return None, []
        batch = Batch(commands[start:] if start else commands)
        try:
            actor.outbox.send_nowait(batch)
        except trio.WouldBlock:
            with trio.move_on_after(ENQUEUE_TIMEOUT) as waited:
                await actor.outbox.send(batch)
            if waited.cancelled_caught:
                self.mailbox_rejections[scope] = self.mailbox_rejections.get(scope, 0) + len(batch.commands)
                raise Overloaded(f"mailbox of {scope.describe()} is full") from None
        return batch, indices[start:]

    def reply_timeout(self, what: str) -> ReplyTimeout:
        """The error for an ask past its deadline, logged once with the request id it carries."""
        request_id = secrets.token_hex(8)
        log.warning(
            "no reply within %g s for %s (request_id %s); it may still be applied",
            self.deadlines.seconds,
            what,
            request_id,
        )
        return ReplyTimeout(request_id, self.deadlines.seconds)

    async def apply(self, scope: ScopeKey, command: Command) -> tuple[Decision, int]:
        """Apply ``command`` and return (decision, lsn) once it is applied, NOT yet durable: for an owner
        that chains commands across scopes and waits for the last LSN itself (``wait_durable``)."""
        settled = trio.Event()
        envelope = Envelope(command, settled.set)
        immediate = await self._post(scope, envelope)
        if immediate is not None:
            return immediate, 0
        await settled.wait()
        if envelope.failure is not None:
            raise JournalUnavailable(envelope.failure)
        assert envelope.decision is not None
        return envelope.decision, envelope.lsn

    async def _post(self, scope: ScopeKey, envelope: Envelope) -> Decision | None:
        """Put ``envelope`` in the scope's mailbox; or, without a scope, answer at once from an empty state.

        Whatever happens, ``envelope.on_settled`` runs exactly once: here if the command is answered at
        once or never reaches the mailbox (overloaded, cancelled, journal gone), else by the actor.
        """
        try:
            decision = await self._enqueue(scope, envelope)
        except BaseException:
            if envelope.on_settled is not None:
                envelope.on_settled()
            raise
        if decision is not None and envelope.on_settled is not None:
            envelope.on_settled()
        return decision

    async def _enqueue(self, scope: ScopeKey, envelope: Envelope) -> Decision | None:
        if self.failure is not None:
            raise JournalUnavailable(self.failure)
        actor = self._actors.get(scope)
        command = envelope.command
        if actor is None:
            if not isinstance(command, SCOPE_CREATING):
                return self._decide_alone(scope, command)
            if len(self._actors) >= MAX_SCOPES:
                return Rejected(
                    Reason.CONFLICT,
                    f"the service holds {len(self._actors)} (model, tenant) scopes, the limit of {MAX_SCOPES} "
                    f"scopes per service; {scope.describe()} is not created",
                )
            actor = self._start(ScopeState(scope), last_write_lsn=self._ports.last_write.lsn)
        try:
            actor.outbox.send_nowait(envelope)
        except trio.WouldBlock:
            # A cancelled trio send has no effect, so a timeout here means "not applied".
            with trio.move_on_after(ENQUEUE_TIMEOUT) as waited:
                await actor.outbox.send(envelope)
            if waited.cancelled_caught:
                self.mailbox_rejections[scope] = self.mailbox_rejections.get(scope, 0) + 1
                raise Overloaded(f"mailbox of {scope.describe()} is full") from None
        return None

    def _decide_alone(self, scope: ScopeKey, command: Command) -> Decision:
        """No scope: the core answers from an empty state (not found, a no-op, or no schedulable worker)."""
        state = ScopeState(scope)
        prepared = without_scope(state, command, self)
        return prepared if isinstance(prepared, Rejected) else decide(state, prepared)

    async def apply_kv(self, scope: ScopeKey, command: IngestKvBatch, kv_blocks: int = 0) -> None:
        """Apply a worker's KV events (one run, one command) in ``scope`` and return once the actor has applied
        them: decided, journaled, folded. Never waits for durability, and asks the journal for no durability
        callback (``Envelope.awaited``): a crash loses the records and the watermark together, and the listener
        replays them. Dropped when the scope has no actor (its worker left). Waits while the mailbox is full
        (policy: block the listener; zmq's high-water mark then pushes back on the publisher).

        ``kv_blocks``: the blocks the run's batches name (its share of the actor's turn), if counted already.
        When the actor's task waits on an empty mailbox, the run is applied as its next turn from this task
        (``ScopeActor.apply_now``): the same turn, without the hand-over to the actor's task and back."""
        actor = self._actors.get(scope)
        if actor is None:
            return
        envelope = Envelope(command, kv_blocks=kv_blocks, awaited=False)
        if actor.apply_now(envelope):
            return
        applied = trio.Event()
        envelope.on_settled = applied.set
        try:
            # Without the yield of ``send`` when the mailbox has room (the wait below yields anyway): one
            # scheduling pass of the caller fewer per run.
            actor.outbox.send_nowait(envelope)
        except trio.WouldBlock:
            try:
                await actor.outbox.send(envelope)
            except trio.ClosedResourceError:
                return  # retired while we waited
        except trio.ClosedResourceError:
            return  # retired meanwhile
        await applied.wait()

    # -- what the scopes know of each other (the actors' ``Surroundings``) -----------------------------

    def ranks_elsewhere(self, scope: ScopeKey) -> int:
        """What the service's scopes other than ``scope`` count toward ``MAX_RANKS_PER_SERVICE``."""
        return self._ranks_total - self._rank_weights.get(scope, 0)

    def schedulable_elsewhere(self, scope: ScopeKey, use_kv_events: bool, queueing: bool) -> bool:
        """Whether a scope other than ``scope`` has a schedulable worker (under these settings)."""
        scopes = self._schedulable[use_kv_events, queueing]
        return len(scopes) > (scope in scopes)

    def _count_ranks(self, state: ScopeState, command: Command, events: tuple[Event, ...]) -> None:
        if isinstance(command, _RANK_COMMANDS):
            self._set_weight(state.scope, service_weight(state))
            self._set_schedulable(state)

    def _set_schedulable(self, state: ScopeState) -> None:
        scope = state.scope
        for key, scopes in self._schedulable.items():
            if state.exists and state.selection.schedulable(*key):
                scopes.add(scope)
            else:
                scopes.discard(scope)

    def _set_weight(self, scope: ScopeKey, weight: int) -> None:
        self._ranks_total += weight - self._rank_weights.pop(scope, 0)
        if weight:
            self._rank_weights[scope] = weight

    def pending_loads(self, scope: ScopeKey) -> tuple[int, int]:
        """``(pending_count, pending_isl_tokens)``: selections waiting in the scope's queue."""
        actor = self._actors.get(scope)
        return actor.pending_loads() if actor is not None else (0, 0)

    def query(self, scope: ScopeKey, command: SelectWorker) -> Decision:
        """Answer a non-booking selection without a mailbox round trip (see ScopeActor.query)."""
        actor = self._actors.get(scope)
        if actor is None:
            return self._decide_alone(scope, command)
        return actor.query(command)

    async def submit(self, scope: ScopeKey, command: Command) -> None:
        """Enqueue without waiting for the decision; waits while the mailbox is full (policy:
        block the producer). Dropped if the scope is gone (its worker left)."""
        actor = self._actors.get(scope)
        if actor is not None:
            with contextlib.suppress(trio.ClosedResourceError):  # retired while we waited
                await actor.outbox.send(Envelope(command))

    # -- reads ------------------------------------------------------------------------------------

    def scopes(self) -> list[ScopeKey]:
        """The scopes that have an actor now, sorted."""
        return sorted(self._actors)

    def mailboxes(self) -> list[tuple[ScopeKey, int, int]]:
        """``(scope, commands waiting in its mailbox now, the most ever waiting)`` per live scope (metrics)."""
        return [
            (scope, actor.mailbox_statistics().current_buffer_used, actor.peak_depth)
            for scope, actor in self._actors.items()
        ]

    def state(self, scope: ScopeKey) -> ScopeState | None:
        actor = self._actors.get(scope)
        return actor.state if actor is not None and actor.state.exists else None

    def states(self) -> list[ScopeState]:
        return sorted((a.state for a in self._actors.values() if a.state.exists), key=lambda s: s.scope)

    async def read_barrier(self, scope: ScopeKey | None = None) -> None:
        """Wait until every write a read may have seen is durable (reads never show lost writes).

        With ``scope``, only that scope's last write (a read of one scope sees nothing else); without,
        or for a scope without an actor (its absence may come from a write not yet durable), all of them.
        A worker's KV events are not writes here (``actor.WORKER_KV_COMMANDS``): a read does not wait for
        their fsync, so selections during a KV flood wait for no disk at all.
        """
        actor = self._actors.get(scope) if scope is not None else None
        lsn = actor.last_write_lsn if actor is not None else self._ports.last_write.lsn
        if lsn > self.journal.durable_lsn:
            await self.wait_durable(lsn)

    async def wait_durable(self, lsn: int) -> None:
        """``journal.wait_durable``, with a failed journal reported as JournalUnavailable: the record may have been
        written (a write that failed or got no answer), unless the journal was fenced (refused, or stored off the
        log's chain: not applied)."""
        try:
            await self.journal.wait_durable(lsn)
        except JOURNAL_GONE as exc:
            fenced = isinstance(exc.__cause__, JournalFenced)
            raise JournalUnavailable(exc, maybe_written=not fenced) from exc

    # -- actor lifecycle --------------------------------------------------------------------------

    def _start(self, state: ScopeState, *, last_write_lsn: int) -> ScopeActor:
        assert self._nursery is not None, "ActorSystem.run has not started"
        scope = state.scope
        rng = random.Random(f"{self.seed}:{scope.model_name}:{scope.tenant_id}")
        actor = ScopeActor(state, self._ports, rng, PendingSelections(**self.pending_options), last_write_lsn)
        self._actors[scope] = actor  # inserted before any await: starting cannot race
        self._nursery.start_soon(actor.run)
        return actor

    def retire(self, actor: ScopeActor) -> None:
        if self._actors.get(actor.state.scope) is actor:
            del self._actors[actor.state.scope]
            self.mailbox_rejections.pop(actor.state.scope, None)
            self._set_weight(actor.state.scope, 0)
            for scopes in self._schedulable.values():
                scopes.discard(actor.state.scope)
        actor.outbox.close()

    def after_turn(self) -> None:
        if self._snapshot_needed():
            self._snapshot_due.set()

    def _snapshot_needed(self) -> bool:
        return self.failure is None and (
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
            for scope in sorted(self._actors):
                try:
                    await self.ask(scope, ExpireStale(EXPIRY_AGE_NS, at=at))
                except Overloaded:
                    log.warning("expiry skipped for %s: mailbox full", scope.describe())
                except (ReplyTimeout, JournalUnavailable):
                    pass  # logged where it happened; the next sweep tries again (or the service is stopping)

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
            except SnapshotRefused as exc:  # not a local fault: another writer holds a newer snapshot
                log.warning("snapshot not stored, a newer one is (another owner wrote the log): %s", exc)
            except (SnapshotFailed, OSError) as exc:
                if self.failure is not None:
                    continue  # the journal is gone and the service is stopping: that is the one thing to say
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
