"""The simulated worker: prefix caching, LRU eviction, chunked prefill, batch limit, timing, KV events."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from kvrouter.actors.core.hashing import block_hashes, sequence_hashes
from kvrouter.actors.core.kv_wire import AllBlocksCleared, BlockRemoved, BlockStored, stored_blocks
from kvrouter.simulations.engine import EngineRequest, PassResult, WorkerEngine
from kvrouter.simulations.kv_cache import external_hash
from kvrouter.simulations.timing import ENGINE_PRESETS, EngineParams

BS = 4


def request(tokens: list[int], output: int = 1, index: int = 0) -> EngineRequest:
    hashes = sequence_hashes(block_hashes(tokens, BS))
    return EngineRequest(f"req-{index}", index, list(tokens), hashes, output)


def engine(**overrides: Any) -> WorkerEngine:
    params = EngineParams(block_size=BS, num_blocks=16, max_batched_tokens=64, max_running=8)
    return WorkerEngine(attrs.evolve(params, **overrides))


def run_until_done(worker: WorkerEngine) -> list[PassResult]:
    results = []
    while worker.has_work:
        results.append(worker.step())
    return results


def test_the_preset_is_the_reference_default_engine() -> None:
    p = ENGINE_PRESETS["dynamo-mocker"]
    assert (p.num_blocks, p.block_size, p.max_batched_tokens, p.max_running) == (16_384, 64, 8_192, 256)
    assert p.prefill_time(0) == 0.0
    assert p.prefill_time(1000) == pytest.approx(4.209989e-7 * 1e6 + 0.01518344 * 1000 + 16.50142)
    assert p.decode_time(0.5) == pytest.approx(-25.74 * 0.25 + 54.01 * 0.5 + 5.74)
    assert p.decode_time(2.5) == 1.0  # the floor


def test_a_repeated_prompt_finds_its_prefix_cached_except_the_last_token() -> None:
    worker = engine()
    tokens = list(range(12))  # three full blocks
    worker.submit(request(tokens, index=0))
    first = run_until_done(worker)
    assert first[0].admitted[0][1] == 0
    worker.submit(request(tokens, index=1))
    second = worker.step()
    # (12 - 1) // 4 = 2 blocks can be hits: the last block is recomputed for its last token.
    assert second.admitted[0][1] == 8
    assert second.prefill_tokens == 4


def test_stored_events_chain_to_their_parent_and_rehash_like_the_router() -> None:
    worker = engine()
    tokens = list(range(100, 112))
    worker.submit(request(tokens))
    result = worker.step()
    (event,) = [e for e in result.events if isinstance(e, BlockStored)]
    hashes = sequence_hashes(block_hashes(tokens, BS))
    assert event.block_hashes == tuple(external_hash(h) for h in hashes)
    assert event.parent_hash is None
    # What the router's ingest computes from the event: the same local hashes the prompt has.
    assert [local for _, local in stored_blocks(event, BS)] == block_hashes(tokens, BS)


def test_lru_eviction_publishes_removals_tail_first() -> None:
    worker = engine(num_blocks=4)
    worker.submit(request(list(range(8)), index=0))  # 2 blocks, released when done
    run_until_done(worker)
    older = sequence_hashes(block_hashes(list(range(8)), BS))
    worker.submit(request(list(range(50, 62)), index=1))  # needs 3 blocks: one must be evicted
    result = worker.step()
    removed = [e for e in result.events if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved((external_hash(older[1]),))]  # the tail of the older prompt goes first
    assert worker.cache.evicted == 1


def test_chunked_prefill_spreads_a_long_prompt_over_passes() -> None:
    worker = engine(max_batched_tokens=8, num_blocks=64)
    worker.submit(request(list(range(20)), output=2))
    results = run_until_done(worker)
    assert [r.prefill_tokens for r in results] == [8, 8, 4, 0]
    assert [len(r.emitted) for r in results] == [0, 0, 1, 1]  # first token at the end of the pass that finishes
    assert results[-1].finished and results[-1].duration_ms > 0


def test_the_batch_limit_keeps_requests_waiting() -> None:
    worker = engine(max_running=2, num_blocks=64)
    for i in range(3):
        worker.submit(request([1000 * i + t for t in range(4)], output=3, index=i))
    first = worker.step()
    assert len(first.admitted) == 2 and len(worker.waiting) == 1


def test_pass_time_is_prefill_plus_decode_of_the_kv_share() -> None:
    params = EngineParams(block_size=BS, num_blocks=10, max_batched_tokens=64, max_running=8)
    worker = WorkerEngine(params)
    worker.submit(request(list(range(10)), output=3))
    first = worker.step()  # 10 prompt tokens: the forward pass that ends the prompt samples the first token
    assert first.emitted and first.duration_ms == pytest.approx(params.prefill_time(10))
    decode = worker.step()  # a decode step: 3 blocks held when the second token comes out
    assert decode.prefill_tokens == 0
    assert decode.kv_share == pytest.approx(0.3)
    assert decode.duration_ms == pytest.approx(params.decode_time(0.3))
    worker.submit(request(list(range(20, 26)), output=1, index=1))
    mixed = worker.step()  # one prompt of 6 tokens and one decode token: both parts
    assert mixed.prefill_tokens == 6 and len(mixed.emitted) == 2
    assert mixed.duration_ms == pytest.approx(params.prefill_time(6) + params.decode_time(mixed.kv_share))


def test_a_full_cache_preempts_the_newest_request_which_then_recomputes() -> None:
    worker = engine(num_blocks=4, max_batched_tokens=64)
    worker.submit(request(list(range(7)), output=6, index=0))  # 2 blocks, grows into a 3rd and 4th
    worker.submit(request(list(range(100, 107)), output=6, index=1))
    results = run_until_done(worker)
    assert worker.preemptions >= 1
    assert sum(len(r.finished) for r in results) == 2
    assert worker.cache.active == 0 and worker.cache.private == 0


def test_a_crash_clears_the_cache_with_one_event() -> None:
    worker = engine()
    worker.submit(request(list(range(8)), output=5))
    worker.step()
    lost = worker.drop_all()
    assert len(lost) == 1 and not worker.has_work
    assert worker.cache.take_events() == [AllBlocksCleared()]
    assert worker.cache.used == 0


def test_without_prefix_caching_nothing_is_shared_or_published() -> None:
    worker = engine(prefix_caching=False)
    worker.submit(request(list(range(12)), index=0))
    results = run_until_done(worker)
    worker.submit(request(list(range(12)), index=1))
    again = worker.step()
    assert again.admitted[0][1] == 0
    assert not any(r.events for r in results) and not again.events
