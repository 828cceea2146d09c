"""KvIngest: one KvListener per catalog worker rank, feeding KV-event batches into scope actors.

Reconciled from the catalog after every catalog change (and at startup from the recovered one):
a listener starts for each rank that has a KV-events endpoint, resumes after the rank's journaled
watermark, and stops when the rank or its endpoint goes away. Batches enter the actor's mailbox
as commands; the listener waits while the mailbox is full (policy: block; zmq's high-water mark
then pushes back on the publisher, and the gap is replayed later).

KV events do not wait for the journal's fsync: the watermark is journaled with the blocks, so a
crash loses both together and the restarted listener replays the same batches from the worker.
"""

from __future__ import annotations

import logging

import attrs
import trio

from kvrouter.actors.core.commands import IngestKvBatch, ResetKvStream
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.kv_wire import WireError, decode_batch
from kvrouter.actors.kv_listener import KvListener, ListenerStatus, OnBatch, OnRestart
from kvrouter.actors.system import ActorSystem

log = logging.getLogger("kvrouter.kv_ingest")


@attrs.frozen
class ListenerKey:
    scope: ScopeKey
    rank: WorkerRank
    endpoint: str
    replay_endpoint: str | None


class KvIngest:
    def __init__(self, system: ActorSystem) -> None:
        self._system = system
        self._nursery: trio.Nursery | None = None
        self._running: dict[ListenerKey, tuple[trio.CancelScope, ListenerStatus]] = {}

    async def run(self, *, task_status: trio.TaskStatus[KvIngest] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.reconcile()
            task_status.started(self)
            await trio.sleep_forever()

    def status(self, worker_id: int) -> dict[str, dict[str, object]]:
        """Listener state per dp rank of ``worker_id``, for ``GET /workers``."""
        return {
            str(key.rank.dp_rank): attrs.asdict(status)
            for key, (_, status) in sorted(self._running.items(), key=lambda item: item[0].rank)
            if key.rank.worker_id == worker_id
        }

    def reconcile(self) -> None:
        """Start the listeners the catalog asks for, stop the others. Synchronous, so atomic."""
        assert self._nursery is not None, "KvIngest.run has not started"
        wanted: set[ListenerKey] = set()
        for state in self._system.states():
            for record in state.catalog.values():
                for rank in record.ranks:
                    endpoint = record.kv_events_endpoint_for(rank.dp_rank)
                    if endpoint:
                        wanted.add(ListenerKey(state.scope, rank, endpoint, record.replay_endpoint_for(rank.dp_rank)))
        for key in [k for k in self._running if k not in wanted]:
            cancel_scope, _ = self._running.pop(key)
            cancel_scope.cancel()
        for key in sorted(wanted - set(self._running), key=lambda k: (k.scope, k.rank)):
            scope_state = self._system.state(key.scope)
            watermark = scope_state.kv_watermarks.get(key.rank) if scope_state is not None else None
            listener = KvListener(
                key.endpoint,
                key.replay_endpoint,
                self._on_batch(key),
                resume_from=watermark,
                on_restart=self._on_restart(key),
            )
            cancel_scope = trio.CancelScope()
            self._running[key] = (cancel_scope, listener.status)
            self._nursery.start_soon(self._run_listener, listener, cancel_scope)

    async def _run_listener(self, listener: KvListener, cancel_scope: trio.CancelScope) -> None:
        with cancel_scope:
            await listener.run()

    def _on_batch(self, key: ListenerKey) -> OnBatch:
        system = self._system
        clock = system.clock

        async def on_batch(seq: int, payload: bytes) -> None:
            try:
                batch = decode_batch(payload)
            except WireError as exc:
                log.warning("worker %d dp_rank %d: batch %d skipped: %s", *key.rank, seq, exc)
                return
            command = IngestKvBatch(key.rank.worker_id, key.rank.dp_rank, seq, batch, at=clock.now_ns())
            await system.submit(key.scope, command)

        return on_batch

    def _on_restart(self, key: ListenerKey) -> OnRestart:
        system = self._system

        async def on_restart() -> None:
            log.info("worker %d dp_rank %d: publisher restarted; dropping its blocks", *key.rank)
            await system.submit(key.scope, ResetKvStream(key.rank.worker_id, key.rank.dp_rank))

        return on_restart
