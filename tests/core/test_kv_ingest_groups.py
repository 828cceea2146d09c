"""Several batches of a rank's KV-event stream decided together (``IngestKvBatch.following``): the listener hands
a flood over in groups, and a group must index exactly what its batches would one by one."""

from __future__ import annotations

from array import array

import pytest

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.commands import IngestKvBatch, UpsertWorker
from kvrouter.actors.core.decide import decide
from kvrouter.actors.core.decisions import Accepted
from kvrouter.actors.core.events import KvIndexed, KvIndexTrimmed
from kvrouter.actors.core.evolve import fold
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.index_bounds import RUN_FRACTION, run_block_limit
from kvrouter.actors.core.kv_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvBatch,
    decode_batch,
    encode_batch,
)
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.persistence.codec import decode_record, digest, encode_record

SCOPE = ScopeKey("m", "t")
BLOCK = 4


def scope() -> ScopeState:
    state = ScopeState(SCOPE)
    record = WorkerRecord(
        7,
        SCOPE.model_name,
        SCOPE.tenant_id,
        block_size=BLOCK,
        data_parallel_size=2,
        kv_events_endpoints=((0, "tcp://w:1"), (1, "tcp://w:2")),
    )
    decision = decide(state, UpsertWorker(record))
    assert isinstance(decision, Accepted)
    fold(state, decision.events)
    return state


def store(first: int, blocks: int, parent: int | None = None) -> BlockStored:
    return BlockStored(
        tuple(range(first, first + blocks)), parent, list(range(first * BLOCK, (first + blocks) * BLOCK)), BLOCK
    )


def stream() -> list[tuple[int, KvBatch]]:
    """A rank's batches: stores, a chained store, one placed on dp rank 1, one naming a rank the worker lacks,
    a removal, a clear and more stores."""
    return [
        (10, KvBatch(0.0, (store(100, 3),))),
        (11, KvBatch(0.0, (store(103, 2, parent=102), store(200, 2)))),
        (12, KvBatch(0.0, (store(300, 4),), dp_rank=1)),
        (13, KvBatch(0.0, (store(400, 2),), dp_rank=5)),  # no such rank: skipped, as alone
        (14, KvBatch(0.0, (BlockRemoved((104,)),))),
        (15, KvBatch(0.0, (AllBlocksCleared(), store(500, 2)))),
        (16, KvBatch(0.0, (store(502, 1, parent=501),))),
    ]


def one_by_one(state: ScopeState, batches: list[tuple[int, KvBatch]], cap: int) -> list[bytes]:
    records = []
    for seq, batch in batches:
        decision = decide(state, IngestKvBatch(7, 0, seq, batch, max_index_blocks=cap))
        assert isinstance(decision, Accepted)
        if decision.events:
            records.append(encode_record(SCOPE, decision.events))
            fold(state, decision.events)
    return records


def together(state: ScopeState, batches: list[tuple[int, KvBatch]], cap: int) -> Accepted:
    (seq, batch), *following = batches
    decision = decide(state, IngestKvBatch(7, 0, seq, batch, max_index_blocks=cap, following=tuple(following)))
    assert isinstance(decision, Accepted)
    fold(state, decision.events)
    return decision


def test_a_group_indexes_what_its_batches_index_one_by_one() -> None:
    alone, grouped = scope(), scope()
    one_by_one(alone, stream(), cap=1_000)
    decision = together(grouped, stream(), cap=1_000)
    assert digest(grouped.to_snapshot()) == digest(alone.to_snapshot())
    assert grouped.selection.kv_watermarks[WorkerRank(7, 0)] == 16
    # One event per run of batches on the same dp rank, each carrying its run's last seq.
    indexed = [(e.dp_rank, e.seq) for e in decision.events if isinstance(e, KvIndexed)]
    assert indexed == [(0, 11), (1, 12), (0, 16)]


def test_a_group_is_one_journal_record_that_replays_to_the_same_state() -> None:
    state = scope()
    decision = together(state, stream(), cap=1_000)
    replayed = scope()
    fold(replayed, decode_record(encode_record(SCOPE, decision.events)).events)
    assert digest(replayed.to_snapshot()) == digest(state.to_snapshot())


def test_a_group_over_the_cap_trims_once_and_keeps_the_index_under_it() -> None:
    state = scope()
    cap = 8
    one_by_one(state, [(9, KvBatch(0.0, (store(900, 6),)))], cap=cap)
    decision = together(state, stream(), cap=cap)
    assert any(isinstance(e, KvIndexTrimmed) for e in decision.events)
    assert state.selection.index.block_count() <= cap


def test_runs_are_limited_to_a_fraction_of_the_cap() -> None:
    assert run_block_limit(8 * 1024 * 1024) == 8 * 1024 * 1024 // RUN_FRACTION
    assert run_block_limit(15) == 0  # a small cap: every batch goes alone


def test_a_decoded_store_keeps_its_tokens_packed() -> None:
    """4 bytes a token in the mailbox and for the re-hash, instead of a tuple of ints."""
    tokens = list(range(70_000, 70_000 + 8))
    [event] = decode_batch(encode_batch([BlockStored((1, 2), None, tokens, BLOCK)])).events
    assert isinstance(event, BlockStored)
    assert isinstance(event.token_ids, array) and event.token_ids.typecode == "I"
    assert event == BlockStored((1, 2), None, tuple(tokens), BLOCK)  # equal whatever sequence it was built from
    with pytest.raises(OverflowError):
        BlockStored((1,), None, [-1, 0, 0, 0], BLOCK)
