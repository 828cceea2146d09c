"""Predicted blocks (behaviour.md#approximate-mode) and the per-rank fallback to them, on the pure core."""

from __future__ import annotations

import pytest

from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.commands import (
    ExpireStale,
    IngestKvBatch,
    Prompt,
    SelectionOptions,
    SelectWorker,
    UpsertWorker,
)
from kvrouter.actors.core.decide import decide
from kvrouter.actors.core.decisions import Accepted
from kvrouter.actors.core.events import ApproxBlocksBooked, ApproxBlocksExpired
from kvrouter.actors.core.evolve import fold
from kvrouter.actors.core.hashing import block_hashes
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.invariants import check
from kvrouter.actors.core.kv_modes import EXACT, KvMode, RankMode, StreamHealth, rank_mode
from kvrouter.actors.core.kv_wire import BlockStored, KvBatch
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.state import ScopeState

SCOPE = ScopeKey("llama", "default")
SECOND = 1_000_000_000
W1, W2 = WorkerRank(1, 0), WorkerRank(2, 0)


class Scope:
    def __init__(self) -> None:
        self.state = ScopeState(SCOPE)

    def ok(self, command) -> Accepted:
        decision = decide(self.state, command)
        assert isinstance(decision, Accepted), decision
        fold(self.state, decision.events)
        assert check(self.state) == []
        return decision

    def worker(self, worker_id: int, use_kv_events: bool) -> None:
        record = WorkerRecord(
            worker_id, "llama", "default", endpoint=f"http://w{worker_id}", block_size=4,
            kv_events_endpoint=f"tcp://w{worker_id}:5557",
        )  # fmt: skip
        self.ok(UpsertWorker(record, use_kv_events=use_kv_events))

    def book(self, config: RouterConfig, tokens: range, reservation_id: str, at: int = 0, **fields) -> Accepted:
        return self.ok(
            SelectWorker(
                Prompt(token_ids=tuple(tokens)), config, reserve=True, reservation_id=reservation_id, at=at, **fields
            )
        )

    def device_overlap(self, config: RouterConfig, tokens: range, **fields) -> dict[int, int]:
        reply = self.ok(SelectWorker(Prompt(token_ids=tuple(tokens)), config, **fields)).reply
        return reply.worker_id, reply.overlap["gpu"] // 4


APPROX = RouterConfig(use_kv_events=False, router_ttl_secs=120.0)


def pinned(worker_id: int) -> SelectionOptions:
    return SelectionOptions(pinned_worker=(worker_id, 0))


# -- pruning ------------------------------------------------------------------------------------------


def test_bookings_beyond_the_tree_size_prune_the_oldest_down_to_the_target_ratio() -> None:
    config = RouterConfig(use_kv_events=False, router_max_tree_size=10, router_prune_target_ratio=0.5)
    s = Scope()
    s.worker(1, False)
    s.worker(2, False)
    s.book(config, range(0, 8), "a", at=1 * SECOND, options=pinned(1))  # 2 blocks on W1, expire at 121 s
    s.book(config, range(100, 116), "b", at=2 * SECOND, options=pinned(2))  # 4 on W2
    s.book(config, range(200, 212), "c", at=3 * SECOND, options=pinned(1))  # 3 on W1: 9 in all
    assert s.state.selection.approx_count == 9
    events = s.book(config, range(300, 308), "d", at=4 * SECOND, options=pinned(2)).events  # 2 more: 11 > 10
    pruned = [e for e in events if isinstance(e, ApproxBlocksExpired)]
    # down to 5 after the booking: the 6 oldest go, "a" (W1, 2 blocks) then "b" (W2, 4 blocks)
    assert [(e.worker_id, len(e.block_hashes)) for e in pruned] == [(1, 2), (2, 4)]
    assert isinstance(events[-1], ApproxBlocksBooked)
    assert s.state.selection.approx_count == 5
    assert s.state.selection.predicted.block_count() == 5
    assert s.device_overlap(config, range(0, 8), options=pinned(1)) == (1, 0)  # pruned
    assert s.device_overlap(config, range(200, 212), options=pinned(1)) == (1, 3)  # kept


def test_a_rebooked_prompt_is_young_again_and_survives_the_prune() -> None:
    config = RouterConfig(use_kv_events=False, router_max_tree_size=4, router_prune_target_ratio=0.75)
    s = Scope()
    s.worker(1, False)
    s.book(config, range(0, 8), "a", at=1 * SECOND)  # A: 2 blocks
    s.book(config, range(100, 108), "b", at=2 * SECOND)  # B: 2 blocks
    s.book(config, range(0, 8), "a2", at=3 * SECOND)  # A again: now the youngest
    s.book(config, range(200, 204), "c", at=4 * SECOND)  # 5 > 4: down to 3, B (the oldest) goes
    assert s.device_overlap(config, range(0, 8)) == (1, 2)
    assert s.device_overlap(config, range(100, 108)) == (1, 0)


