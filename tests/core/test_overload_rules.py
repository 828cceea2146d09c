"""Table tests of overload thresholds and queue ordering (behaviour.md#eligibility-busy-ranks-and-queueing), on the
pure core."""

from __future__ import annotations

import pytest

from kvrouter.actors.core.admission import Busy, RankLoad, Waiting, busy_because, queue_key
from kvrouter.actors.core.catalog import WorkerRecord, not_schedulable_reasons
from kvrouter.actors.core.commands import (
    Prompt,
    ReleaseReservation,
    SelectionOptions,
    SelectWorker,
    UpsertWorker,
)
from kvrouter.actors.core.decide import decide
from kvrouter.actors.core.decisions import Accepted, Reason, Rejected
from kvrouter.actors.core.evolve import fold
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.invariants import check
from kvrouter.actors.core.router_config import InvalidSettings, RouterConfig, from_env
from kvrouter.actors.core.state import ScopeState

SCOPE = ScopeKey("llama", "default")
SECOND = 1_000_000_000
OFF = RouterConfig()


@pytest.mark.parametrize(
    ("config", "load", "busy"),
    [
        (OFF, RankLoad(10**9, 10**9, 1, 1), None),  # no threshold: never busy
        # decode blocks, as a fraction of the rank's total_kv_blocks (strictly above)
        (RouterConfig(active_decode_blocks_threshold=0.5), RankLoad(0, 50, total_kv_blocks=100), None),
        (RouterConfig(active_decode_blocks_threshold=0.5), RankLoad(0, 51, total_kv_blocks=100), Busy.DECODE_BLOCKS),
        (RouterConfig(active_decode_blocks_threshold=0.5), RankLoad(0, 10**6), None),  # capacity unknown
        (RouterConfig(active_decode_blocks_threshold=0.0), RankLoad(0, 1, total_kv_blocks=100), Busy.DECODE_BLOCKS),
        # absolute prefill tokens
        (RouterConfig(active_prefill_tokens_threshold=100), RankLoad(100, 0), None),
        (RouterConfig(active_prefill_tokens_threshold=100), RankLoad(101, 0), Busy.PREFILL_TOKENS),
        # prefill tokens as a fraction of max_num_batched_tokens
        (RouterConfig(active_prefill_tokens_threshold_frac=1.5), RankLoad(150, 0, max_num_batched_tokens=100), None),
        (
            RouterConfig(active_prefill_tokens_threshold_frac=1.5),
            RankLoad(151, 0, max_num_batched_tokens=100),
            Busy.PREFILL_FRACTION,
        ),
        (RouterConfig(active_prefill_tokens_threshold_frac=1.5), RankLoad(10**6, 0), None),  # capacity unknown
        # the queue threshold, as 1.6.1's queue condition (12 > 1.0 x 10 waits; 10 does not)
        (RouterConfig(router_queue_threshold=1.0), RankLoad(10, 0, max_num_batched_tokens=10), None),
        (RouterConfig(router_queue_threshold=1.0), RankLoad(12, 0, max_num_batched_tokens=10), Busy.QUEUE),
        # the first rule broken is named
        (
            RouterConfig(active_decode_blocks_threshold=0.1, active_prefill_tokens_threshold=1),
            RankLoad(5, 50, total_kv_blocks=100),
            Busy.DECODE_BLOCKS,
        ),
    ],
)
def test_busy_thresholds(config: RouterConfig, load: RankLoad, busy: Busy | None) -> None:
    assert busy_because(load, config) is busy


