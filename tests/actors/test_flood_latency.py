"""A KV-event flood must not hold selections up: trio runs every runnable task once per scheduling round and a
request needs several rounds, so a request would wait for all the ingest work done in its rounds. Ingest
starts each piece of work (decoding a run, handing it to the actor) only when the loop has nothing else to run
(actors/loop_idle.py), so a request waits for at most the pieces already started when it arrived, however many
rounds it takes and however much of a flood is queued. Under trio's MockClock, so the bound on how long ingest
waits for an idle loop never passes unless the test moves the clock."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest
import trio
import trio.testing

from kvrouter.actors import kv_ingest
from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.commands import Command, IngestKvBatch, Prompt, SelectWorker, UpsertWorker
from kvrouter.actors.core.decisions import Accepted
from kvrouter.actors.core.events import Event
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.kv_wire import BlockStored, KvBatch, encode_batch, named_blocks
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.kv_ingest import INGEST_RUN_BLOCKS, INGEST_WAITS_AT_MOST, KvIngest, ListenerKey
from kvrouter.actors.kv_listener import GROUP_MAX_BATCHES
from kvrouter.actors.ports import TrioClock
from kvrouter.actors.system import ActorSystem
from kvrouter.actors.transport.socket_budget import ListenerSlots
from kvrouter.journal.memory import MemoryJournal

SCOPE = ScopeKey("m", "t")
BLOCK = 4
RANKS = 16
BATCH_BLOCKS = 64
GROUPS = 4  # per rank, each of GROUP_MAX_BATCHES batches: what a listener reads off a flooded socket
TOTAL = RANKS * GROUPS * GROUP_MAX_BATCHES * BATCH_BLOCKS
BUSY_ROUNDS = 64  # scheduling rounds a request stays runnable (a slow one; a /select takes about 8)
# What may run in a request's rounds: the one piece started before it arrived, a run decoded or a run applied (a
# run's decoding reads one batch past the run when that batch does not fit: it goes with the next run).
STARTED_BEFORE = INGEST_RUN_BLOCKS + BATCH_BLOCKS


def chain(rank: int, batch: int) -> tuple[bytes, list[int]]:
    """A 64-block chain for ``rank`` (encoded as one batch) and its tokens."""
    first = (rank * GROUPS * GROUP_MAX_BATCHES + batch) * BATCH_BLOCKS + 1
    tokens = [(first * BLOCK + i) % 50_000 + rank for i in range(BATCH_BLOCKS * BLOCK)]
    store = BlockStored(tuple(range(first, first + BATCH_BLOCKS)), None, tokens, BLOCK)
    return encode_batch([store]), tokens


@attrs.define
class Flood:
    system: ActorSystem
    done: trio.Event
    work: Callable[[], int]  # blocks decoded plus blocks applied so far
    most_waiting: Callable[[], int]  # the most blocks decoded and not yet applied at any time


async def start_flood(nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch) -> Flood:
    """16 ranks of one worker, each handing ``GROUPS`` full groups to KV ingest as fast as it takes them."""
    system = ActorSystem(MemoryJournal(), TrioClock(), encode_snapshots_in_thread=False)  # type: ignore[arg-type]
    await nursery.start(system.run)
    endpoints = tuple((rank, f"tcp://127.0.0.1:{5600 + rank}") for rank in range(RANKS))
    record = WorkerRecord(
        1, "m", "t", endpoint="http://w1", block_size=BLOCK, data_parallel_size=RANKS, kv_events_endpoints=endpoints
    )
    assert isinstance(await system.ask(SCOPE, UpsertWorker(record)), Accepted)
    ingest = KvIngest(system, ListenerSlots(RANKS, "the test"))
    decoded = applied = most_waiting = 0
    decode = kv_ingest.decode_batch

    def counted_decode(payload: bytes) -> KvBatch:
        nonlocal decoded, most_waiting
        batch = decode(payload)
        decoded += named_blocks(batch)
        most_waiting = max(most_waiting, decoded - applied)
        return batch

    def count_applied(state: ScopeState, command: Command, events: tuple[Event, ...]) -> None:
        nonlocal applied
        if isinstance(command, IngestKvBatch):
            applied += named_blocks(command.batch) + sum(named_blocks(batch) for _, batch in command.following)

    monkeypatch.setattr(kv_ingest, "decode_batch", counted_decode)
    system.observers.append(count_applied)

    async def listener(rank: int) -> None:
        """What a listener does with a flood already queued on its socket: a full group, then the next."""
        on_batches = ingest.consumer(ListenerKey(SCOPE, WorkerRank(1, rank), endpoints[rank][1], None))
        for group in range(GROUPS):
            batches = range(group * GROUP_MAX_BATCHES, (group + 1) * GROUP_MAX_BATCHES)
            await on_batches([(batch, chain(rank, batch)[0]) for batch in batches])
            await trio.lowlevel.checkpoint()

    done = trio.Event()

    async def flood() -> None:
        async with trio.open_nursery() as listeners:
            for rank in range(RANKS):
                listeners.start_soon(listener, rank)
        done.set()

    nursery.start_soon(flood)
    return Flood(system, done, lambda: decoded + applied, lambda: most_waiting)


async def busy(rounds: int) -> None:
    """A request's steps: runnable for ``rounds`` scheduling rounds (a step each), never waiting."""
    for _ in range(rounds):
        await trio.lowlevel.checkpoint()