def test_predicted_blocks_expire_after_their_ttl() -> None:
    s = Scope()
    s.worker(1, False)
    s.book(APPROX, range(0, 8), "a", at=0)
    assert s.device_overlap(APPROX, range(0, 12)) == (1, 2)
    assert s.ok(ExpireStale(10**15, at=119 * SECOND)).events == ()
    s.ok(ExpireStale(10**15, at=120 * SECOND))
    assert s.device_overlap(APPROX, range(0, 12)) == (1, 0)
    assert s.state.selection.approx_count == 0


# -- per-rank fallback ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("health", "now", "stale_secs", "expected"),
    [
        (StreamHealth(connected=True), 100 * SECOND, 10, EXACT),
        # silent after a booking: exact until the stale time has passed, then predicted
        (StreamHealth(True, first_unanswered_booking_ns=91 * SECOND), 100 * SECOND, 10, EXACT),
        (
            StreamHealth(True, first_unanswered_booking_ns=90 * SECOND),
            100 * SECOND,
            10,
            RankMode(KvMode.PREDICTED, "no KV events for 10.0 s after a booking"),
        ),
        # no stream: predicted once it has been down the stale time
        (StreamHealth(False, disconnected_since_ns=95 * SECOND), 100 * SECOND, 10, EXACT),
        (
            StreamHealth(False, disconnected_since_ns=80 * SECOND),
            100 * SECOND,
            10,
            RankMode(KvMode.PREDICTED, "no KV-event stream for 20.0 s"),
        ),
        (StreamHealth(False, disconnected_since_ns=None), 100 * SECOND, 10, EXACT),  # not known yet
        # 0 turns the fallback off
        (StreamHealth(False, disconnected_since_ns=0), 100 * SECOND, 0, EXACT),
        (StreamHealth(True, first_unanswered_booking_ns=0), 100 * SECOND, 0, EXACT),
    ],
)
def test_rank_mode(health: StreamHealth, now: int, stale_secs: float, expected: RankMode) -> None:
    assert rank_mode(health, now, stale_secs) == expected


def stored(tokens: range) -> KvBatch:
    hashes = block_hashes(tuple(tokens), 4)
    return KvBatch(
        ts=0.0,
        events=(BlockStored(block_hashes=tuple(1000 + i for i in range(len(hashes))), parent_hash=None,
                            token_ids=tuple(tokens), block_size=4),),
        dp_rank=None,
    )  # fmt: skip


def test_a_stale_rank_is_scored_on_its_bookings_then_on_its_events_again() -> None:
    exact = RouterConfig(use_kv_events=True)
    s = Scope()
    s.worker(1, True)
    # Exact mode: a booking is not a prediction, and an unknown prompt scores nothing.
    events = s.book(exact, range(0, 8), "a", at=0).events
    assert not any(isinstance(e, ApproxBlocksBooked) for e in events)
    assert s.device_overlap(exact, range(0, 8)) == (1, 0)
    # The shell finds the stream stale and says so: bookings become predictions, and score.
    stale = frozenset({W1})
    events = s.book(exact, range(0, 8), "b", at=SECOND, predicted_ranks=stale).events
    assert any(isinstance(e, ApproxBlocksBooked) for e in events)
    assert s.device_overlap(exact, range(0, 12), predicted_ranks=stale) == (1, 2)
    assert s.device_overlap(exact, range(0, 12)) == (1, 0)  # the exact index knows nothing of it
    # Events resume (one block only): back to exact, where the events, not the bookings, count.
    s.ok(IngestKvBatch(1, 0, 1, stored(range(0, 4))))
    assert s.device_overlap(exact, range(0, 12)) == (1, 1)


def test_a_predicted_rank_keeps_what_its_events_last_said_when_that_is_longer() -> None:
    exact = RouterConfig(use_kv_events=True)
    s = Scope()
    s.worker(1, True)
    s.ok(IngestKvBatch(1, 0, 1, stored(range(0, 16))))  # 4 blocks known from events
    stale = frozenset({W1})
    s.book(exact, range(0, 8), "a", predicted_ranks=stale)  # 2 predicted
    assert s.device_overlap(exact, range(0, 16), predicted_ranks=stale) == (1, 4)
