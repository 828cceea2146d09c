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
    decode = worker.step()  # a decode step over a sequence of 11 tokens (3 blocks held)
    assert decode.prefill_tokens == 0
    assert decode.kv_share == pytest.approx(11 / 40)  # tokens over the capacity in tokens, not 3 / 10 blocks
    assert decode.duration_ms == pytest.approx(params.decode_time(11 / 40))
    worker.submit(request(list(range(20, 26)), output=1, index=1))
    mixed = worker.step()  # one prompt of 6 tokens and one decode token: both parts
    assert mixed.prefill_tokens == 6 and len(mixed.emitted) == 2
    # Only the decoding sequence (now 12 tokens) counts in p; the prompt computed beside it does not.
    assert mixed.kv_share == pytest.approx(12 / 40)
    assert mixed.duration_ms == pytest.approx(params.prefill_time(6) + params.decode_time(12 / 40))


def test_the_decode_share_sums_the_decoding_sequences_in_tokens() -> None:
    # As the reference's mocker times it (measured: a lone 6,400-token prompt's second token takes
    # decode(6401 / 1,048,576), not decode(101 blocks / 16,384)): p counts the tokens of the sequences
    # that decode in the pass, partly filled blocks as what they hold, and nothing of a prompt in prefill.
    params = EngineParams(block_size=BS, num_blocks=100, max_batched_tokens=64, max_running=8)
    worker = WorkerEngine(params)
    worker.submit(request(list(range(9)), output=5, index=0))  # 9 tokens: 3 blocks, the last holding 1
    worker.submit(request(list(range(100, 105)), output=5, index=1))
    worker.step()  # both prompts, both first tokens
    both = worker.step()  # sequences of 10 and 6 tokens decode
    assert both.kv_share == pytest.approx((10 + 6) / 400)
    assert worker.cache.active == 3 + 2  # blocks held: the old share would have been 5 / 100
    worker.submit(request(list(range(200, 240)), output=2, index=2))
    with_prompt = worker.step()  # a 40-token prompt beside the two decodes
    assert with_prompt.prefill_tokens == 40
    assert with_prompt.kv_share == pytest.approx((11 + 7) / 400)


def test_the_timed_prefill_rounds_the_chunks_mean_positions_as_the_reference_does() -> None:
    # Two chunks: the end of a prompt (tokens 15,575 to 20,000) and a new prompt's first 3,766 tokens.
    # The reference's mocker times them as 2 x (23,766 // 2 - 15,575 // 2) = 8,192 tokens, one more
    # than computed; measured there: the pass lasts prefill(8192) + decode(p), 0.022 ms more.
    assert EngineParams.timed_prefill_tokens(2, 20_000 + 3_766, 15_575) == 8_192
    assert EngineParams.timed_prefill_tokens(2, 36_640 + 5_115, 33_564) == 8_190  # and one fewer
    assert EngineParams.timed_prefill_tokens(1, 5_000, 1_000) == 4_000  # one chunk: exact
    assert EngineParams.timed_prefill_tokens(0, 0, 0) == 0
    params = EngineParams(block_size=BS, num_blocks=100, max_batched_tokens=7, max_running=8)
    worker = WorkerEngine(params)
    worker.submit(request(list(range(10)), output=2, index=0))
    assert worker.step().duration_ms == pytest.approx(params.prefill_time(7))  # tokens 0-6 of the first prompt
    worker.submit(request(list(range(100, 120)), output=2, index=1))
    both = worker.step()  # tokens 7-9 of the first prompt, 0-3 of the second: ends 10 + 4, starts 7 + 0
    assert both.prefill_tokens == 7
    assert both.duration_ms == pytest.approx(params.prefill_time(2 * (14 // 2 - 7 // 2)))  # timed as 8


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
