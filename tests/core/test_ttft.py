"""The kv_ttft routing mode on the pure core: the prefill-time model (prior, online fit, drift discount), the
per-rank prediction (queue progress, cache, decode interference), the pick (near ties toward cache, then the
draw), and decide_select with router_mode kv_ttft; kv's choices do not change."""

from __future__ import annotations

import pytest

from kvrouter.actors.core.commands import (
    CompleteReservationPrefill,
    IngestKvBatch,
    Prompt,
    Reserve,
    SelectWorker,
    UpsertWorker,
)
from kvrouter.actors.core.decisions import Accepted, Rejected
from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.core.kv_wire import BlockStored, KvBatch
from kvrouter.actors.core.router_config import RouterConfig, parse_router_mode
from kvrouter.actors.core.selection import RankCandidate
from kvrouter.actors.core.selection_queries import candidates, selection_input
from kvrouter.actors.core.ttft_cost import LOAD_FACTOR, TIE_MS, TtftTerms, pick_fastest, predict
from kvrouter.actors.core.ttft_model import (
    DEFAULT_BATCH_TOKENS,
    NO_VIEW,
    PRIOR,
    PrefillModel,
    PrefillRates,
    RankTiming,
    TtftView,
)
from tests.core.test_scope_parts import TOKENS, Scope, record

A, B, C = WorkerRank(1, 0), WorkerRank(2, 0), WorkerRank(3, 0)
MS = 1_000_000  # ns
TTFT = RouterConfig(router_mode="kv_ttft")


# -- the model -----------------------------------------------------------------------------------------------


def test_the_time_of_a_prompt_counts_passes_tokens_and_decode_interference() -> None:
    rates = PrefillRates(ms_per_pass=20.0, ms_per_token=0.02, decode_ms_per_pass=50.0)
    assert rates.compute_ms(0, 8192) == 0.0
    assert rates.compute_ms(1000, 8192) == pytest.approx(20.0 + 20.0)
    assert rates.compute_ms(8193, 8192) == pytest.approx(2 * 20.0 + 8193 * 0.02)  # two passes
    assert rates.decode_ms(1000, 8192, 0.5) == pytest.approx(25.0)
    assert rates.decode_ms(1000, 8192, 0.0) == 0.0
    assert rates.tokens_per_s(8192) == pytest.approx(1000 / (0.02 + 20 / 8192))


def test_a_rank_without_samples_predicts_with_the_prior() -> None:
    model = PrefillModel()
    assert model.view().timing(A) == RankTiming(A)
    assert RankTiming(A).rates == PRIOR


def feed(model: PrefillModel, rank: WorkerRank, truth: PrefillRates, count: int, start: int = 0) -> int:
    """``count`` requests booked one at a time on an idle rank, each taking what ``truth`` says; returns the
    time after the last."""
    at = start
    for i in range(count):
        tokens = 500 + (i * 977) % 12_000  # sizes spread over one to two passes
        share = (i % 5) / 10
        duration = truth.compute_ms(tokens, DEFAULT_BATCH_TOKENS) + truth.decode_ms(tokens, DEFAULT_BATCH_TOKENS, share)
        request = f"{rank.worker_id}-{start}-{i}"
        model.booked(request, rank, at, tokens, share)
        at += round(duration * MS)
        model.completed(request, at, DEFAULT_BATCH_TOKENS)
        model.reported(request, None)
        at += 5 * MS
    return at


def test_the_fit_follows_a_rank_slower_than_the_prior() -> None:
    truth = PrefillRates(ms_per_pass=30.0, ms_per_token=0.05, decode_ms_per_pass=80.0)
    model = PrefillModel()
    feed(model, A, truth, 201)
    row = model.view().timing(A)
    assert row.samples == 200  # the last one waits for a later completion (its reports may still come)
    assert row.rates.tokens_per_s(DEFAULT_BATCH_TOKENS) == pytest.approx(
        truth.tokens_per_s(DEFAULT_BATCH_TOKENS), rel=0.05
    )
    for tokens in (1000, 6000, 16000):
        expected = truth.compute_ms(tokens, DEFAULT_BATCH_TOKENS)
        assert row.rates.compute_ms(tokens, DEFAULT_BATCH_TOKENS) == pytest.approx(expected, rel=0.1)
    assert model.view().timing(B) == RankTiming(B)  # another rank keeps the prior


def test_without_the_fit_the_prior_stays() -> None:
    model = PrefillModel(fit=False)
    feed(model, A, PrefillRates(30.0, 0.05, 80.0), 20)
    assert model.view().timing(A).rates == PRIOR


