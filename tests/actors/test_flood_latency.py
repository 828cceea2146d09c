"""A KV-event flood must not hold selections up: trio runs every runnable task once per scheduling round and a
request needs several rounds, so what a request waits for is the ingest work done per round, across every
listener and the actor. That work is bounded in blocks, however much of a flood is queued."""

from __future__ import annotations

import pytest
import trio

from kvrouter.actors import kv_ingest
from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.commands import Command, IngestKvBatch, Prompt, SelectWorker, UpsertWorker
from kvrouter.actors.core.decisions import Accepted
from kvrouter.actors.core.events import Event
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.kv_wire import BlockStored, KvBatch, encode_batch, named_blocks
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.kv_ingest import KvIngest, ListenerKey
from kvrouter.actors.kv_listener import GROUP_MAX_BATCHES
from kvrouter.actors.peers.socket_budget import ListenerSlots
from kvrouter.actors.ports import TrioClock
from kvrouter.actors.system import ActorSystem
from kvrouter.journal.memory import MemoryJournal

SCOPE = ScopeKey("m", "t")
BLOCK = 4
RANKS = 16
BATCH_BLOCKS = 64
GROUPS = 8  # per rank, each of GROUP_MAX_BATCHES batches: what a listener reads off a flooded socket
REQUEST_ROUNDS = 8  # scheduling rounds a request takes from its first step to its answer
# Blocks of ingest work (decoded by the listeners' consumers plus applied by the actor) a request may wait for per
# round: ~3 runs of 1,024 (at ~2 us a block, ~6 ms). Before the bound, one actor turn applied every queued group
# (16 ranks x 1,024 blocks) and 16 listeners decoded a group each in one round: ~64k blocks in 8 rounds.
ROUND_BLOCKS = 3 * 1024


def chain(rank: int, batch: int) -> tuple[bytes, list[int]]:
    """A 64-block chain for ``rank`` (encoded as one batch) and its tokens."""
    first = (rank * GROUPS * GROUP_MAX_BATCHES + batch) * BATCH_BLOCKS + 1
    tokens = [(first * BLOCK + i) % 50_000 + rank for i in range(BATCH_BLOCKS * BLOCK)]
    store = BlockStored(tuple(range(first, first + BATCH_BLOCKS)), None, tokens, BLOCK)
    return encode_batch([store]), tokens


async def test_a_selection_waits_for_a_bounded_amount_of_ingest_during_a_flood(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    system = ActorSystem(MemoryJournal(), TrioClock(), encode_snapshots_in_thread=False)  # type: ignore[arg-type]
    await nursery.start(system.run)
    endpoints = tuple((rank, f"tcp://127.0.0.1:{5600 + rank}") for rank in range(RANKS))
    record = WorkerRecord(
        1, "m", "t", endpoint="http://w1", block_size=BLOCK, data_parallel_size=RANKS, kv_events_endpoints=endpoints
    )
    assert isinstance(await system.ask(SCOPE, UpsertWorker(record)), Accepted)
    ingest = KvIngest(system, ListenerSlots(RANKS, "the test"))

    work = 0  # blocks decoded plus blocks applied
    decode = kv_ingest.decode_batch

    def counted_decode(payload: bytes) -> KvBatch:
        nonlocal work
        batch = decode(payload)
        work += named_blocks(batch)
        return batch

    def count_applied(state: ScopeState, command: Command, events: tuple[Event, ...]) -> None:
        nonlocal work
        if isinstance(command, IngestKvBatch):
            work += named_blocks(command.batch) + sum(named_blocks(batch) for _, batch in command.following)

    monkeypatch.setattr(kv_ingest, "decode_batch", counted_decode)
    system.observers.append(count_applied)

    async def listener(rank: int) -> None:
        """What a listener does with a flood already queued on its socket: a full group, then the next."""
        on_batches = ingest.consumer(ListenerKey(SCOPE, WorkerRank(1, rank), endpoints[rank][1], None))
        for group in range(GROUPS):
            batches = range(group * GROUP_MAX_BATCHES, (group + 1) * GROUP_MAX_BATCHES)
            await on_batches([(batch, chain(rank, batch)[0]) for batch in batches])
            await trio.lowlevel.checkpoint()

    flooded = trio.Event()

    async def flood() -> None:
        async with trio.open_nursery() as listeners:
            for rank in range(RANKS):
                listeners.start_soon(listener, rank)
        flooded.set()

    actor = system.actors[SCOPE]
    waited = []
    nursery.start_soon(flood)
    while not flooded.is_set():
        before = work
        for _ in range(REQUEST_ROUNDS - 1):
            await trio.lowlevel.checkpoint()
        decision = actor.query(SelectWorker(Prompt(chain(0, 0)[1]), RouterConfig()))
        assert isinstance(decision, Accepted)
        waited.append(work - before)
        await trio.lowlevel.checkpoint()
    total = RANKS * GROUPS * GROUP_MAX_BATCHES * BATCH_BLOCKS
    assert work == 2 * total  # every block decoded once and applied once
    assert max(waited) <= REQUEST_ROUNDS * ROUND_BLOCKS, waited
    assert len(waited) > total // (REQUEST_ROUNDS * ROUND_BLOCKS)  # the flood went on while they were answered
    # The flood is indexed: the last chain of the last rank is found whole on that rank (overlap in tokens).
    last_rank, last_batch = RANKS - 1, GROUPS * GROUP_MAX_BATCHES - 1
    decision = actor.query(SelectWorker(Prompt(chain(last_rank, last_batch)[1]), RouterConfig()))
    assert isinstance(decision, Accepted)
    assert (decision.reply.worker_id, decision.reply.dp_rank) == (1, last_rank)
    assert decision.reply.overlap["dp"][str(last_rank)] == BATCH_BLOCKS * BLOCK
