"""The simulated cluster: clients replaying a trace, workers running forward passes, kvrouter routing.

One task drives everything from a heap of timed events (arrivals, pass starts and ends, KV-event and
replica-sync deliveries, expiry sweeps, faults) and moves trio's MockClock to each event's time before
acting on it, so the routers' actors stamp every command with virtual time. The driver waits for each
router reply before the next event, so every mailbox's order, and so every journal, is a pure function
of the trace, the options and the seed. Events at the same time run in a fixed order: pass ends, KV
deliveries, replica messages, arrivals, pass starts (a request arriving at a pass boundary joins that
pass), faults; each kind in the order it was scheduled.

Each request follows the selection service's lifecycle: booked on arrival (``select_and_reserve`` for
the kv policy, an explicit reservation otherwise), ``prefill_complete`` when its first token comes
out, released when its last one does. Workers publish a pass's KV events when the pass ends (as the
reference's mocker does, and vLLM since its scheduler takes them after the forward pass rather than at
scheduling), to every router replica through the command the KV listener sends; a per-(replica, rank)
listener model notices sequence gaps and fetches the missing batches from the worker's bounded replay
buffer, as the real listener does.
Faults (``faults.py``) and invariant checks (``checkers.py``) hook in here.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Callable
from typing import Any

import attrs
import trio
import trio.testing

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.kv_wire import BlockRemoved, KvBatch, KvEvent, decode_batch, encode_batch
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.ports import TrioClock
from kvrouter.actors.system import EXPIRY_AGE_NS
from kvrouter.simulations.checkers import (
    idle_load_problems,
    invariant_failures,
    journal_digest,
    load_failures,
    replay_mismatch,
    replicas_disagree,
)
from kvrouter.simulations.engine import EngineRequest, PassResult, WorkerEngine
from kvrouter.simulations.faults import (
    NO_FAULTS,
    CacheReset,
    FaultPlan,
    KvLoss,
    KvNoRemovals,
    RouterCrash,
    TimedFault,
    WorkerCrash,
)
from kvrouter.simulations.policies import make_policy, ttft_ablation
from kvrouter.simulations.prompts import PromptHasher
from kvrouter.simulations.router import RouterRefused, RouterReplica
from kvrouter.simulations.timing import EngineParams
from kvrouter.simulations.trace import Trace

# Event kinds double as the tie-break order at equal times.
PASS_END, DELIVER, SYNC, ARRIVAL, PASS_START, SWEEP, FAULT, RESTART = range(8)
SWEEP_EVERY_MS = 30_000.0  # as the service's expiry sweep
LOAD_SAMPLE_MS = 1_000.0  # resolution of the per-worker load series
REPLAY_BUFFER = 4_096  # KV batches a worker keeps for listeners that missed some (bounded, drop oldest)


@attrs.frozen
class ClusterOptions:
    workers: int = 8
    dp_size: int = 1
    policy: str = "kv"
    seed: int = 0
    engine: EngineParams = attrs.Factory(EngineParams)
    router: RouterConfig = attrs.Factory(RouterConfig)
    model: str = "sim-model"
    kv_event_delay_ms: float = 0.0  # publish-to-index latency of KV events
    kv_wire: bool = False  # carry KV batches as vLLM's msgpack payload (encode, then the listener's decoder)
    replicas: int = 1  # router replicas, kept in step by replica sync when more than one
    faults: FaultPlan = NO_FAULTS
    check_every: int = 500  # run the load-accounting checks every N arrivals (everything at the end)


class RequestRecord:
    """What happened to one request, in virtual milliseconds."""

    __slots__ = (
        "admit_ms",
        "arrival_ms",
        "cached_at_select",
        "cached_tokens",
        "end_ms",
        "first_token_ms",
        "index",
        "input_tokens",
        "output_tokens",
        "predicted_tokens",
        "rank",
        "rejected",
    )

    def __init__(self, index: int, arrival_ms: float, input_tokens: int, output_tokens: int) -> None:
        self.index = index
        self.arrival_ms = arrival_ms
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens
        self.rank: WorkerRank | None = None
        self.predicted_tokens: int | None = None  # the router's predicted overlap (kv policy)
        self.cached_at_select: int | None = None  # what the chosen worker actually held at selection
        self.cached_tokens: int | None = None  # prompt tokens found cached at admission
        self.admit_ms: float | None = None
        self.first_token_ms: float | None = None
        self.end_ms: float | None = None
        self.rejected: str | None = None  # why it was not served (refused, or failed with its worker)


class SimWorker:
    """One dp rank of a simulated worker: its engine and its KV-event stream."""

    __slots__ = (
        "busy",
        "busy_ms",
        "engine",
        "epoch",
        "kv_seq",
        "lose",
        "rank",
        "removals_lost",
        "replay",
        "requests",
        "reset_pending",
        "samples",
        "unreplayable",
    )

    def __init__(self, rank: WorkerRank, params: EngineParams) -> None:
        self.rank = rank
        self.engine = WorkerEngine(params)
        self.busy = False  # a pass is running or scheduled
        self.epoch = 0  # bumped by a crash: a pass that was running then is void
        self.kv_seq = -1  # last published batch sequence number
        self.replay: deque[tuple[int, KvBatch]] = deque(maxlen=REPLAY_BUFFER)
        self.lose = 0  # batches still to lose in transit (kv-loss fault)
        self.removals_lost = False  # kv-no-removals fault: its BlockRemoved events are never published
        self.unreplayable: set[int] = set()  # lost batches the replay endpoint will not serve (replay=no)
        self.reset_pending = False  # cache-reset fault: reset the prefix cache when next idle
        self.busy_ms = 0.0
        self.requests = 0
        self.samples: dict[int, int] = {}  # load bucket -> most requests seen in it (running + waiting)


@attrs.define
class FaultCounters:
    worker_crashes: int = 0
    cache_resets: int = 0
    requests_failed: int = 0
    router_crashes: int = 0
    kv_batches_lost: int = 0
    kv_batches_replayed: int = 0
    kv_gaps_unrepaired: int = 0
    sync_sent: int = 0
    sync_dropped: int = 0
    sync_reordered: int = 0
    expiry_horizon_used: bool = False


@attrs.define
class ClusterRun:
    """The raw outcome of one policy's run; ``report.py`` turns it into figures."""

    policy: str
    records: list[RequestRecord]
    workers: list[SimWorker]
    duration_ms: float
    journal_digest: str
    journal_records: int
    events_processed: int
    preemptions: int
    kv_blocks_stored: int
    kv_blocks_evicted: int
    faults: FaultCounters
    failures: list[str]