def test_a_sample_is_taken_only_when_nothing_booked_earlier_is_still_computing() -> None:
    model = PrefillModel()
    model.booked("first", A, 0, 4000, 0.0)
    model.booked("second", A, 1 * MS, 4000, 0.0)
    model.completed("second", 50 * MS, DEFAULT_BATCH_TOKENS)  # out of order: "first" still computes
    model.completed("first", 60 * MS, DEFAULT_BATCH_TOKENS)
    model.booked("third", A, 70 * MS, 4000, 0.0)
    model.completed("third", 150 * MS, DEFAULT_BATCH_TOKENS)
    row = model.view().timing(A)
    assert row.samples == 1 and row.last_prefill_done_at == 150 * MS  # "first" counted, "second" did not


def test_a_sample_starts_at_the_previous_completion_when_that_came_later() -> None:
    model = PrefillModel()
    model.booked("a", A, 0, 8000, 0.0)
    model.booked("b", A, 0, 8000, 0.0)
    model.completed("a", 400 * MS, DEFAULT_BATCH_TOKENS)
    outcome = model.completed("b", 800 * MS, DEFAULT_BATCH_TOKENS)
    assert outcome is not None and outcome.realised_ms == 800.0  # the request's TTFT as the router saw it
    sample = model._pending[A]
    assert (sample.start, sample.end, list(sample.members)) == (400 * MS, 800 * MS, ["b"])


def test_prefills_completed_by_one_pass_are_one_sample() -> None:
    model = PrefillModel()
    for request in ("a", "b", "c"):
        model.booked(request, A, 0, 1000, 0.0)
        model.predicted(request, None, cached_tokens=500, cacheable=1400)
    for request in ("a", "b", "c"):
        model.completed(request, 90 * MS, DEFAULT_BATCH_TOKENS)
        model.reported(request, 100)  # 400 tokens fewer cached than predicted: 1,400 computed
    sample = model._pending[A]
    assert (sample.start, sample.end, sample.tokens()) == (0, 90 * MS, 3 * 1400)
    model.booked("d", A, 95 * MS, 1000, 0.0)
    model.completed("d", 150 * MS, DEFAULT_BATCH_TOKENS)
    assert model.view().timing(A).samples == 1


def test_drift_discounts_a_rank_whose_reports_fall_short_and_recovers_when_they_agree() -> None:
    model = PrefillModel()
    for i in range(5):
        model.booked(f"r{i}", A, i * MS, 100, 0.0)
        model.predicted(f"r{i}", 50.0, cached_tokens=1000, cacheable=1024)
        model.completed(f"r{i}", i * MS + 1, DEFAULT_BATCH_TOKENS)
        model.reported(f"r{i}", 0)  # nothing was cached
    low = model.view().timing(A).overlap_factor
    assert low == pytest.approx(0.8**5)
    for i in range(5, 60):
        model.booked(f"r{i}", A, i * MS, 100, 0.0)
        model.predicted(f"r{i}", 50.0, cached_tokens=1024, cacheable=1023)  # the engine always computes one
        model.completed(f"r{i}", i * MS + 1, DEFAULT_BATCH_TOKENS)
        model.reported(f"r{i}", 1023)
    assert model.view().timing(A).overlap_factor == 1.0


def test_without_the_drift_discount_the_factor_stays_one() -> None:
    model = PrefillModel(drift=False)
    model.booked("r", A, 0, 100, 0.0)
    model.predicted("r", 50.0, cached_tokens=1000, cacheable=1024)
    model.completed("r", MS, DEFAULT_BATCH_TOKENS)
    model.reported("r", 0)
    assert model.view().timing(A).overlap_factor == 1.0


def test_bookings_are_bounded_and_released_or_removed_ones_are_forgotten() -> None:
    model = PrefillModel(max_bookings=2)
    for request in ("a", "b", "c"):
        model.booked(request, A, 0, 10, 0.0)
    assert model.in_flight == 2 and model.forgotten == 1
    assert model.completed("a", MS, DEFAULT_BATCH_TOKENS) is None  # forgotten at the cap
    model.released("b")
    assert model.completed("b", MS, DEFAULT_BATCH_TOKENS) is None
    model.rank_removed(A)
    assert model.in_flight == 0


# -- the prediction ------------------------------------------------------------------------------------------


