"""One kvrouter replica inside a simulation: the selection service on an in-memory journal.

Client calls go through ``SelectService``, the service object the HTTP routes call (``api/routes/selection.py``
is a thin layer of handlers over it), so a simulated ``/select_and_reserve`` is the route's code path minus
HTTP parsing. KV-event batches enter as the KV listener hands them over (``IngestKvBatch`` into the scope's
mailbox, ``ResetKvStream`` on a publisher restart). Time comes from trio's clock, which only the cluster
driver moves, so every command's ``at`` is a function of the trace.

A crash drops the live actors and what they held in memory; ``restart`` recovers a new system from
whatever the journal holds, as a restarted process would.
"""

from __future__ import annotations

import trio

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.commands import ExpireStale, IngestKvBatch, Prompt, ResetKvStream, SelectionOptions
from kvrouter.actors.core.decisions import Rejected
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.kv_wire import KvBatch
from kvrouter.actors.core.queries import RankLoad
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.selection_rules import Selection
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.persistence.recovery import recover
from kvrouter.actors.ports import TrioClock
from kvrouter.actors.select_service import SelectionRequest, SelectService
from kvrouter.actors.service_support import Refused
from kvrouter.actors.system import EXPIRY_AGE_NS, ActorSystem
from kvrouter.actors.ttft_tracker import FULL, Ablation
from kvrouter.journal.memory import MemoryJournal
from kvrouter.simulations.replication import SimReplicator

NEVER = 1e12  # seconds: the system's own timers stay quiet; the driver issues expiry sweeps itself


class RouterRefused(Exception):
    """The router refused a call the simulated client expected to succeed (a bug or an invariant breach)."""


class RouterReplica:
    def __init__(
        self,
        name: str,
        scope: ScopeKey,
        config: RouterConfig,
        seed: str,
        clock: TrioClock,
        replica_id: int | None = None,
        ttft_ablation: Ablation = FULL,
    ) -> None:
        self.name = name
        self.ttft_ablation = ttft_ablation
        self.replica_id = replica_id  # replica-sync router id; None: no replica sync
        self.scope = scope
        self.config = config
        self.seed = seed
        self.clock = clock
        self.journal = MemoryJournal()
        self.system: ActorSystem | None = None
        self.service: SelectService | None = None
        self._cancel: trio.CancelScope | None = None
        self.replicator: SimReplicator | None = None
        self.restarts = 0

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self, nursery: trio.Nursery, states: dict[ScopeKey, ScopeState] | None = None) -> None:
        self._cancel = trio.CancelScope()
        system, service = await nursery.start(self._run, states or {})
        self.system, self.service = system, service
        if self.replica_id is not None:
            self.replicator = SimReplicator(system, self.replica_id)

    async def _run(
        self,
        states: dict[ScopeKey, ScopeState],
        *,
        task_status: trio.TaskStatus[tuple[ActorSystem, SelectService]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        assert self._cancel is not None
        with self._cancel:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.journal.run)
                system = ActorSystem(
                    self.journal,
                    self.clock,
                    states,
                    # No background snapshots or sweeps: their timing would depend on the scheduler.
                    snapshot_every_records=1 << 62,
                    snapshot_every_bytes=1 << 62,
                    expiry_sweep_seconds=NEVER,
                    encode_snapshots_in_thread=False,
                    seed=self.seed,
                )
                await nursery.start(system.run)
                service: SelectService = await nursery.start(
                    SelectService(system, self.config, ttft_ablation=self.ttft_ablation).run
                )
                task_status.started((system, service))

    async def crash(self) -> None:
        """Stop the replica now; what was not journaled is lost."""
        assert self._cancel is not None
        self._cancel.cancel()
        self.system = None
        self.service = None
        self.replicator = None  # its unsent messages die with it
        self.journal = self.journal.crash_copy()
        await trio.lowlevel.checkpoint()

    async def restart(self, nursery: trio.Nursery) -> None:
        """Recover from the journal alone, as a restarted process would."""
        self.restarts += 1
        await self.start(nursery, recover(self.journal).states)

    @property
    def running(self) -> bool:
        return self.system is not None

    def _system(self) -> ActorSystem:
        if self.system is None:
            raise RouterRefused(f"router {self.name} is down")
        return self.system

    def _service(self) -> SelectService:
        if self.service is None:
            raise RouterRefused(f"router {self.name} is down")
        return self.service

    # -- the selection service's calls (what the HTTP routes call) --------------------------------

    async def upsert_worker(self, record: WorkerRecord) -> None:
        """``POST /workers``."""
        with _refusals():
            status = await self._service().put_worker(record)
        if not status.schedulable:
            raise RouterRefused(f"worker {record.worker_id} is not schedulable: {'; '.join(status.reasons)}")

    async def select_and_reserve(
        self,
        prompt: Prompt,
        reservation_id: str,
        options: SelectionOptions | None = None,
        router_mode: str | None = None,
    ) -> Selection:
        """``POST /select_and_reserve`` (``router_mode`` None: the service's)."""
        request = SelectionRequest(
            self.scope,
            prompt,
            options or SelectionOptions(),
            reservation_id=reservation_id,
            router_mode=router_mode,
        )
        with _refusals():
            return await self._service().select_and_reserve(request)

    async def reserve(
        self, reservation_id: str, worker_id: int, dp_rank: int, sequence_hashes: tuple[int, ...], isl_tokens: int
    ) -> None:
        """``POST /reservations`` with an explicit rank (the client chose the worker itself)."""
        with _refusals():
            await self._service().reserve(self.scope, reservation_id, worker_id, dp_rank, sequence_hashes, isl_tokens)

    async def prefill_complete(self, reservation_id: str, cached_tokens: int | None = None) -> None:
        """``POST /reservations/{id}/prefill_complete``, with the prompt tokens the worker found cached."""
        with _refusals():
            await self._service().complete_prefill(reservation_id, cached_tokens)

    async def release(self, reservation_id: str) -> None:
        """``DELETE /reservations/{id}``."""
        with _refusals():
            await self._service().release(reservation_id)

    async def loads(self) -> list[RankLoad]:
        """``GET /loads`` of the simulated partition."""
        with _refusals():
            partitions = await self._service().loads()
        return next((p.loads for p in partitions if p.scope == self.scope), [])

    async def ingest(self, worker_id: int, dp_rank: int, seq: int, batch: KvBatch) -> None:
        """A KV-event batch from a worker rank's stream, as the KV listener hands it to the actor."""
        system = self._system()
        await system.submit(self.scope, IngestKvBatch(worker_id, dp_rank, seq, batch, at=self.clock.now_ns()))

    async def reset_kv_stream(self, worker_id: int, dp_rank: int) -> None:
        """What the KV listener sends when a worker's publisher restarts (its sequence went back)."""
        await self._system().submit(self.scope, ResetKvStream(worker_id, dp_rank, at=self.clock.now_ns()))

    async def expire_stale(self) -> None:
        """The stale-request sweep the system runs every 30 s in production (here the driver runs it)."""
        decision = await self._system().ask(self.scope, ExpireStale(EXPIRY_AGE_NS, at=self.clock.now_ns()))
        if isinstance(decision, Rejected):
            raise RouterRefused(f"ExpireStale: {decision.message}")

    def state(self) -> ScopeState | None:
        return self._system().state(self.scope)

    def states(self) -> list[ScopeState]:
        return self._system().states()


class _refusals:
    """A service refusal becomes ``RouterRefused`` (the simulated client's view of a 4xx/5xx answer)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, Refused):
            raise RouterRefused(exc.message) from exc
