"""CatalogWriter: the one owner of the selection service's worker catalog writes.

A worker id is service-wide, but its record lives in the actor of the scope it names, so a write may
touch two scopes (a record naming another (model, tenant) moves the worker: remove, then upsert). Done
by each request on its own, two concurrent writes for one worker could both find it nowhere and leave
it in two scopes. Here every catalog write is a job in one bounded queue, performed by one task from
start to finish: the next job sees what the previous one applied (via the directory), and a requester
that gives up (reply deadline, client gone) never leaves a move half done.

The task waits only until each step is *applied*; the requester then waits for the last step's LSN to
be durable (the journal is a prefix: the removal, appended first, is durable by then too), so
registrations still share fsyncs. Removal comes before the upsert: a crash between them loses the
worker (the client got no answer), never leaves it in both scopes.

A discovered worker (``WorkerRecord.discovered_by``) belongs to its discovery source: only a change from that
source may replace, patch or remove it, and a source never takes over a worker registered over HTTP
(``ownership_conflict``, a 409 naming discovery). The writer checks it, being the catalog's only writer.

Listener slots are reserved before the record is journaled (``KvIngest.admit``) and given back if it is
not applied; the ingest then follows the applied events.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

import attrs
import trio

from kvrouter.actors.core.catalog import WorkerPatch, WorkerRecord, ownership_conflict
from kvrouter.actors.core.commands import RemoveWorker, UpsertWorker
from kvrouter.actors.core.decisions import Reason
from kvrouter.actors.core.selection_rules import upsert_refusal
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.core.worker_endpoints import EndpointAllowList
from kvrouter.actors.directory import Directory
from kvrouter.actors.kv_ingest import KvIngest
from kvrouter.actors.mailbox import ENQUEUE_TIMEOUT, Overloaded
from kvrouter.actors.service_support import Refused, accepted
from kvrouter.actors.system import ActorSystem
from kvrouter.actors.transport.socket_budget import ListenerCapacityError

log = logging.getLogger("kvrouter.catalog")

# Catalog writes waiting for the writer (policy: the requester waits up to ENQUEUE_TIMEOUT, then 503).
QUEUE_SIZE = 1024


@attrs.frozen
class PutWorker:
    """Create or replace a worker's record (moving it if the record names another scope)."""

    record: WorkerRecord


@attrs.frozen
class PatchWorker:
    """Replace some fields of a worker's record (applied to the record as it is when the writer gets to it;
    a patched record the catalog refuses is a 400 and changes nothing)."""

    worker_id: int
    patch: WorkerPatch


@attrs.frozen
class DeleteWorker:
    worker_id: int
    discovered_by: str | None = None  # the discovery source removing it; None: an HTTP client


CatalogChange = PutWorker | PatchWorker | DeleteWorker


class CatalogJob:
    __slots__ = ("change", "deadline", "done", "error", "lsn", "record", "timed_out")

    def __init__(self, change: CatalogChange) -> None:
        self.change = change
        self.done = trio.Event()  # set once the result is durable, or the job failed
        self.record: WorkerRecord | None = None  # stored (put, patch) or removed (delete)
        self.lsn = 0
        self.error: Exception | None = None
        self.deadline = 0.0
        self.timed_out = False


def worker_not_found(worker_id: int) -> Refused:
    return Refused(Reason.NOT_FOUND, f"worker {worker_id} not found")