class InvariantViolation(Exception):
    def __init__(self, step: int, time_ms: float, problems: list[str]) -> None:
        super().__init__(f"invariant violated at step {step} (t={time_ms:.3f} ms): " + "; ".join(problems))
        self.step = step
        self.time_ms = time_ms
        self.problems = problems


Progress = Callable[[int, int], None]


class Cluster:
    def __init__(
        self,
        trace: Trace,
        options: ClusterOptions,
        hasher: PromptHasher | None = None,
        progress: Progress | None = None,
    ) -> None:
        self.trace = trace
        self.options = options
        self.hasher = hasher or PromptHasher(trace.block_size, options.engine.block_size)
        self.progress = progress
        self.scope = ScopeKey(options.model, "default")
        self.workers: dict[WorkerRank, SimWorker] = {}
        for worker_id in range(1, options.workers + 1):
            for dp_rank in range(options.dp_size):
                rank = WorkerRank(worker_id, dp_rank)
                self.workers[rank] = SimWorker(rank, options.engine)
        self.records = [RequestRecord(r.index, r.arrival_ms, r.input_length, r.output_length) for r in trace.requests]
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self.now_ms = 0.0
        self.step = 0
        self._owner: dict[str, RouterReplica] = {}  # reservation -> the replica that booked it
        self._live: dict[str, EngineRequest] = {}  # requests inside some worker
        self._held_calls: dict[str, list[tuple[str, str, int | None]]] = {}  # replica -> calls waiting for it
        self._deferred: list[int] = []  # arrivals waiting for any router to be up
        self._listened: dict[tuple[str, WorkerRank], int] = {}  # (replica, rank) -> last seq it applied
        self.routers: list[RouterReplica] = []
        self.fault_rng = random.Random(f"{options.seed}:faults")
        self.counters = FaultCounters()
        self.failures: list[str] = []
        self._nursery: trio.Nursery | None = None

    # -- scheduling -------------------------------------------------------------------------------

    def _push(self, at_ms: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at_ms, kind, self._seq, payload))

    def _advance(self, at_ms: float) -> None:
        if at_ms > self.now_ms:
            self.now_ms = at_ms
            gap = self._origin + at_ms / 1000.0 - self._clock.current_time()
            if gap > 0:
                self._clock.jump(gap)

    # -- the run ----------------------------------------------------------------------------------

    async def run(self) -> ClusterRun:
        clock = trio.lowlevel.current_clock()
        if not isinstance(clock, trio.testing.MockClock):
            raise RuntimeError("a cluster simulation runs under trio.testing.MockClock (trio.run(..., clock=...))")
        self._clock = clock
        self._origin = clock.current_time()
        options = self.options
        root = f"{options.seed}"
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            replicated = options.replicas > 1
            await self._start_routers(nursery, root)
            policy = make_policy(options.policy, sorted(self.workers), random.Random(f"{root}:policy"))
            requests = self.trace.requests
            if requests:
                self._push(requests[0].arrival_ms, ARRIVAL, (0, True))
            self._push(SWEEP_EVERY_MS, SWEEP, None)
            for fault in options.faults.timed:
                self._push(fault.at_ms, FAULT, fault)
            arrivals = 0
            heap = self._heap
            while heap:
                at_ms, kind, _, payload = heapq.heappop(heap)
                self._advance(at_ms)
                self.step += 1
                if kind == PASS_END:
                    await self._pass_end(*payload)
                elif kind == PASS_START:
                    await self._pass_start(payload)
                elif kind == ARRIVAL:
                    index, chained = payload
                    if chained and index + 1 < len(requests):  # one arrival in the heap at a time
                        self._push(requests[index + 1].arrival_ms, ARRIVAL, (index + 1, True))
                    if await self._arrive(policy, index):
                        arrivals += 1
                        if self.progress is not None:
                            self.progress(arrivals, len(requests))
                        if arrivals % options.check_every == 0:
                            await self._check_running()
                elif kind == DELIVER:
                    await self._deliver(*payload)
                elif kind == SYNC:
                    await self._sync_deliver(*payload)
                elif kind == SWEEP:
                    await self._sweep(at_ms)
                elif kind == FAULT:
                    await self._fault(payload)
                elif kind == RESTART:
                    await self._restart_router(payload)
                if replicated:
                    self._flush_sync()
            await self._finish()
            digest, count = self._journal_digest()
            nursery.cancel_scope.cancel()
        workers = [self.workers[rank] for rank in sorted(self.workers)]
        ends = [r.end_ms for r in self.records if r.end_ms is not None]
        return ClusterRun(
            options.policy,
            self.records,
            workers,
            max(ends, default=0.0),
            digest,
            count,
            self.step,
            sum(w.engine.preemptions for w in workers),
            sum(w.engine.cache.stored for w in workers),
            sum(w.engine.cache.evicted for w in workers),
            self.counters,
            self.failures,
        )

    async def _start_routers(self, nursery: trio.Nursery, root: str) -> None:
        """One router replica per ``options.replicas`` (replica ids only when there are several), each told of
        every worker."""
        options = self.options
        replicated = options.replicas > 1
        for i in range(options.replicas):
            router = RouterReplica(
                f"router-{i}",
                self.scope,
                options.router,
                f"{root}:router-{i}",
                TrioClock(),
                replica_id=i + 1 if replicated else None,
                ttft_ablation=ttft_ablation(options.policy),
            )
            await router.start(nursery)
            self.routers.append(router)
            for worker_id in range(1, options.workers + 1):
                await router.upsert_worker(self._record(worker_id))

    async def _sweep(self, at_ms: float) -> None:
        """Expire stale bookings on every running replica; sweep again while anything else is scheduled."""
        for replica in self.routers:
            if replica.running:
                await replica.expire_stale()
        if any(k != SWEEP for _, k, _, _ in self._heap):
            self._push(at_ms + SWEEP_EVERY_MS, SWEEP, None)

    def _record(self, worker_id: int) -> WorkerRecord:
        dp = self.options.dp_size
        # Never connected to (events enter as commands), but a catalog record must name a usable endpoint.
        endpoints = tuple((r, f"inproc://sim-worker-{worker_id}-kv-{r}") for r in range(dp))
        return WorkerRecord(
            worker_id,
            self.options.model,
            endpoint=f"http://sim-worker-{worker_id}",
            kv_events_endpoints=endpoints,
            block_size=self.options.engine.block_size,
            data_parallel_start_rank=0,
            data_parallel_size=dp,
            max_num_batched_tokens=self.options.engine.max_batched_tokens,
            total_kv_blocks=self.options.engine.num_blocks,
        )

    def _client_router(self, index: int) -> RouterReplica | None:
        """The replica a client sends request ``index`` to: round robin over the replicas that are up."""
        count = len(self.routers)
        for offset in range(count):
            router = self.routers[(index + offset) % count]
            if router.running:
                return router
        return None

    # -- requests ---------------------------------------------------------------------------------

    async def _arrive(self, policy: Any, index: int) -> bool:
        """Route and submit request ``index``; False if no router is up (it waits for one)."""
        request = self.trace.requests[index]
        record = self.records[index]
        router = self._client_router(index)
        if router is None:
            self._deferred.append(index)
            return False
        request_id = f"req-{index}"
        blocks = self.hasher.blocks(request)
        try:
            placement = await policy.place(router, request_id, blocks, request.input_length)
        except RouterRefused as exc:
            record.rejected = f"router: {exc}"
            return True
        worker = self.workers[placement.rank]
        record.rank = placement.rank
        record.predicted_tokens = placement.predicted_cached_tokens
        self._owner[request_id] = router
        if not worker.engine.fits(request.input_length, request.output_length):
            record.rejected = "worker: the request is larger than its KV cache"
            await self._call(request_id, "release")
            return True
        tokens = request.token_ids(self.trace.block_size)
        engine_request = EngineRequest(request_id, index, tokens, list(blocks.sequence_hashes), request.output_length)
        record.cached_at_select = worker.engine.peek_cached_tokens(engine_request)
        worker.engine.submit(engine_request)
        self._live[request_id] = engine_request
        worker.requests += 1
        if not worker.busy:
            worker.busy = True
            self._push(self.now_ms, PASS_START, (worker.rank, worker.epoch))
        return True

    async def _pass_start(self, payload: tuple[WorkerRank, int]) -> None:
        rank, epoch = payload
        worker = self.workers[rank]
        if epoch != worker.epoch:
            return  # scheduled before a crash
        engine = worker.engine
        result = engine.step()
        now = self.now_ms
        for request, cached in result.admitted:
            record = self.records[request.index]
            if record.admit_ms is None:  # a preempted request keeps its first admission
                record.admit_ms = now
                record.cached_tokens = cached
        if result.events and result.duration_ms <= 0:
            await self._publish(worker, result.events)  # no pass runs (all preempted): nothing to wait for
        bucket = int(now // LOAD_SAMPLE_MS)
        load = len(engine.running) + len(engine.waiting)
        if worker.samples.get(bucket, -1) < load:
            worker.samples[bucket] = load
        if result.duration_ms > 0:
            worker.busy_ms += result.duration_ms
            self._push(now + result.duration_ms, PASS_END, (rank, worker.epoch, result))
        elif engine.has_work:
            self._push(now, PASS_START, (rank, worker.epoch))  # everything running was preempted: again
        else:
            worker.busy = False
            await self._idle(worker)

    async def _pass_end(self, rank: WorkerRank, epoch: int, result: PassResult) -> None:
        worker = self.workers[rank]
        if epoch != worker.epoch:
            return  # the worker crashed during the pass: nothing of it came out
        now = self.now_ms
        if result.events:
            # Published after the forward pass (the reference's mocker, recent vLLM): a request arriving
            # mid-pass is routed without the blocks that pass is still computing.
            await self._publish(worker, result.events)
        for request in result.emitted:
            if request.generated == 1:
                record = self.records[request.index]
                record.first_token_ms = now
                # As vLLM's usage.prompt_tokens_details.cached_tokens, which a client passes on.
                await self._call(request.request_id, "prefill_complete", record.cached_tokens)
        for request in result.finished:
            self.records[request.index].end_ms = now
            del self._live[request.request_id]
            await self._call(request.request_id, "release")
        if worker.engine.has_work:
            self._push(now, PASS_START, (rank, epoch))
        else:
            worker.busy = False
            await self._idle(worker)

    async def _idle(self, worker: SimWorker) -> None:
        """The worker has nothing to do: a pending prefix-cache reset happens now."""
        if not worker.reset_pending:
            return
        worker.reset_pending = False
        self.counters.cache_resets += 1
        worker.engine.cache.clear()
        await self._publish(worker, worker.engine.cache.take_events())
        await self._expect_no_blocks(worker.rank.worker_id, "reset its prefix cache")

    async def _call(self, request_id: str, call: str, cached_tokens: int | None = None) -> None:
        """A lifecycle call to the replica that booked the request; held while that replica is down.
        ``cached_tokens``: what ``prefill_complete`` reports the worker found cached."""
        router = self._owner[request_id]
        if call == "release":
            del self._owner[request_id]
        if not router.running:
            self._held_calls.setdefault(router.name, []).append((request_id, call, cached_tokens))
            return
        await self._send(router, request_id, call, cached_tokens)

    @staticmethod
    async def _send(router: RouterReplica, request_id: str, call: str, cached_tokens: int | None) -> None:
        if call == "prefill_complete":
            await router.prefill_complete(request_id, cached_tokens)
        else:
            await getattr(router, call)(request_id)

    # -- KV events --------------------------------------------------------------------------------

    async def _publish(self, worker: SimWorker, events: list[KvEvent]) -> None:
        if worker.removals_lost:
            events = [event for event in events if not isinstance(event, BlockRemoved)]
            if not events:
                return
        worker.kv_seq += 1
        seq = worker.kv_seq
        batch = KvBatch(self.now_ms / 1000.0, tuple(events))
        if self.options.kv_wire:
            # What crosses the socket: vLLM's array encoding, read back by the listener's decoder.
            batch = decode_batch(encode_batch(batch.events, ts=batch.ts, dp_rank=worker.rank.dp_rank))
        worker.replay.append((seq, batch))
        if worker.lose > 0:  # kv-loss fault: this batch never reaches a router
            worker.lose -= 1
            self.counters.kv_batches_lost += 1
            return
        delay = self.options.kv_event_delay_ms
        if delay > 0:
            self._push(self.now_ms + delay, DELIVER, (worker.rank, seq, batch))
        else:
            await self._deliver(worker.rank, seq, batch)

    async def _deliver(self, rank: WorkerRank, seq: int, batch: KvBatch) -> None:
        for router in self.routers:
            if router.running:
                await self._listen(router, rank, seq, batch)

    async def _listen(self, router: RouterReplica, rank: WorkerRank, seq: int, batch: KvBatch) -> None:
        """One replica's listener for one rank: apply in sequence, fetching a gap from the replay buffer."""
        key = (router.name, rank)
        last = self._listened.get(key, -1)
        if seq <= last:
            return  # already applied (it came with a replay)
        if seq > last + 1:
            await self._replay_range(router, rank, last, seq)
        await router.ingest(rank.worker_id, rank.dp_rank, seq, batch)
        self._listened[key] = seq

    async def _replay_range(self, router: RouterReplica, rank: WorkerRank, after: int, before: int) -> None:
        worker = self.workers[rank]
        held = {s: b for s, b in worker.replay if after < s < before and s not in worker.unreplayable}
        for seq in range(after + 1, before):
            batch = held.get(seq)
            if batch is None:
                self.counters.kv_gaps_unrepaired += 1
                continue
            await router.ingest(rank.worker_id, rank.dp_rank, seq, batch)
            self.counters.kv_batches_replayed += 1

    # -- replica sync -----------------------------------------------------------------------------

    def _flush_sync(self) -> None:
        """Carry every replica's newly published sync messages to its peers, through the fault model."""
        sync = self.options.faults.sync
        for router in self.routers:
            if router.replicator is None:
                continue
            for frames in router.replicator.take_published():
                for peer in self.routers:
                    if peer is router:
                        continue
                    self.counters.sync_sent += 1
                    faulty = self.now_ms < sync.until_ms
                    if faulty and sync.drop and self.fault_rng.random() < sync.drop:
                        self.counters.sync_dropped += 1
                        continue
                    at = self.now_ms
                    if faulty and sync.delay_ms:
                        at += self.fault_rng.uniform(0, 2 * sync.delay_ms)
                    if faulty and sync.reorder and self.fault_rng.random() < sync.reorder:
                        at += self.fault_rng.uniform(1.0, 10.0)  # held back behind later messages
                        self.counters.sync_reordered += 1
                    self._push(at, SYNC, (peer.name, router.name, frames))

    async def _sync_deliver(self, peer_name: str, sender: str, frames: list[bytes]) -> None:
        peer = next(r for r in self.routers if r.name == peer_name)
        if peer.replicator is not None:  # a replica that is down misses it, as its SUB would
            await peer.replicator.receive(frames, sender)

    # -- faults -----------------------------------------------------------------------------------

    async def _fault(self, fault: TimedFault) -> None:
        if isinstance(fault, WorkerCrash):
            await self._crash_worker(fault.worker)
        elif isinstance(fault, CacheReset):
            for rank, worker in sorted(self.workers.items()):
                if rank.worker_id == fault.worker:
                    worker.reset_pending = True
                    if not worker.busy:
                        await self._idle(worker)
        elif isinstance(fault, KvLoss):
            for rank, worker in self.workers.items():
                if rank.worker_id == fault.worker:
                    worker.lose += fault.batches
                    if not fault.replay:
                        worker.unreplayable.update(range(worker.kv_seq + 1, worker.kv_seq + 1 + fault.batches))
        elif isinstance(fault, KvNoRemovals):
            for rank, worker in self.workers.items():
                if rank.worker_id == fault.worker:
                    worker.removals_lost = True
        else:
            await self._crash_router(fault)

    async def _crash_worker(self, worker_id: int) -> None:
        self.counters.worker_crashes += 1
        for rank, worker in sorted(self.workers.items()):
            if rank.worker_id != worker_id:
                continue
            worker.epoch += 1
            worker.busy = False
            lost = worker.engine.drop_all()
            worker.engine.cache.take_events()  # the old process's last events die with it
            for request in lost:
                record = self.records[request.index]
                record.rejected = "failed: worker crashed"
                self.counters.requests_failed += 1
                del self._live[request.request_id]
                await self._call(request.request_id, "release")  # the client gives the reservation up
            # The restarted publisher starts a new stream at 0; the listener takes that as a restart.
            worker.kv_seq = -1
            worker.replay.clear()
            worker.unreplayable.clear()
            worker.lose = 0
            for router in self.routers:
                if router.running:
                    await router.reset_kv_stream(rank.worker_id, rank.dp_rank)
                    self._listened[(router.name, rank)] = -1
        await self._expect_no_blocks(worker_id, "restarted empty")

    async def _expect_no_blocks(self, worker_id: int, what: str) -> None:
        """Invariant: once the router has heard, it holds no block of a worker whose cache is empty."""
        await trio.testing.wait_all_tasks_blocked()
        problems = []
        for router in self.routers:
            state = router.state() if router.running else None
            if state is None:
                continue
            for rank in self.workers:
                if rank.worker_id == worker_id and state.selection.index.block_count(rank):
                    problems.append(f"{router.name}: worker {worker_id} {what} but the index still has its blocks")
        if problems:
            raise InvariantViolation(self.step, self.now_ms, problems)

    async def _crash_router(self, fault: RouterCrash) -> None:
        if fault.router >= len(self.routers):
            raise InvariantViolation(self.step, self.now_ms, [f"router-crash names router {fault.router}: no such"])
        router = self.routers[fault.router]
        if not router.running:
            return
        self.counters.router_crashes += 1
        # Let it apply what is already in its mailboxes (KV batches are sent without waiting): the crash
        # lands between two events, not at a point the scheduler picks.
        await trio.testing.wait_all_tasks_blocked()
        await router.crash()
        self._push(self.now_ms + fault.down_ms, RESTART, fault.router)

    async def _restart_router(self, index: int) -> None:
        router = self.routers[index]
        assert self._nursery is not None
        await router.restart(self._nursery)
        state = router.state()
        watermarks = state.kv_watermarks if state is not None else {}
        # The restarted listeners resume after the journaled watermark and replay what they missed.
        for rank, worker in sorted(self.workers.items()):
            last = watermarks.get(rank, -1)
            self._listened[(router.name, rank)] = last
            if worker.kv_seq > last:
                await self._replay_range(router, rank, last, worker.kv_seq + 1)
                self._listened[(router.name, rank)] = worker.kv_seq
        for request_id, call, cached_tokens in self._held_calls.pop(router.name, []):
            await self._send(router, request_id, call, cached_tokens)
        deferred, self._deferred = self._deferred, []
        for waiting in deferred:  # clients retry what they held, in arrival order
            self._push(self.now_ms, ARRIVAL, (waiting, False))

    # -- checks -----------------------------------------------------------------------------------

    async def _check_running(self, full: bool = False) -> None:
        """Load accounting (no negative load, sums match) during the run; everything, the KV index
        included, when ``full`` (at the end: the index check costs time in proportion to its size)."""
        await trio.testing.wait_all_tasks_blocked()
        for router in self.routers:
            if router.running:
                states = router.states()
                problems = invariant_failures(states) if full else load_failures(states)
                if problems:
                    raise InvariantViolation(self.step, self.now_ms, [f"{router.name}: {p}" for p in problems])

    async def _finish(self) -> None:
        """After the last event: every request ended, so every load is zero, every replica agrees, and
        replaying each journal gives its live state."""
        down = [r.name for r in self.routers if not r.running]
        if down:
            raise InvariantViolation(self.step, self.now_ms, [f"{', '.join(down)} still down at the end"])
        await self._check_running(full=True)
        leftovers = any(state.slots.requests for router in self.routers for state in router.states())
        if leftovers and self.options.faults.sync.active:
            # Lost or reordered replica messages leave stale requests on peers, as in 1.6.1; the
            # stale-request expiry removes them. Jump past its horizon and sweep.
            self.counters.expiry_horizon_used = True
            self._advance(self.now_ms + EXPIRY_AGE_NS / 1e6 + 1_000.0)
            for router in self.routers:
                await router.expire_stale()
        await trio.testing.wait_all_tasks_blocked()
        problems = []
        for router in self.routers:
            states = router.states()
            problems += [f"{router.name}: {p}" for p in idle_load_problems(states)]
            mismatch = replay_mismatch(router.journal, states)
            if mismatch:
                problems.append(f"{router.name}: {mismatch}")
            state = router.state()
            for rank, worker in sorted(self.workers.items()):
                mark = state.kv_watermarks.get(rank) if state is not None else None
                if worker.kv_seq >= 0 and mark != worker.kv_seq:
                    problems.append(
                        f"{router.name}: worker {rank.worker_id} dp_rank {rank.dp_rank} published up to batch "
                        f"{worker.kv_seq} but the index is at {mark}"
                    )
        problems += replicas_disagree({r.name: r.states() for r in self.routers})
        if problems:
            raise InvariantViolation(self.step, self.now_ms, problems)

    def _journal_digest(self) -> tuple[str, int]:
        router = self.routers[0]
        return journal_digest(router.journal), router.journal.last_lsn


def simulate_policy(
    trace: Trace, options: ClusterOptions, hasher: PromptHasher | None = None, progress: Progress | None = None
) -> ClusterRun:
    """Run one policy over a trace in its own ``trio.run`` under a MockClock (synchronous entry point)."""
    cluster = Cluster(trace, options, hasher, progress)
    try:
        return trio.run(cluster.run, clock=trio.testing.MockClock())
    except BaseExceptionGroup as group:  # the driver's nursery wraps what the driver raised
        found: BaseException | None = group.split(InvariantViolation)[0]
        while isinstance(found, BaseExceptionGroup):
            found = found.exceptions[0]
        if found is not None:
            raise found from None
        raise