def warm_scope() -> Scope:
    """Three idle workers with 8 KV blocks of 4 tokens... except that worker 1 caches TOKENS' first 6 blocks."""
    s = Scope()
    for worker in (1, 2, 3):
        s.ok(UpsertWorker(record(worker, max_num_batched_tokens=16, total_kv_blocks=64)))
    s.store(1, (11, 12, 13, 14, 15, 16), TOKENS[:24])
    return s


def terms(s: Scope, rank: WorkerRank, *, at: int, view: TtftView = NO_VIEW, isl: int = 32) -> TtftTerms:
    candidate = next(c for c in candidates_of(s) if c.rank == rank)
    return predict(s.state, candidate, view.timing(rank), isl=isl, block_size=4, config=TTFT, at=at, view=view)


def candidates_of(s: Scope) -> list[RankCandidate]:
    request = selection_input(s.state, Prompt(token_ids=TOKENS), True, queueing=False)
    assert not isinstance(request, Rejected)
    return candidates(s.state, request, predicted_ranks=frozenset(), all_predicted=False)


def test_a_cached_prefix_shortens_the_own_prefill() -> None:
    s = warm_scope()
    warm, cold = terms(s, A, at=0), terms(s, B, at=0)
    assert (warm.cached_tokens, warm.new_tokens) == (24, 8)
    assert (cold.cached_tokens, cold.new_tokens) == (0, 32)
    assert warm.prefill_ms == pytest.approx(PRIOR.compute_ms(8, 16))
    assert warm.queue_ms == cold.queue_ms == warm.decode_ms == warm.load_ms == 0.0  # idle ranks
    assert warm.ttft_ms == warm.cost_ms < cold.ttft_ms


def test_the_queue_is_what_is_booked_ahead_less_what_the_rank_computed_since() -> None:
    s = warm_scope()
    s.ok(Reserve("ahead", 2, 0, (1, 2), isl_tokens=1000, at=0))
    s.ok(Reserve("behind", 2, 0, (1, 2), isl_tokens=600, at=0))
    share = 2 / 64  # the two bookings hold two decode blocks of the rank's 64
    now = terms(s, B, at=0)
    assert now.queued_tokens == 1600
    in_flight = PRIOR.in_flight_ms(16, share)  # the rank is running: the pass in flight ends first
    assert now.queue_ms == pytest.approx(in_flight + PRIOR.compute_ms(1632, 16) - PRIOR.compute_ms(32, 16))
    assert now.decode_ms == pytest.approx(PRIOR.decode_ms(1632, 16, share))
    per_token = PRIOR.ms_per_token + (PRIOR.ms_per_pass + PRIOR.decode_ms_per_pass * share) / 16
    later = terms(s, B, at=round(500 * per_token * MS))
    assert later.queued_tokens == 1100  # 500 tokens of the oldest computed
    much_later = terms(s, B, at=round(5000 * per_token * MS))
    assert much_later.queued_tokens == 600  # never below what is booked behind the oldest
    # The rank's last completion, when later than the oldest booking, is where its progress counts from.
    view = TtftView((RankTiming(B, last_prefill_done_at=round(400 * per_token * MS)),))
    assert terms(s, B, at=round(500 * per_token * MS), view=view).queued_tokens == 1500
    queueless = terms(s, B, at=0, view=TtftView(queue_term=False))
    assert (queueless.queued_tokens, queueless.queue_ms) == (0, 0.0)


def test_decoding_sequences_slow_every_pass_down_and_load_the_rank() -> None:
    s = warm_scope()
    s.ok(Reserve("long", 3, 0, tuple(range(1, 33)), isl_tokens=128, at=0))
    s.ok(CompleteReservationPrefill("long", at=MS))
    busy = terms(s, C, at=MS)
    share = 32 / 64
    assert busy.queued_tokens == 0
    assert busy.queue_ms == pytest.approx(PRIOR.in_flight_ms(0, share))
    assert busy.decode_ms == pytest.approx(PRIOR.decode_ms(32, 16, share))
    assert busy.load_ms == pytest.approx(LOAD_FACTOR * 32 * 4 * PRIOR.ms_per_token)
    assert busy.cost_ms == pytest.approx(busy.ttft_ms + busy.load_ms)
    assert terms(s, C, at=MS, view=TtftView(load_term=False)).load_ms == 0.0


def test_drift_discounts_the_cached_prefix() -> None:
    s = warm_scope()
    view = TtftView((RankTiming(A, overlap_factor=0.5),))
    assert terms(s, A, at=0, view=view).cached_tokens == 12