class CatalogWriter:
    def __init__(
        self,
        system: ActorSystem,
        directory: Directory,
        ingest: KvIngest | None,
        *,
        use_kv_events: bool,
        endpoint_allow: EndpointAllowList | None = None,
    ) -> None:
        self._system = system
        self._directory = directory
        self._ingest = ingest
        self._use_kv_events = use_kv_events
        self._endpoint_allow = endpoint_allow
        self._send, self._receive = trio.open_memory_channel[CatalogJob](QUEUE_SIZE)

    async def run(self, *, task_status: trio.TaskStatus[CatalogWriter] = trio.TASK_STATUS_IGNORED) -> None:
        journal = self._system.journal
        async with self._receive:
            task_status.started(self)
            async for job in self._receive:
                try:
                    job.record, job.lsn = await self._perform(job.change)
                except Exception as exc:
                    job.error = exc
                if job.error is not None and journal.last_lsn > journal.durable_lsn:
                    # A refusal made on records not yet durable (a 404 after a removal, a 409): it waits for them,
                    # so it never answers from a write that a failed journal takes back.
                    job.lsn = journal.last_lsn
                if job.lsn:
                    journal.call_when_durable(job.lsn, job.done.set)
                else:
                    job.done.set()

    async def write(self, change: CatalogChange) -> WorkerRecord:
        """Queue ``change`` and return the record stored (or removed) once that is durable.

        Raises Refused, Overloaded, ReplyTimeout or JournalUnavailable.
        """
        system = self._system
        job = CatalogJob(change)
        try:
            self._send.send_nowait(job)
        except trio.WouldBlock:
            with trio.move_on_after(ENQUEUE_TIMEOUT) as waited:
                await self._send.send(job)
            if waited.cancelled_caught:
                raise Overloaded("too many catalog writes are queued") from None
        system.deadlines.track(job)
        await job.done.wait()
        if job.timed_out:
            raise system.reply_timeout(f"a catalog write ({type(change).__name__})")
        if job.lsn > system.journal.durable_lsn:
            await system.wait_durable(job.lsn)  # only after a journal failure: raises
        if job.error is not None:
            raise job.error
        assert job.record is not None
        return job.record

    # -- the writer task -------------------------------------------------------------------------------

    async def _perform(self, change: CatalogChange) -> tuple[WorkerRecord, int]:
        if isinstance(change, PutWorker):
            self._check_owner(change.record.worker_id, change.record.discovered_by)
            return await self._put(change.record)
        if isinstance(change, PatchWorker):
            self._check_owner(change.worker_id, None)
            patched = change.patch.apply(self._current(change.worker_id))
            if isinstance(patched, str):
                raise Refused(Reason.INVALID, patched)
            return await self._put(patched)
        self._check_owner(change.worker_id, change.discovered_by)
        return await self._delete(change.worker_id)

    def _check_owner(self, worker_id: int, writer: str | None) -> None:
        """409 when ``writer`` (a discovery source, None for HTTP) does not own the worker's current record."""
        try:
            current: WorkerRecord | None = self._current(worker_id)
        except Refused:
            current = None
        conflict = ownership_conflict(current, writer)
        if conflict is not None:
            raise Refused(Reason.CONFLICT, conflict)

    def _current(self, worker_id: int) -> WorkerRecord:
        scope = self._directory.worker_scope(worker_id)
        state = self._system.state(scope) if scope is not None else None
        if state is None or worker_id not in state.selection.catalog:
            raise worker_not_found(worker_id)
        return state.selection.catalog[worker_id]

    def _ranks_elsewhere_after_move(self, record: WorkerRecord) -> int:
        """The other scopes' weight toward the service's rank limit once the worker has left them."""
        elsewhere = self._system.ranks_elsewhere(record.scope)
        for scope in self._directory.worker_scopes(record.worker_id):
            old = self._system.state(scope) if scope != record.scope else None
            previous = old.selection.catalog.get(record.worker_id) if old is not None else None
            if previous is not None:
                elsewhere -= max(1, previous.dp_size)
        return elsewhere

    async def _put(self, record: WorkerRecord) -> tuple[WorkerRecord, int]:
        system = self._system
        # The upsert checks this too, but only after a move has removed the worker from its old scope:
        # check first, so a refused move leaves it where it was (this task is the catalog's only writer).
        state = system.state(record.scope) or ScopeState(record.scope)
        refusal = upsert_refusal(state, record, self._ranks_elsewhere_after_move(record), self._endpoint_allow)
        if refusal is not None:
            raise Refused.because(refusal)
        reserved: list[Hashable] = []
        if self._ingest is not None:
            try:
                reserved = self._ingest.admit(record)
            except ListenerCapacityError as exc:
                raise Refused(Reason.CONFLICT, f"worker {record.worker_id} not registered: {exc}") from None
        previous = self._stored(record.worker_id)
        try:
            lsn = 0
            for scope in self._directory.worker_scopes(record.worker_id):
                if scope != record.scope:  # worker_id is service-wide: leave the other scope first
                    decision, lsn = await system.apply(scope, RemoveWorker(record.worker_id, at=system.clock.now_ns()))
                    accepted(decision)
            command = UpsertWorker(
                record, self._use_kv_events, at=system.clock.now_ns(), endpoint_allow=self._endpoint_allow
            )
            decision, upserted = await system.apply(record.scope, command)
            accepted(decision)
        except BaseException:
            if self._ingest is not None:
                self._ingest.release(reserved)
            raise
        if previous is not None and previous.endpoint and previous.endpoint != record.endpoint:
            # Where this worker's prompts now go: worth an operator's eye (a re-registration by someone else
            # would send them all elsewhere).
            log.warning(
                "worker %d (%s): endpoint re-pointed %s -> %s",
                record.worker_id,
                record.scope.describe(),
                previous.endpoint,
                record.endpoint or "(none)",
            )
        return record, upserted or lsn

    def _stored(self, worker_id: int) -> WorkerRecord | None:
        try:
            return self._current(worker_id)
        except Refused:
            return None

    async def _delete(self, worker_id: int) -> tuple[WorkerRecord, int]:
        system = self._system
        record = self._current(worker_id)
        lsn = 0
        for scope in self._directory.worker_scopes(worker_id):
            decision, lsn = await system.apply(scope, RemoveWorker(worker_id, at=system.clock.now_ns()))
            accepted(decision)
        return record, lsn