def test_threshold_settings_are_validated() -> None:
    config = from_env(
        {
            "DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD": "0.9",
            "DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD": "8192",
            "DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD_FRAC": "1.5",
            "DYN_ROUTER_QUEUE_THRESHOLD": "2",
            "DYN_ROUTER_QUEUE_POLICY": "WSPT",
        }
    )
    assert (config.active_decode_blocks_threshold, config.active_prefill_tokens_threshold) == (0.9, 8192.0)
    assert (config.active_prefill_tokens_threshold_frac, config.router_queue_threshold) == (1.5, 2.0)
    assert config.router_queue_policy == "wspt" and config.queueing
    with pytest.raises(InvalidSettings) as raised:
        from_env({"DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD": "1.5", "DYN_ROUTER_QUEUE_POLICY": "sjf"})
    assert raised.value.problems == (
        "DYN_ACTIVE_DECODE_BLOCKS_THRESHOLD='1.5' must be between 0 and 1",
        "DYN_ROUTER_QUEUE_POLICY='sjf' must be one of fcfs, lcfs, wspt",
    )


def order(policy: str, waiting: list[Waiting]) -> list[int]:
    return [w.sequence for w in sorted(waiting, key=lambda w: queue_key(policy, w))]


# Three requests 0.3 s apart, like the 1.6.1 probes: sequence, arrival, prompt length, priority jump.
ARRIVALS = [Waiting(0, 0, 20), Waiting(300_000_000, 1, 16), Waiting(600_000_000, 2, 12)]


@pytest.mark.parametrize(
    ("policy", "waiting", "expected"),
    [
        ("fcfs", ARRIVALS, [0, 1, 2]),
        ("lcfs", ARRIVALS, [2, 1, 0]),
        ("wspt", ARRIVALS, [2, 1, 0]),  # 12, 16, then 20 tokens (1.6.1's order)
        # a jump of 5 s moves a later request first in fcfs; 0.1 s does not (1.6.1 probes)
        ("fcfs", [Waiting(0, 0, 12), Waiting(300_000_000, 1, 16, 5.0), Waiting(600_000_000, 2, 20)], [1, 0, 2]),
        ("fcfs", [Waiting(0, 0, 12), Waiting(300_000_000, 1, 16, 0.1), Waiting(600_000_000, 2, 20)], [0, 1, 2]),
        # lcfs: a jump counts as arriving later
        ("lcfs", [Waiting(0, 0, 12, 1.0), Waiting(300_000_000, 1, 16)], [0, 1]),
        # wspt: a jump weighs a prompt up (6/16 beats 1/12, as 1.6.1 admitted it first)
        ("wspt", [Waiting(0, 0, 12), Waiting(300_000_000, 1, 16, 5.0), Waiting(600_000_000, 2, 20)], [1, 0, 2]),
        # ties go to the earlier arrival, in every policy but lcfs
        ("wspt", [Waiting(5, 1, 10), Waiting(5, 0, 10)], [0, 1]),
        ("fcfs", [Waiting(5, 1, 10), Waiting(5, 0, 10)], [0, 1]),
        ("lcfs", [Waiting(5, 0, 10), Waiting(5, 1, 10)], [1, 0]),
    ],
)
def test_queue_policies(policy: str, waiting: list[Waiting], expected: list[int]) -> None:
    assert order(policy, waiting) == expected


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown queue policy"):
        queue_key("random", ARRIVALS[0])


# -- through decide ---------------------------------------------------------------------------------


class Scope:
    def __init__(self, use_kv_events: bool = False) -> None:
        self.state = ScopeState(SCOPE)
        self.use_kv_events = use_kv_events

    def run(self, command):
        decision = decide(self.state, command)
        if isinstance(decision, Accepted):
            fold(self.state, decision.events)
        assert check(self.state) == []
        return decision

    def worker(self, worker_id: int, **fields) -> None:
        record = WorkerRecord(worker_id, "llama", "default", endpoint=f"http://w{worker_id}", block_size=4, **fields)
        assert isinstance(self.run(UpsertWorker(record, use_kv_events=self.use_kv_events)), Accepted)

    def select(self, config: RouterConfig, tokens: int, reservation_id: str | None = None, **options):
        command = SelectWorker(
            Prompt(
                token_ids=tuple(
                    range(1000 * len(self.state.slots.requests), 1000 * len(self.state.slots.requests) + tokens)
                )
            ),
            config,
            SelectionOptions(**options),
            reserve=reservation_id is not None,
            reservation_id=reservation_id,
        )
        return self.run(command)


