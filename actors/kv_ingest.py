"""KvIngest: one KvListener per catalog worker rank, feeding KV-event batches into scope actors.

It follows the catalog's events (it is an observer of the actor system): when a worker's record is
applied, listeners start for each of its ranks with a KV-events endpoint, resuming after the rank's
journaled watermark, and stop for ranks (or endpoints) it no longer has; when the worker is removed,
its listeners stop. At startup the recovered catalog is reconciled the same way. Nobody else starts or
stops listeners, so they always match the applied catalog.

Each listener holds a slot of the process's ``ListenerSlots`` (zmq sockets and file descriptors are
finite). ``admit`` reserves the slots a record needs *before* the record is journaled, so a registration
beyond capacity is refused instead of failing later, and a restart never needs more than was accepted.

Batches enter the actor's mailbox as commands, one command (one decision, one journal record) per run of the
group the listener hands over (what was queued on its socket: ``kv_listener.GROUP_MAX_BATCHES``): a run's
batches name at most ``INGEST_RUN_BLOCKS`` blocks between them (a larger batch goes alone) and store at most
``index_bounds.run_block_limit``. Each batch is decoded here first (a batch that cannot be read is logged and
skipped, never journaled). The listener then waits until the actor has applied that command before it goes on
(policy: block; zmq's high-water mark then pushes back on the publisher, and the gap is replayed later), so the
mailbox holds at most one run per listener: its memory is bounded by the listeners, not by the mailbox's length.
KV events do not wait for the journal's fsync: the watermark is journaled with the blocks, so a crash loses both
together and the restarted listener replays the same batches from the worker. Nobody waits for their durability at
all (``Envelope.awaited``), so under ``--durability always`` the journal holds a flood's records back a little and
writes several runs with one fsync (``FileJournal.UNAWAITED_HOLD_SECONDS``).

Latency under a flood. Trio runs every runnable task once per scheduling round, and an HTTP request needs
several rounds, so a request would wait for all the ingest work done in its rounds. Each piece of ingest work (a
run's decoding; its hand-over to the actor and the actor's turn that applies it) starts only when the loop has
nothing else to run (``loop_idle.when_loop_idle``, or after ``INGEST_WAITS_AT_MOST``), and the listeners take
turns at one piece at a time between them (``pieces``: a lock, FIFO, so no rank waits behind another's whole
flood), held from a run's decoding through its hand-over until the actor has applied it. So a request waits for at
most the ONE piece running when it arrived: a run of at most ``INGEST_RUN_BLOCKS`` blocks decoded, or applied, and
at most one decoded run waits for the actor. (Without the lock, one idle moment woke every listener waiting for it:
a run decoded and runs handed over in the same round, then applied together in the actor's next turn, up to
``actor.MAX_TURN_KV_BLOCKS`` and more.) Runs enter the actor through the system's one door for them
(``ActorSystem.apply_kv``), which, when the actor is idle (its mailbox empty), has the listener's task take the
actor's turn itself: no hand-over to the actor's task and back.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

import attrs
import trio

from kvrouter.actors.actor import MAX_TURN_KV_BLOCKS, Observer
from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.commands import Command, IngestKvBatch, ResetKvStream
from kvrouter.actors.core.events import Event, WorkerRemoved, WorkerUpserted
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.index_bounds import run_block_limit
from kvrouter.actors.core.kv_wire import KvBatch, WireError, decode_batch, named_blocks, stored_upper_bound
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.kv_listener import KvListener, ListenerStatus, OnBatches, OnRestart
from kvrouter.actors.loop_idle import when_loop_idle
from kvrouter.actors.system import ActorSystem
from kvrouter.actors.transport.socket_budget import ListenerCapacityError, ListenerSlots

log = logging.getLogger("kvrouter.kv_ingest")


@attrs.frozen
class ListenerKey:
    scope: ScopeKey
    rank: WorkerRank
    endpoint: str
    replay_endpoint: str | None


# The KV-events endpoint of a rank whose events the embedding process hands over itself
# (``Router.apply_kv_events``, api/embedded.py): a valid zmq endpoint (so the catalog takes it and the rank
# is schedulable), on which nothing listens.
IN_PROCESS_KV_EVENTS = "inproc://kvrouter.apply_kv_events"


def listener_keys(scope: ScopeKey, record: WorkerRecord) -> list[ListenerKey]:
    """The listeners ``record`` asks for: one per rank with a KV-events endpoint (other than in-process)."""
    keys = []
    for rank in record.ranks:
        endpoint = record.kv_events_endpoint_for(rank.dp_rank)
        if endpoint and endpoint != IN_PROCESS_KV_EVENTS:
            keys.append(ListenerKey(scope, rank, endpoint, record.replay_endpoint_for(rank.dp_rank)))
    return keys


class Running:
    """One listener: its cancel scope (None if it never started: no slot) and its status."""

    __slots__ = ("cancel_scope", "status")

    def __init__(self, cancel_scope: trio.CancelScope | None, status: ListenerStatus) -> None:
        self.cancel_scope = cancel_scope
        self.status = status


# Blocks (named by the batches' stores and removals) of one ingest command: the actor's per-turn bound, so a
# turn is one run and a run's decoding one listener's step.
INGEST_RUN_BLOCKS = MAX_TURN_KV_BLOCKS
# A run is decoded, and handed to the actor, once the loop has nothing else to run (requests first,
# actors/loop_idle.py) or after waiting this long: a loop that never idles still ingests a run per 10 ms at least.
INGEST_WAITS_AT_MOST = 0.005


class KvIngest:
    def __init__(self, system: ActorSystem, slots: ListenerSlots | None = None) -> None:
        self._system = system
        # Held while a run is decoded and then handed over, until the actor has applied it: two pieces of ingest
        # work, each started when the loop is idle. One piece at a time between the listeners (FIFO, so no rank
        # waits behind another's whole flood), so a request never waits for two (see the module doc).
        self.pieces = trio.Lock()
        self.slots = slots if slots is not None else ListenerSlots.for_this_process()
        self._nursery: trio.Nursery | None = None
        self._running: dict[int, dict[ListenerKey, Running]] = {}  # by worker id
        # Derived from _running (dropped by _start and _stop, which change it): each (worker id, dp rank)'s
        # listener status, for ``connected``, which every selection asks of every rank.
        self._statuses: dict[tuple[int, int], ListenerStatus] | None = None
        self.observe: Observer = self._observe

    async def run(self, *, task_status: trio.TaskStatus[KvIngest] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            # Reconcile with the recovered catalog and subscribe to its changes in one synchronous step,
            # so no catalog event falls between the two.
            for state in self._system.states():
                for record in state.selection.catalog.values():
                    self._worker_applied(state, record)
            self._system.observers.append(self.observe)
            try:
                task_status.started(self)
                await trio.sleep_forever()
            finally:
                if self.observe in self._system.observers:
                    self._system.observers.remove(self.observe)

    # -- admission (before journaling) -------------------------------------------------------------

    def admit(self, record: WorkerRecord) -> list[Hashable]:
        """Reserve the listener slots ``record`` needs beyond those its worker already holds; raises
        ListenerCapacityError (changing nothing) if they do not fit. Returns what was newly reserved:
        ``release`` it if the record is then not applied. Once applied, the listeners own the slots."""
        return self.slots.reserve(key.rank for key in listener_keys(record.scope, record))

    def release(self, reserved: list[Hashable]) -> None:
        held = {key.rank for listeners in self._running.values() for key, run in listeners.items() if run.cancel_scope}
        self.slots.release(k for k in reserved if k not in held)

    # -- reads -------------------------------------------------------------------------------------

    def status(self, worker_id: int) -> dict[str, dict[str, object]]:
        """Listener state per dp rank of ``worker_id``, for ``GET /workers``."""
        listeners = self._running.get(worker_id)
        if not listeners:
            return {}
        return {
            str(key.rank.dp_rank): attrs.asdict(running.status)
            for key, running in sorted(listeners.items(), key=lambda item: item[0].rank)
        }

    def connected(self, worker_id: int, dp_rank: int) -> bool | None:
        """Whether the rank's listener is connected now; None when the rank has no listener."""
        statuses = self._statuses
        if statuses is None:
            statuses = self._statuses = self._statuses_by_rank()
        status = statuses.get((worker_id, dp_rank))
        return None if status is None else status.state == "active"

    def all_connected(self) -> bool:
        """Whether every rank's listener is connected now (``connected`` is True for each rank that has one)."""
        statuses = self._statuses
        if statuses is None:
            statuses = self._statuses = self._statuses_by_rank()
        for status in statuses.values():  # noqa: SIM110 - a plain loop: all() over a generator costs twice as much
            if status.state != "active":
                return False
        return True

    def listening(self) -> list[tuple[int, int]]:
        """The (worker id, dp rank) of every rank with a listener."""
        statuses = self._statuses
        if statuses is None:
            statuses = self._statuses = self._statuses_by_rank()
        return list(statuses)

    def _statuses_by_rank(self) -> dict[tuple[int, int], ListenerStatus]:
        """The status of each rank's listener (its first, should a rank have two for a moment)."""
        found: dict[tuple[int, int], ListenerStatus] = {}
        for worker_id, listeners in self._running.items():
            for key, running in listeners.items():
                found.setdefault((worker_id, key.rank.dp_rank), running.status)
        return found

    def listener_statuses(self) -> list[tuple[WorkerRank, ListenerStatus]]:
        """Every listener's rank and status (for metrics), sorted by rank."""
        rows = [(key.rank, run.status) for listeners in self._running.values() for key, run in listeners.items()]
        return sorted(rows, key=lambda row: row[0])

    @property
    def listeners(self) -> int:
        return sum(len(listeners) for listeners in self._running.values())

    # -- following the catalog ---------------------------------------------------------------------

    def _observe(self, state: ScopeState, command: Command, events: tuple[Event, ...]) -> None:
        for event in events:
            kind = type(event)
            if kind is WorkerUpserted:
                self._worker_applied(state, event.record)  # type: ignore[union-attr]
            elif kind is WorkerRemoved:
                self._worker_gone(state.scope, event.worker_id)  # type: ignore[union-attr]

    def _worker_applied(self, state: ScopeState, record: WorkerRecord) -> None:
        """Start the listeners ``record`` asks for in its scope, stop the others. Synchronous, so atomic."""
        scope = state.scope
        wanted = listener_keys(scope, record)
        listeners = self._running.setdefault(record.worker_id, {})
        for key in [k for k in listeners if k.scope == scope and k not in wanted]:
            self._stop(record.worker_id, key)
        for key in wanted:
            running = listeners.get(key)
            if running is None or running.cancel_scope is None:  # new, or refused a slot before: try again
                self._start(key, state.selection.kv_watermarks.get(key.rank))
        if not listeners:
            del self._running[record.worker_id]

    def _worker_gone(self, scope: ScopeKey, worker_id: int) -> None:
        for key in [k for k in self._running.get(worker_id, {}) if k.scope == scope]:
            self._stop(worker_id, key)
        if not self._running.get(worker_id, True):
            del self._running[worker_id]

    def _start(self, key: ListenerKey, watermark: int | None) -> None:
        assert self._nursery is not None, "KvIngest.run has not started"
        self._statuses = None
        listeners = self._running.setdefault(key.rank.worker_id, {})
        try:
            self.slots.reserve([key.rank])  # a no-op when admitted; at startup the limit may have shrunk
        except ListenerCapacityError as exc:
            status = ListenerStatus(key.endpoint, key.replay_endpoint, state="failed", last_error=str(exc))
            listeners[key] = Running(None, status)
            log.warning("worker %d dp_rank %d: no KV listener: %s", *key.rank, exc)
            return
        listener = KvListener(
            key.endpoint,
            key.replay_endpoint,
            self.consumer(key),
            resume_from=watermark,
            on_restart=self._on_restart(key),
        )
        cancel_scope = trio.CancelScope()
        listeners[key] = Running(cancel_scope, listener.status)
        self._nursery.start_soon(self._run_listener, listener, cancel_scope)

    def _stop(self, worker_id: int, key: ListenerKey) -> None:
        self._statuses = None
        running = self._running[worker_id].pop(key)
        if running.cancel_scope is None:
            return  # never started: it held no slot
        running.cancel_scope.cancel()
        if not any(other.rank == key.rank for other in self._running[worker_id]):
            self.slots.release([key.rank])

    async def _run_listener(self, listener: KvListener, cancel_scope: trio.CancelScope) -> None:
        with cancel_scope:
            await listener.run()

    def consumer(self, key: ListenerKey) -> OnBatches:
        """What the listener of ``key`` hands its groups to: they are decoded and applied run by run, in order."""
        cap = self._system.max_index_blocks_per_scope
        stored_limit = run_block_limit(cap)

        async def on_batches(group: list[tuple[int, bytes]]) -> None:
            position = 0
            carried: tuple[int, KvBatch] | None = None  # decoded, but over the previous run's bound
            while position < len(group) or carried is not None:
                run: list[tuple[int, KvBatch]] = []
                named = stored = 0
                async with self.pieces:
                    await when_loop_idle(INGEST_WAITS_AT_MOST)
                    if carried is not None:
                        run.append(carried)
                        named, stored = named_blocks(carried[1]), stored_upper_bound(carried[1])
                        carried = None
                    while position < len(group):
                        seq, payload = group[position]
                        position += 1
                        try:
                            batch = decode_batch(payload)
                        except WireError as exc:
                            log.warning("worker %d dp_rank %d: batch %d skipped: %s", *key.rank, seq, exc)
                            continue
                        batch_named, batch_stored = named_blocks(batch), stored_upper_bound(batch)
                        if run and (named + batch_named > INGEST_RUN_BLOCKS or stored + batch_stored > stored_limit):
                            carried = (seq, batch)
                            break
                        run.append((seq, batch))
                        named += batch_named
                        stored += batch_stored
                    if run:
                        await self._apply(key, run, cap, named)

        return on_batches

    async def _apply(self, key: ListenerKey, run: list[tuple[int, KvBatch]], cap: int, named: int) -> None:
        """Hand the run over as one command and wait until the actor has applied it (not until it is durable: see
        the module doc); ``ActorSystem.apply_kv`` drops it if the scope is gone (its worker left). Called holding
        ``pieces``, so the actor's turn that applies the run is the one piece of ingest work running, and at most
        one decoded run waits between all the listeners. ``named``: the blocks the run's batches name (the
        actor's turn budget)."""
        (seq, batch), *following = run
        command = IngestKvBatch(
            key.rank.worker_id,
            key.rank.dp_rank,
            seq,
            batch,
            at=self._system.clock.now_ns(),
            max_index_blocks=cap,
            following=tuple(following),
        )
        await when_loop_idle(INGEST_WAITS_AT_MOST)  # the actor applies it in its next turn: requests first
        await self._system.apply_kv(key.scope, command, named)

    def _on_restart(self, key: ListenerKey) -> OnRestart:
        system = self._system

        async def on_restart() -> None:
            log.info("worker %d dp_rank %d: publisher restarted; dropping its blocks", *key.rank)
            await system.submit(key.scope, ResetKvStream(key.rank.worker_id, key.rank.dp_rank))

        return on_restart
