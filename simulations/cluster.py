"""The simulated cluster: clients replaying a trace, workers running forward passes, kvrouter routing.

One task drives everything from a heap of timed events (arrivals, pass starts and ends, KV-event
deliveries, expiry sweeps, faults) and moves trio's MockClock to each event's time before acting on
it, so the router's actors stamp every command with virtual time. The driver waits for each router
reply before the next event, so the mailbox order, and so the journal, is a pure function of the
trace, the options and the seed. Events at the same time run in a fixed order: pass ends, then
arrivals, then pass starts (a request arriving at a pass boundary joins that pass), each in the order
it was scheduled.

Each request follows the selection service's lifecycle: booked on arrival (``select_and_reserve`` for
the kv policy, an explicit reservation otherwise), ``prefill_complete`` when its first token comes
out, released when its last one does. Workers publish their KV events to every router replica
through the same command the KV listener sends.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from typing import Any

import attrs
import trio
import trio.testing

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.kv_wire import KvBatch, KvEvent
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.ports import TrioClock
from kvrouter.simulations.checkers import (
    idle_load_problems,
    invariant_failures,
    journal_digest,
    load_failures,
    replay_mismatch,
)
from kvrouter.simulations.engine import EngineRequest, PassResult, WorkerEngine
from kvrouter.simulations.policies import make_policy
from kvrouter.simulations.prompts import PromptHasher
from kvrouter.simulations.router import RouterRefused, RouterReplica
from kvrouter.simulations.timing import EngineParams
from kvrouter.simulations.trace import Trace

# Event kinds double as the tie-break order at equal times.
PASS_END, DELIVER, ARRIVAL, PASS_START, SWEEP, FAULT = range(6)
SWEEP_EVERY_MS = 30_000.0  # as the service's expiry sweep
LOAD_SAMPLE_MS = 1_000.0  # resolution of the per-worker load series


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
    check_every: int = 500  # run the invariant checks every N arrivals (and at the end)


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
        self.rejected: str | None = None


class SimWorker:
    """One dp rank of a simulated worker: its engine and its KV-event stream."""

    __slots__ = ("busy", "busy_ms", "engine", "kv_seq", "rank", "requests", "samples")

    def __init__(self, rank: WorkerRank, params: EngineParams) -> None:
        self.rank = rank
        self.engine = WorkerEngine(params)
        self.busy = False  # a pass is running or scheduled
        self.kv_seq = -1  # last published batch sequence number
        self.busy_ms = 0.0
        self.requests = 0
        self.samples: dict[int, int] = {}  # load bucket -> most requests seen in it (running + waiting)


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
    failures: list[str]


class InvariantViolation(Exception):
    def __init__(self, step: int, time_ms: float, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
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
        self.routers: list[RouterReplica] = []
        self.failures: list[str] = []

    # -- scheduling -------------------------------------------------------------------------------

    def _push(self, at_ms: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at_ms, kind, self._seq, payload))

    def _advance(self, clock: trio.testing.MockClock, origin: float, at_ms: float) -> None:
        if at_ms > self.now_ms:
            self.now_ms = at_ms
            target = origin + at_ms / 1000.0
            gap = target - clock.current_time()
            if gap > 0:
                clock.jump(gap)

    # -- the run ----------------------------------------------------------------------------------

    async def run(self) -> ClusterRun:
        clock = trio.lowlevel.current_clock()
        if not isinstance(clock, trio.testing.MockClock):
            raise RuntimeError("a cluster simulation runs under trio.testing.MockClock (trio.run(..., clock=...))")
        origin = clock.current_time()
        options = self.options
        root = f"{options.seed}"
        async with trio.open_nursery() as nursery:
            router = RouterReplica("router-0", self.scope, options.router, f"{root}:router-0", TrioClock())
            await router.start(nursery)
            self.routers = [router]
            for worker_id in range(1, options.workers + 1):
                await router.upsert_worker(self._record(worker_id))
            policy = make_policy(options.policy, sorted(self.workers), random.Random(f"{root}:policy"))
            requests = self.trace.requests
            if requests:
                self._push(requests[0].arrival_ms, ARRIVAL, 0)
            self._push(SWEEP_EVERY_MS, SWEEP, None)
            arrivals = 0
            heap = self._heap
            while heap:
                at_ms, kind, _, payload = heapq.heappop(heap)
                self._advance(clock, origin, at_ms)
                self.step += 1
                if kind == PASS_END:
                    await self._pass_end(*payload)
                elif kind == PASS_START:
                    await self._pass_start(payload)
                elif kind == ARRIVAL:
                    index = payload
                    if index + 1 < len(requests):
                        self._push(requests[index + 1].arrival_ms, ARRIVAL, index + 1)
                    await self._arrive(policy, index)
                    arrivals += 1
                    if self.progress is not None:
                        self.progress(arrivals, len(requests))
                    if arrivals % options.check_every == 0:
                        self._check_running()
                elif kind == DELIVER:
                    await self._deliver(*payload)
                elif kind == SWEEP:
                    for replica in self.routers:
                        if replica.running:
                            await replica.expire_stale()
                    if len(heap) > 0:
                        self._push(at_ms + SWEEP_EVERY_MS, SWEEP, None)
            await trio.testing.wait_all_tasks_blocked()
            self._check_end()
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
            self.failures,
        )

    def _record(self, worker_id: int) -> WorkerRecord:
        dp = self.options.dp_size
        # Never connected to (events enter as commands), but a catalog record must name a usable endpoint.
        endpoints = tuple((r, f"inproc://sim-worker-{worker_id}-kv-{r}") for r in range(dp))
        return WorkerRecord(
            worker_id,
            self.options.model,
            endpoint=f"sim://worker-{worker_id}",
            kv_events_endpoints=endpoints,
            block_size=self.options.engine.block_size,
            data_parallel_start_rank=0,
            data_parallel_size=dp,
            max_num_batched_tokens=self.options.engine.max_batched_tokens,
            total_kv_blocks=self.options.engine.num_blocks,
        )

    # -- event handlers ---------------------------------------------------------------------------

    async def _arrive(self, policy: Any, index: int) -> None:
        request = self.trace.requests[index]
        record = self.records[index]
        request_id = f"req-{index}"
        blocks = self.hasher.blocks(request)
        router = self.routers[0]
        try:
            placement = await policy.place(router, request_id, blocks, request.input_length)
        except RouterRefused as exc:
            record.rejected = f"router: {exc}"
            return
        worker = self.workers[placement.rank]
        record.rank = placement.rank
        record.predicted_tokens = placement.predicted_cached_tokens
        self._owner[request_id] = router
        if not worker.engine.fits(request.input_length, request.output_length):
            record.rejected = "worker: the request is larger than its KV cache"
            await router.release(request_id)
            return
        tokens = request.token_ids(self.trace.block_size)
        engine_request = EngineRequest(request_id, index, tokens, list(blocks.sequence_hashes), request.output_length)
        record.cached_at_select = worker.engine.peek_cached_tokens(engine_request)
        worker.engine.submit(engine_request)
        worker.requests += 1
        if not worker.busy:
            worker.busy = True
            self._push(self.now_ms, PASS_START, worker.rank)

    async def _pass_start(self, rank: WorkerRank) -> None:
        worker = self.workers[rank]
        engine = worker.engine
        result = engine.step()
        now = self.now_ms
        for request, cached in result.admitted:
            record = self.records[request.index]
            if record.admit_ms is None:  # a preempted request keeps its first admission
                record.admit_ms = now
                record.cached_tokens = cached
        if result.events:
            await self._publish(worker, result.events)
        bucket = int(now // LOAD_SAMPLE_MS)
        load = len(engine.running) + len(engine.waiting)
        if worker.samples.get(bucket, -1) < load:
            worker.samples[bucket] = load
        if result.duration_ms > 0:
            worker.busy_ms += result.duration_ms
            self._push(now + result.duration_ms, PASS_END, (rank, result))
        elif engine.has_work:
            self._push(now, PASS_START, rank)  # everything running was preempted: try again at once
        else:
            worker.busy = False

    async def _pass_end(self, rank: WorkerRank, result: PassResult) -> None:
        worker = self.workers[rank]
        now = self.now_ms
        for request in result.emitted:
            if request.generated == 1:
                self.records[request.index].first_token_ms = now
                await self._lifecycle(request, "prefill_complete")
        for request in result.finished:
            self.records[request.index].end_ms = now
            await self._lifecycle(request, "release")
        if worker.engine.has_work:
            self._push(now, PASS_START, rank)
        else:
            worker.busy = False

    async def _lifecycle(self, request: EngineRequest, call: str) -> None:
        router = self._owner[request.request_id]
        if call == "release":
            del self._owner[request.request_id]
        if router.running:
            await getattr(router, call)(request.request_id)

    async def _publish(self, worker: SimWorker, events: list[KvEvent]) -> None:
        worker.kv_seq += 1
        batch = KvBatch(self.now_ms / 1000.0, tuple(events))
        delay = self.options.kv_event_delay_ms
        if delay > 0:
            self._push(self.now_ms + delay, DELIVER, (worker.rank, worker.kv_seq, batch))
        else:
            await self._deliver(worker.rank, worker.kv_seq, batch)

    async def _deliver(self, rank: WorkerRank, seq: int, batch: KvBatch) -> None:
        for router in self.routers:
            if router.running:
                await router.ingest(rank.worker_id, rank.dp_rank, seq, batch)

    # -- checks -----------------------------------------------------------------------------------

    def _check_running(self, full: bool = False) -> None:
        """Load accounting (no negative load, sums match) during the run; everything, the KV index
        included, when ``full`` (at the end: the index check costs time in proportion to its size)."""
        for router in self.routers:
            if router.running:
                states = router.states()
                problems = invariant_failures(states) if full else load_failures(states)
                if problems:
                    raise InvariantViolation(self.step, self.now_ms, [f"{router.name}: {p}" for p in problems])

    def _check_end(self) -> None:
        self._check_running(full=True)
        problems = []
        for router in self.routers:
            if not router.running:
                continue
            problems += [f"{router.name}: {p}" for p in idle_load_problems(router.states())]
            mismatch = replay_mismatch(router.journal, router.states())
            if mismatch:
                problems.append(f"{router.name}: {mismatch}")
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
    return trio.run(cluster.run, clock=trio.testing.MockClock())