def test_busy_ranks_are_left_out_and_all_busy_is_overloaded() -> None:
    config = RouterConfig(use_kv_events=False, active_prefill_tokens_threshold=10)
    s = Scope()
    s.worker(1)
    s.worker(2)
    first = s.select(config, 12, "a")
    assert isinstance(first, Accepted)
    busy_worker = first.reply.worker_id
    for attempt in range(4):  # the busy worker is never chosen while the other is free
        chosen = s.select(config, 4)
        assert isinstance(chosen, Accepted) and chosen.reply.worker_id != busy_worker, attempt
    assert isinstance(s.select(config, 12, "b"), Accepted)  # now both are busy
    refused = s.select(config, 4, "c")
    assert isinstance(refused, Rejected) and refused.reason is Reason.OVERLOADED
    assert refused.message == "all 2 eligible workers are overloaded"
    s.run(ReleaseReservation("a"))
    assert isinstance(s.select(config, 4, "c"), Accepted)


def test_overload_is_judged_after_the_request_filters() -> None:
    """A request limited to a busy worker is overloaded even while another worker is free."""
    config = RouterConfig(use_kv_events=False, active_prefill_tokens_threshold=10)
    s = Scope()
    s.worker(1)
    s.worker(2)
    assert isinstance(s.select(config, 12, "a", pinned_worker=(1, 0)), Accepted)
    refused = s.select(config, 4, allowed_worker_ids=frozenset({1}))
    assert isinstance(refused, Rejected) and refused.message == "all 1 eligible workers are overloaded"
    assert isinstance(s.select(config, 4, allowed_worker_ids=frozenset({2})), Accepted)


def test_queueing_needs_max_num_batched_tokens() -> None:
    """1.6.1: with queueing on, a worker without max_num_batched_tokens is incomplete."""
    record = WorkerRecord(1, endpoint="http://w", block_size=4)
    reasons = not_schedulable_reasons(record, use_kv_events=False, partition_block_size=4, queueing=True)
    assert reasons == ["max_num_batched_tokens is required while queueing is enabled"]
    assert not_schedulable_reasons(record, use_kv_events=False, partition_block_size=4) == []
    s = Scope()
    s.worker(1)
    refused = s.select(RouterConfig(use_kv_events=False, router_queue_threshold=1.0), 4)
    assert isinstance(refused, Rejected) and refused.reason is Reason.UNAVAILABLE


def test_the_queue_threshold_makes_a_rank_busy_above_its_batch_budget() -> None:
    config = RouterConfig(use_kv_events=False, router_queue_threshold=1.0)
    s = Scope()
    s.worker(1, max_num_batched_tokens=10)
    assert isinstance(s.select(config, 10, "a"), Accepted)  # 10 is not above 1.0 x 10
    assert isinstance(s.select(config, 2, "b"), Accepted)  # 10 still is not: now 12
    refused = s.select(config, 4, "c")
    assert isinstance(refused, Rejected) and refused.reason is Reason.OVERLOADED


def test_a_reservation_id_already_booked_is_a_conflict_even_when_every_rank_is_busy() -> None:
    """The shell queues an overloaded booking; one whose id is already booked must not wait (10 s, then
    429) for capacity it can never use: it is refused at once with 409, as when a rank is free."""
    config = RouterConfig(use_kv_events=False, router_queue_threshold=1.0)
    s = Scope()
    s.worker(1, max_num_batched_tokens=10)
    assert isinstance(s.select(config, 12, "a"), Accepted)  # the only rank is busy from now on
    duplicate = s.select(config, 12, "a")
    assert isinstance(duplicate, Rejected) and duplicate.reason is Reason.CONFLICT
    fresh = s.select(config, 4, "b")
    assert isinstance(fresh, Rejected) and fresh.reason is Reason.OVERLOADED
