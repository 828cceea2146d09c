"""ScopeActor: one trio task per (model, tenant) scope, the only writer of that scope's state.

Everything reaches the scope through its mailbox (``ActorSystem`` is the only sender). For each envelope: the
scope's desk prepares the command (pure: draws, templates, what the other scopes count, ``core/desk.py``) ->
decide (pure) -> append events to the journal (sync: assigns the LSN) -> fold (pure) -> tell the observers ->
the desk says what the asker is answered (or parks it in the waiting room) -> settle the envelope. There is
no await between append and fold, so the journal and the state can never disagree, and cancellation cannot
split them. The client's reply is held by the requesting task until the journal reports the LSN durable
(``ActorSystem.ask``), which lets the actor go on deciding the next commands while the disk works: fsyncs are
shared by everything queued meanwhile (group commit) without ever acknowledging a write the journal could lose.

The actor is handed its ports (``ActorPorts``: the journal, the observers, the system's turn and
retirement callbacks, what it knows of the other scopes) and its random source, never the system itself, so
it can be driven by any owner and imports nothing above it. When its mailbox is empty and its task waits, the
system may run a worker's KV-event command as the actor's next turn from the sender's own task
(``apply_now``): still one turn at a time, in mailbox order.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Sequence

import attrs
import trio

from kvrouter.actors.core.commands import Command, IngestKvBatch, ResetKvStream, SelectWorker
from kvrouter.actors.core.decide import decide
from kvrouter.actors.core.decisions import Accepted, Decision, Rejected
from kvrouter.actors.core.desk import ALONE, CONCLUDED, PREPARED, ScopeDesk, Surroundings
from kvrouter.actors.core.events import Event
from kvrouter.actors.core.evolve import fold
from kvrouter.actors.core.explain import explain_selection, finish
from kvrouter.actors.core.explanation import Explanation
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.kv_wire import named_blocks
from kvrouter.actors.core.pending import PendingSelections
from kvrouter.actors.core.selection_rules import Selection
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.core.waiting_room import WaitingRoom
from kvrouter.actors.decision_feed import UNEXPLAINED, DecisionFeed, DecisionRecord
from kvrouter.actors.mailbox import MAILBOX_SIZE, Batch, Envelope
from kvrouter.actors.persistence.codec import encode_record
from kvrouter.journal.store import Journal

# Commands taken from the mailbox per scheduling turn (a batch counts its commands, and is never split). Bounds
# how long one busy scope holds the loop before others (and the journal writer) get a turn.
MAX_TURN = 256
# KV-event blocks a turn takes (what its IngestKvBatch commands' batches name; a command is never split) before it
# yields. KV ingest hands runs of at most this many blocks over (actors/kv_ingest.py), so a turn is about one run,
# and it starts a run's decoding and its hand-over only when the loop is idle (actors/loop_idle.py): a request
# waits for at most the run being decoded or applied when it arrived, ~2 us of work per block. 512 halved that
# piece but cost ~25 % more CPU per ingested block (per-run hand-over, record, fsync); 256 cost 25-45 % of the
# ingest rate (README Benchmarks, the flood paragraphs).
MAX_TURN_KV_BLOCKS = 1024

# Commands carrying a worker's KV events (from its listener): their records are never acknowledged to a client, and
# a crash that loses them is repaired by the worker's replay (the reference keeps no index across a restart at all).
# So a read may show their effect before it is durable: the read barrier waits only for the other records
# (``last_write_lsn``), and a selection during a KV flood does not wait for the flood's fsyncs. Their records are
# journaled as rebuildable: found damaged at a restart, recovery skips them and the workers replay what they held
# (``actors/persistence/recovery.py``) instead of the service refusing to start.
WORKER_KV_COMMANDS = frozenset({IngestKvBatch, ResetKvStream})


@attrs.define
class LastWrite:
    """The LSN of the owner's last record that is not a worker's KV events (shared by its actors): the barrier
    of a read that may see any scope."""

    lsn: int = 0


# Called synchronously right after a decision's events are applied (replica publisher, directory, KV
# ingest): it must not block or await; whatever it needs to do later goes into its own bounded queue.
Observer = Callable[[ScopeState, Command, tuple[Event, ...]], None]

# What a journal that can no longer be written raises from append / wait_for_room.
JOURNAL_GONE = (trio.BrokenResourceError, trio.ClosedResourceError)


@attrs.frozen
class ActorPorts:
    journal: Journal
    observers: Sequence[Observer]  # the owner's live list: observers added later are seen at once
    after_turn: Callable[[], None]  # after each batch of commands (the owner's snapshot policy)
    retire: Callable[[ScopeActor], None]  # the scope dissolved and its mailbox is empty
    # What the owner knows of its other scopes (their weight toward limits.MAX_RANKS_PER_SERVICE, whether any
    # has a schedulable worker), read by the desk right before a command is decided, so the check and the fold
    # are one step; an owner of one scope leaves the default.
    surroundings: Surroundings = ALONE
    # Explained selections go here while someone reads them (GET /ws/decisions); None: never explained.
    decisions: DecisionFeed | None = None
    # Told (synchronously, must not block) when the scope's queue of waiting selections grew or shrank: its
    # pending counts changed without any event (the owner's live list, as ``observers``).
    queue_observers: Sequence[Callable[[ScopeKey], None]] = ()
    # Moved by every actor on each record of a client-facing command (see WORKER_KV_COMMANDS).
    last_write: LastWrite = attrs.Factory(LastWrite)


class ScopeActor:
    __slots__ = (
        "_changed",
        "_inbox",
        "_journal",
        "_last_at",
        "_ports",
        "desk",
        "last_write_lsn",
        "outbox",
        "peak_depth",
        "state",
    )

    def __init__(
        self,
        state: ScopeState,
        ports: ActorPorts,
        rng: random.Random,
        pending: PendingSelections,
        last_write_lsn: int = 0,
    ) -> None:
        self.state = state
        self._ports = ports
        self._journal = ports.journal
        self.outbox, self._inbox = trio.open_memory_channel[Envelope | Batch](MAILBOX_SIZE)
        # What the scope keeps beside its state (core/desk.py): ``rng`` is its own random source (selection
        # tie-breaks, softmax, generated reservation ids), seeded by the owner from its seed and the scope so that
        # a simulation replays exactly; the waiting room holds envelopes of selections waiting for a rank to stop
        # being busy (queueing on), asked again after a turn that changed the state.
        self.desk: ScopeDesk[Envelope] = ScopeDesk(state, rng, pending, WaitingRoom(_gone), ports.surroundings)
        # The LSN of this scope's last record other than a worker's KV events: a read of this scope is safe to
        # answer once it is durable (the per-scope read barrier; see WORKER_KV_COMMANDS). Starts at what the
        # owner says may be unseen.
        self.last_write_lsn = last_write_lsn
        self._changed = False
        # The latest time a command brought in: waiting selections are asked again at it (the core reads no clock).
        self._last_at = 0
        # The most commands ever waiting in the mailbox (for metrics): the depth is largest when a turn
        # starts, since a turn takes commands without awaiting, so it is what the turn took plus what it left.
        self.peak_depth = 0

    async def run(self) -> None:
        journal = self._journal
        inbox = self._inbox
        with inbox:
            while True:
                item = await inbox.receive()
                budget = MAX_TURN
                kv_budget = MAX_TURN_KV_BLOCKS
                while True:
                    if isinstance(item, Batch):
                        self._handle_batch(item)
                        budget -= len(item.commands)
                    else:
                        command = item.command
                        if type(command) is IngestKvBatch:
                            kv_budget -= item.kv_blocks or _ingest_blocks(command)
                        self._handle(item)
                        budget -= 1
                    if budget <= 0 or kv_budget <= 0:
                        break
                    try:
                        item = inbox.receive_nowait()
                    except trio.WouldBlock:
                        break
                taken = MAX_TURN - budget  # commands (a batch counts its own)
                if budget <= 0 or kv_budget <= 0:
                    taken += inbox.statistics().current_buffer_used  # a full turn: some are still waiting
                self._end_turn(taken)
                if not journal.has_room():
                    # Policy: block this scope until the disk catches up. A journal that failed meanwhile
                    # raises: the next appends fail and their envelopes say so; the owner stops the service.
                    with contextlib.suppress(*JOURNAL_GONE):
                        await journal.wait_for_room()
                if not self.state.exists and inbox.statistics().current_buffer_used == 0:
                    # Dissolved (a slot tracker's last worker left; a selection partition never
                    # dissolves once its block size is fixed) and nothing queued: retire atomically,
                    # before any await, so no sender can slip a command into a closed mailbox unseen.
                    self._ports.retire(self)
                    return

    def _end_turn(self, taken: int) -> None:
        """What follows every turn: the peak depth, the waiting selections a change may admit, the owner's hook."""
        if taken > self.peak_depth:
            self.peak_depth = taken
        if self._changed and len(self.desk.room):
            self._admit_waiting()
        self._ports.after_turn()

    def apply_now(self, envelope: Envelope) -> bool:
        """Take a worker's KV-ingest command as the actor's next turn would, but in the caller's task, when that
        turn would be this command alone and at once: the actor's task waits on an empty mailbox and the journal
        has room. Then nothing can come before it, and the turn is the same (decide, journal, fold, observers,
        settle, the turn's bookkeeping); KV ingest saves the hand-over to the actor's task and back (two task
        steps and their wake-ups per run). Returns False, having done nothing, otherwise: send it then.

        An ingest command never dissolves the scope, so there is no retirement to do here (the actor's own
        turns check that)."""
        assert type(envelope.command) is IngestKvBatch, "only a worker's KV events are applied in the caller's task"
        mailbox = self._inbox.statistics()
        if mailbox.current_buffer_used or mailbox.tasks_waiting_receive != 1 or not self._journal.has_room():
            return False
        self._handle(envelope)
        self._end_turn(1)
        return True

    def _handle(self, envelope: Envelope) -> None:
        """One command's turn: prepare (desk) -> decide, journal, fold, observers (``_apply``) -> the answer the
        desk gives (or the waiting room) -> settle."""
        asked = envelope.command
        if asked.at > self._last_at:
            self._last_at = asked.at
        kind = asked.__class__
        desk = self.desk
        command = desk.prepare(asked) if kind in PREPARED else asked
        if isinstance(command, Rejected):  # answered without being decided (a replay of nothing pending, ...)
            self._settle(envelope, command, 0)
            return
        explanation = self._explanation(command) if type(command) is SelectWorker else None
        try:
            decision, lsn = self._apply(command)
        except JOURNAL_GONE as exc:
            desk.unapplied(asked, command)
            self._fail(envelope, exc)
            return
        if kind not in CONCLUDED:
            self._settle(envelope, decision, lsn)
            return
        queued = len(desk.room)
        answer = desk.decided(asked, command, decision, None if envelope.abandoned else envelope)
        if len(desk.room) != queued:
            self._queue_changed()
        if answer is None:
            envelope.queued = True  # answered when a rank frees up (or the asker's deadline passes)
            return
        if explanation is not None and type(answer) is Accepted:
            answer = self._explained(command, answer, explanation)  # type: ignore[arg-type]
        self._settle(envelope, answer, lsn)

    def _handle_batch(self, batch: Batch) -> None:
        """Apply a batch's commands in order (as envelopes sent one after another would be), then wake its
        asker once, when the last record is durable. Each command still gets its own decision and record."""
        # ``_apply`` spelled out, its lookups taken once per batch (the streamed lifecycle's every command runs
        # this loop): the same steps in the same order.
        decisions, lsns = batch.decisions, batch.lsns
        state = self.state
        scope = state.scope
        ports = self._ports
        last_write = ports.last_write
        observers = ports.observers
        append = self._journal.append
        prepare = self.desk.prepare  # (of what a batch holds, it changes only a registration: its ranks elsewhere)
        last_at = self._last_at
        last = 0
        for command in batch.commands:
            if command.at > last_at:
                last_at = self._last_at = command.at
            if command.__class__ in PREPARED:
                prepared = prepare(command)
                assert not isinstance(prepared, Rejected), "a batch holds only commands that are decided"
                command = prepared
            decision = decide(state, command)
            lsn = 0
            if type(decision) is Accepted and decision.events:
                events = decision.events
                from_worker = type(command) in WORKER_KV_COMMANDS
                try:
                    lsn = append(encode_record(scope, events), from_worker)
                except JOURNAL_GONE as exc:
                    batch.failure = exc  # this command and the rest are not applied; the asker learns why
                    break
                last = lsn
                if not from_worker:
                    self.last_write_lsn = last_write.lsn = lsn
                fold(state, events)
                self._changed = True
                for observe in observers:
                    observe(state, command, events)
            decisions.append(decision)
            lsns.append(lsn or self._barrier(command))  # (ask_many waits for a barrier not yet durable)
        if last and batch.failure is None:
            self._journal.call_when_durable(last, batch.done.set)
        else:
            batch.done.set()

    def _admit_waiting(self) -> None:
        """Ask the core again for the waiting selections, in policy order, until one still finds every rank
        busy: the rest wait for the next change. Overlaps and loads are the current ones."""
        self._changed = False
        desk = self.desk
        queued = len(desk.room)
        for waiter in desk.waiting():
            envelope = waiter.ticket
            command = desk.readmitted(waiter, self._last_at)
            explanation = self._explanation(command)
            try:
                decision, lsn = self._apply(command)
            except JOURNAL_GONE as exc:
                desk.dropped(waiter)
                envelope.queued = False
                self._fail(envelope, exc)
                continue
            answer = desk.admitted(waiter, command, decision)
            if answer is None:
                break
            envelope.queued = False
            if explanation is not None and type(answer) is Accepted:
                answer = self._explained(command, answer, explanation)
            self._settle(envelope, answer, lsn)
        self._changed = False
        if len(desk.room) != queued:
            self._queue_changed()

    def _queue_changed(self) -> None:
        for notify in self._ports.queue_observers:
            notify(self.state.scope)

    def pending_loads(self) -> tuple[int, int]:
        """``(pending_count, pending_isl_tokens)`` of the scope's queue, as ``/loads`` shows them."""
        room = self.desk.room
        return len(room), room.isl_tokens

    def query(self, asked: SelectWorker) -> Decision:
        """A selection that books nothing, answered at once from the current state.

        Trio runs one task at a time, so this is atomic with respect to the mailbox: it sees every
        applied (and so every acknowledged) command. It draws from the same seeded source as queued
        selections, and remembers the choice for a later replayed reservation.
        """
        assert not asked.reserve, "bookings go through the mailbox and the journal"
        desk = self.desk
        command = desk.prepare(asked)
        if isinstance(command, Rejected):
            return command
        assert type(command) is SelectWorker
        explanation = self._explanation(command)
        decision = decide(self.state, command)
        assert not (isinstance(decision, Accepted) and decision.events), "a query must not change state"
        answer = desk.decided(asked, command, decision, None)
        assert answer is not None, "a query never waits in the room"
        if explanation is not None and type(answer) is Accepted:
            answer = self._explained(command, answer, explanation)
        return answer

    def _explanation(self, command: SelectWorker) -> Explanation | None:
        """Why this selection will choose what it chooses, taken before it is decided; only when asked for
        (the request's ``explain``, or a reader of the decision feed within its explanation budget: past it,
        ``UNEXPLAINED``): otherwise selections pay one attribute check."""
        if command.explain:
            return explain_selection(self.state, command)
        decisions = self._ports.decisions
        if decisions is not None and decisions.leased:
            return explain_selection(self.state, command) if decisions.take(self.state.scope) else UNEXPLAINED
        return None

    def _explained(self, command: SelectWorker, decision: Accepted, explanation: Explanation) -> Accepted:
        """Publish an accepted selection's explanation, and attach it to the reply if the request asked
        (``UNEXPLAINED``: only numbered, ``actors/decision_feed.py``)."""
        if explanation is UNEXPLAINED:
            decisions = self._ports.decisions
            assert decisions is not None
            decisions.skip()
            return decision
        selection: Selection = decision.reply
        finished = finish(explanation, WorkerRank(selection.worker_id, selection.dp_rank))
        decisions = self._ports.decisions
        if decisions is not None:
            decisions.count(finished)
            if decisions.wanted:
                record = DecisionRecord(
                    decisions.next_seq(),
                    command.at,
                    self.state.scope,
                    command.reserve,
                    command.selection_id,
                    selection.reservation_id,
                    selection.endpoint,
                    selection.overlap,
                    selection.effective_prefill_tokens,
                    selection.potential_decode_blocks,
                    finished,
                )
                decisions.publish(record)
        if command.explain:
            return attrs.evolve(decision, reply=attrs.evolve(selection, explanation=finished))
        return decision

    def _settle(self, envelope: Envelope, decision: Decision, lsn: int) -> None:
        """The requester wakes once the decision is durable (one wake-up, no polling). A decision that wrote
        nothing (a repeated free, "already exists") was made on state that may hold writes not yet durable: its
        requester waits for them too (``_barrier``), so it never acknowledges what a failed journal takes back."""
        envelope.settle(decision, lsn or self._barrier(envelope.command))
        if envelope.on_settled is not None:
            envelope.on_settled()
        if lsn and envelope.awaited:
            self._journal.call_when_durable(lsn, envelope.done.set)
        else:
            envelope.done.set()

    def _barrier(self, command: Command) -> int:
        """The LSN a decision that wrote nothing waits for: the scope's last write (a worker's KV events, whose
        records are never acknowledged to a client, wait for none)."""
        return 0 if type(command) in WORKER_KV_COMMANDS else self.last_write_lsn

    def _fail(self, envelope: Envelope, exc: BaseException) -> None:
        """The journal refused the events: nothing was applied; the requester learns why at once."""
        envelope.failure = exc
        if envelope.on_settled is not None:
            envelope.on_settled()
        envelope.done.set()

    def _apply(self, command: Command) -> tuple[Decision, int]:
        decision = decide(self.state, command)
        lsn = 0
        if isinstance(decision, Accepted) and decision.events:
            from_worker = type(command) in WORKER_KV_COMMANDS
            lsn = self._journal.append(encode_record(self.state.scope, decision.events), from_worker)
            if not from_worker:
                self.last_write_lsn = self._ports.last_write.lsn = lsn
            fold(self.state, decision.events)
            self._changed = True
            for observe in self._ports.observers:
                observe(self.state, command, decision.events)
        return decision, lsn

    def mailbox_statistics(self) -> trio.MemoryChannelStatistics:
        return self._inbox.statistics()


def _ingest_blocks(command: IngestKvBatch) -> int:
    """The blocks an ingest command's batches name: its share of a turn's ``MAX_TURN_KV_BLOCKS``."""
    return named_blocks(command.batch) + sum(named_blocks(batch) for _, batch in command.following)


def _gone(envelope: Envelope) -> bool:
    """Whether a waiting selection's asker has been answered already (its deadline passed) or left."""
    return envelope.timed_out or envelope.abandoned