def assert_indexed(flood: Flood) -> None:
    """The flood is indexed: the last chain of the last rank is found whole on that rank (overlap in tokens)."""
    assert flood.work() == 2 * TOTAL  # every block decoded once and applied once
    last_rank, last_batch = RANKS - 1, GROUPS * GROUP_MAX_BATCHES - 1
    decision = flood.system.query(SCOPE, SelectWorker(Prompt(chain(last_rank, last_batch)[1]), RouterConfig()))
    assert isinstance(decision, Accepted)
    assert (decision.reply.worker_id, decision.reply.dp_rank) == (1, last_rank)
    assert decision.reply.overlap["dp"][str(last_rank)] == BATCH_BLOCKS * BLOCK


async def test_a_request_waits_only_for_the_ingest_work_started_before_it(
    nursery: trio.Nursery, mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    flood = await start_flood(nursery, monkeypatch)
    await busy(BUSY_ROUNDS)
    assert flood.work() == 0  # the loop never idled: no ingest work started
    waited = []
    while not flood.done.is_set():
        await trio.testing.wait_all_tasks_blocked()  # the loop idles between requests: ingest goes on
        before = flood.work()
        await busy(BUSY_ROUNDS)  # then a request arrives
        waited.append(flood.work() - before)
    # before: every piece waiting for the idle loop started at once (a run decoded beside runs handed over, then
    # applied together), 2 x 1,024 blocks and more in a request's rounds
    assert max(waited) <= STARTED_BEFORE, waited
    assert len(waited) >= TOTAL // STARTED_BEFORE  # and the flood went on between the requests
    assert_indexed(flood)


async def test_a_loop_that_never_idles_still_ingests_a_run_per_bound(
    nursery: trio.Nursery, mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    flood = await start_flood(nursery, monkeypatch)
    waited = []
    while not flood.done.is_set():
        before = flood.work()
        await busy(BUSY_ROUNDS)
        waited.append(flood.work() - before)
        mock_clock.jump(INGEST_WAITS_AT_MOST)  # requests back to back: ingest waited as long as it may
    assert max(waited) <= STARTED_BEFORE, waited
    assert_indexed(flood)


async def test_at_most_one_decoded_run_waits_for_the_actor(
    nursery: trio.Nursery, mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listener decodes its run only once the previous run (any rank's) is applied: the memory a flood holds
    decoded is one run, plus the batch each rank read past its last run, however many ranks flood at once."""
    flood = await start_flood(nursery, monkeypatch)
    while not flood.done.is_set():
        await trio.testing.wait_all_tasks_blocked()
        await busy(BUSY_ROUNDS)
    # before: each rank decoded a run and then queued for the hand-over, 16 runs decoded at once
    assert flood.most_waiting() <= INGEST_RUN_BLOCKS + RANKS * BATCH_BLOCKS, flood.most_waiting()
    assert_indexed(flood)