def test_the_engine_always_computes_the_last_token() -> None:
    s = warm_scope()
    s.ok(IngestKvBatch(1, 0, 1, KvBatch(0.0, (BlockStored((17, 18), 16, TOKENS[24:32], 4),))))
    assert terms(s, A, at=0).cached_tokens == 28  # the whole prompt is cached; its last block is computed again


# -- the pick ------------------------------------------------------------------------------------------------


def test_the_fastest_wins_when_it_is_clearly_faster() -> None:
    assert pick_fastest([(A, 300.0, 4000), (B, 100.0, 0), (C, 200.0, 0)], draw=0.9) == 1


def test_near_ties_go_to_the_cache_then_to_the_fastest_then_to_the_draw() -> None:
    rows = [(A, 100.0, 0), (B, 104.0, 64), (C, 100.0 + TIE_MS, 0)]  # within 5 % of the fastest
    assert pick_fastest(rows, draw=0.0) == 1
    rows = [(C, 100.0, 0), (A, 100.0, 0), (B, 101.0, 0)]  # equal cache: the fastest, exact ties by the draw
    assert [rows[pick_fastest(rows, draw=d)][0] for d in (0.0, 0.49, 0.5, 0.99)] == [A, A, C, C]


def test_the_pick_does_not_depend_on_the_order_of_the_rows() -> None:
    rows = [(A, 50.0, 0), (B, 50.0, 0), (C, 50.0, 0)]
    for draw in (0.1, 0.5, 0.9):
        chosen = rows[pick_fastest(rows, draw=draw)][0]
        assert rows[::-1][pick_fastest(rows[::-1], draw=draw)][0] == chosen


# -- decide ------------------------------------------------------------------------------------------------


def select(config: RouterConfig, **kwargs: object) -> SelectWorker:
    return SelectWorker(Prompt(token_ids=TOKENS), config, reserve=True, reservation_id="r", **kwargs)  # type: ignore[arg-type]


def chosen(s: Scope, command: SelectWorker) -> tuple[WorkerRank, float | None]:
    decision = s.run(command)
    assert isinstance(decision, Accepted)
    selection = decision.reply
    return WorkerRank(selection.worker_id, selection.dp_rank), selection.predicted_ttft_ms


def test_kv_ttft_takes_the_cache_while_its_queue_is_short_and_leaves_it_when_it_is_long() -> None:
    s = warm_scope()
    rank, predicted = chosen(s, select(TTFT, at=0, draw=0.0))
    assert rank == A and predicted == pytest.approx(PRIOR.compute_ms(8, 16))
    s = warm_scope()
    s.ok(Reserve("queue", 1, 0, (1, 2), isl_tokens=2000, at=0))  # worker 1: 2,000 tokens to compute first
    rank, predicted = chosen(s, select(TTFT, at=0, draw=0.0))
    assert rank == B and predicted == pytest.approx(PRIOR.compute_ms(32, 16))


def test_kv_ttft_uses_the_rates_the_command_carries() -> None:
    s = warm_scope()
    s.ok(Reserve("queue", 1, 0, (1, 2), isl_tokens=8, at=0))
    assert chosen(s, select(TTFT, at=0, draw=0.0))[0] == A  # 8 tokens ahead cost less than 24 recomputed
    slow = PrefillRates(ms_per_pass=20.0, ms_per_token=2.0, decode_ms_per_pass=0.0)
    fast = PrefillRates(ms_per_pass=1.0, ms_per_token=0.001, decode_ms_per_pass=0.0)
    view = TtftView((RankTiming(A, slow), RankTiming(B, fast), RankTiming(C, fast)))
    s = warm_scope()
    s.ok(Reserve("queue", 1, 0, (1, 2), isl_tokens=8, at=0))
    assert chosen(s, select(TTFT, at=0, draw=0.0, ttft=view))[0] == B


def test_kv_choices_do_not_depend_on_a_ttft_view() -> None:
    view = TtftView((RankTiming(A, PrefillRates(1.0, 10.0, 0.0)),))
    for draw in (0.0, 0.5, 0.99):
        plain, carried = warm_scope(), warm_scope()
        assert chosen(plain, select(RouterConfig(), draw=draw)) == chosen(
            carried, select(RouterConfig(), draw=draw, ttft=view)
        )


def test_the_mode_is_spelled_with_a_dash_or_an_underscore() -> None:
    assert parse_router_mode("kv-ttft") == parse_router_mode("KV_TTFT") == "kv_ttft"
    assert RouterConfig().router_mode == "kv"
