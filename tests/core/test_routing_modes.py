"""Routing modes and the knobs of the seed kv-cache-routing.md on the pure core: kv (default), round_robin,
random, direct, least_loaded; overlap_score_weight 0 (pure load), active-block tracking off, output-block
tracking; their configuration from the environment and per request."""

from __future__ import annotations

import attrs
import pytest

from kvrouter.actors.core.commands import (
    AddOutputBlock,
    Prompt,
    Reserve,
    SelectionOptions,
    SelectWorker,
    UpsertWorker,
)
from kvrouter.actors.core.decisions import Reason
from kvrouter.actors.core.events import RequestAdded
from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.core.router_config import InvalidSettings, RouterConfig, RouterConfigOverride, from_env
from kvrouter.actors.core.routing_modes import MODES, choose_without_cost, parse_mode
from kvrouter.actors.core.selection import RankCandidate
from kvrouter.actors.core.slots import expected_decay
from tests.core.test_scope_parts import TOKENS, Scope, record

A, B, C = WorkerRank(1, 0), WorkerRank(2, 0), WorkerRank(2, 1)


def ranks(*loads: tuple[int, int, int]) -> list[RankCandidate]:
    """Candidates A, B, C (in reverse order, to show the input order does not matter) with (requests,
    prefill tokens, decode blocks)."""
    out = [
        RankCandidate(rank, active_requests=r, active_prefill_tokens=p, active_decode_blocks=d)
        for rank, (r, p, d) in zip((A, B, C), loads, strict=True)
    ]
    return out[::-1]


@pytest.mark.parametrize(
    ("mode", "draw", "turn", "expected"),
    [
        ("round_robin", 0.9, 0, A),  # (worker, rank) order, the turn-th modulo the count
        ("round_robin", 0.9, 1, B),
        ("round_robin", 0.0, 2, C),
        ("round_robin", 0.0, 3, A),
        ("random", 0.0, 7, A),  # three equal slices of [0, 1)
        ("random", 0.34, 7, B),
        ("random", 0.999, 7, C),
        ("least_loaded", 0.0, 0, B),  # fewest requests first
    ],
)
def test_modes_without_a_cost(mode: str, draw: float, turn: int, expected: WorkerRank) -> None:
    assert choose_without_cost(mode, ranks((2, 0, 0), (1, 50, 9), (2, 0, 0)), draw=draw, turn=turn) == expected


@pytest.mark.parametrize(
    ("loads", "draw", "expected"),
    [
        (((1, 10, 5), (1, 5, 9), (1, 5, 7)), 0.0, C),  # equal requests: fewest prefill tokens, then decode blocks
        (((0, 0, 0), (0, 0, 0), (1, 0, 0)), 0.0, A),  # a tie is drawn uniformly
        (((0, 0, 0), (0, 0, 0), (1, 0, 0)), 0.5, B),
    ],
)
def test_least_loaded(loads: tuple[tuple[int, int, int], ...], draw: float, expected: WorkerRank) -> None:
    assert choose_without_cost("least_loaded", ranks(*loads), draw=draw, turn=0) == expected


def test_mode_names_accept_dynamos_dashes() -> None:
    assert [parse_mode(m) for m in ("kv", "round-robin", "Round_Robin", "least-loaded", "direct", "random")] == [
        "kv",
        "round_robin",
        "round_robin",
        "least_loaded",
        "direct",
        "random",
    ]
    assert parse_mode("fastest") is None
    assert MODES == ("kv", "round_robin", "random", "direct", "least_loaded", "kv_ttft")


# -- through decide -----------------------------------------------------------------------------------


def two_workers() -> Scope:
    """Worker 1 caches the prompt's first 3 blocks and carries one booking (2 decode blocks, prefill done);
    worker 2 is cold and idle. For the 8-block prompt, kv costs worker 1 32/4 - 3 + 2 + 8 = 15 and worker 2
    32/4 + 8 = 16."""
    s = Scope()
    s.ok(UpsertWorker(record(1)))
    s.ok(UpsertWorker(record(2)))
    s.store(1, (11, 12, 13), TOKENS[:12])
    s.ok(Reserve("busy", 1, 0, (1, 2), isl_tokens=8, effective_prefill_tokens=0))
    return s


def select(config: RouterConfig, *, draw: float = 0.0, turn: int = 0, **options: object) -> SelectWorker:
    return SelectWorker(Prompt(TOKENS), config, SelectionOptions(**options), draw=draw, turn=turn)  # type: ignore[arg-type]


def booking(command: SelectWorker, reservation_id: str) -> SelectWorker:
    return attrs.evolve(command, reserve=True, reservation_id=reservation_id)


def chosen(s: Scope, command: SelectWorker) -> int:
    return s.ok(command).reply.worker_id  # type: ignore[no-any-return]


def test_kv_mode_prefers_the_cache_and_round_robin_ignores_it() -> None:
    s = two_workers()
    assert chosen(s, select(RouterConfig())) == 1
    rr = RouterConfig(router_mode="round_robin")
    assert [chosen(s, select(rr, turn=t)) for t in range(4)] == [1, 2, 1, 2]


def test_random_mode_draws_uniformly_over_the_eligible_ranks() -> None:
    s = two_workers()
    config = RouterConfig(router_mode="random")
    assert [chosen(s, select(config, draw=d)) for d in (0.0, 0.49, 0.5, 0.99)] == [1, 1, 2, 2]
    assert chosen(s, select(config, draw=0.0, allowed_worker_ids=frozenset({2}))) == 2  # eligibility first


def test_least_loaded_mode_takes_the_idle_worker_despite_its_cold_cache() -> None:
    assert chosen(two_workers(), select(RouterConfig(router_mode="least_loaded"), draw=0.0)) == 2


def test_direct_mode_needs_a_pin_and_the_pin_must_be_eligible() -> None:
    s = two_workers()
    direct = RouterConfig(router_mode="direct")
    assert s.rejected(select(direct), Reason.INVALID) == "router_mode direct needs pinned_worker {worker_id, dp_rank}"
    assert chosen(s, select(direct, pinned_worker=(2, 0))) == 2
    message = s.rejected(select(direct, pinned_worker=(2, 0), required_taints=frozenset({"gpu"})), Reason.UNAVAILABLE)
    assert "[gpu]" in message
    assert "allowed worker set" in s.rejected(
        select(direct, pinned_worker=(2, 0), allowed_worker_ids=frozenset({1})), Reason.INVALID
    )


def test_overlap_score_weight_zero_is_pure_load_balancing() -> None:
    """Worker 1 holds 3 of the 8 prompt blocks but 2 booked blocks: with the cache it wins, without it the idle
    worker 2 does: 10 decode blocks against 8 (behaviour.md#cost: weight 0 sets prefill_load_scale 0 and the credit
    0)."""
    s = two_workers()
    assert chosen(s, select(RouterConfig())) == 1
    pure_load = RouterConfigOverride(overlap_score_weight=0.0).apply(RouterConfig())
    assert (pure_load.prefill_load_scale, pure_load.overlap_score_credit) == (0.0, 0.0)
    assert chosen(s, select(pure_load)) == 2
    assert from_env({"DYN_ROUTER_KV_OVERLAP_SCORE_WEIGHT": "0"}) == pure_load


def test_without_active_block_tracking_a_booking_holds_no_decode_blocks() -> None:
    s = two_workers()
    before = s.decode_blocks(2)
    untracked = RouterConfig(router_track_active_blocks=False)
    accepted = s.ok(booking(select(untracked, allowed_worker_ids=frozenset({2})), "p"))
    (booked,) = [e for e in accepted.events if isinstance(e, RequestAdded)]
    assert booked.sequence_hashes == () and booked.prefill_tokens == len(TOKENS)
    assert s.decode_blocks(2) == before == 0
    assert accepted.reply.potential_decode_blocks == 0  # nothing projected either
    tracked = s.ok(booking(select(RouterConfig(), allowed_worker_ids=frozenset({2})), "q"))
    assert tracked.reply.potential_decode_blocks == 8 and s.decode_blocks(2) == 8


@pytest.mark.parametrize(
    ("so_far", "expected"),
    [(0, 1 - 1 / 64), (1, 1 - 17 / 64), (3, 1 - 49 / 64), (4, 0.0), (9, 0.0)],
)
def test_output_block_decay_follows_the_expected_output_length(so_far: int, expected: float) -> None:
    # Dynamo's frontend: f = max(0, 1 - generated / expected), at the first token of each new block.
    assert expected_decay(so_far, 16, 64) == pytest.approx(expected)


def test_output_block_tracking_derives_the_decay_from_expected_output_tokens() -> None:
    s = Scope()
    s.ok(UpsertWorker(record(1)))
    tracking = RouterConfig(router_track_output_blocks=True)
    booked = s.ok(booking(select(tracking, expected_output_tokens=8), "r"))  # 8 blocks of 4
    assert [e.expected_output_tokens for e in booked.events if isinstance(e, RequestAdded)] == [8]
    assert s.decode_blocks() == 8
    outputs = s.state.slots.ranks[WorkerRank(1, 0)].outputs
    s.ok(AddOutputBlock("r"))  # 1 token of 8 generated: every block at 7/8
    assert outputs["r"] == (1, 7 / 8, 0)
    s.ok(AddOutputBlock("r"))  # 5 of 8: 3/8
    s.ok(AddOutputBlock("r"))  # 9 of 8: 0
    assert outputs["r"] == (3, 0.0, 0)
    s.ok(AddOutputBlock("r", decay_fraction=0.5))  # the client's fraction wins
    assert outputs["r"] == (4, 0.5, 0)
    # booked without the knob (the expected length is not kept), or without an expected length: a block
    # weighs 1, as in 1.6.1
    s.ok(booking(select(RouterConfig(), expected_output_tokens=8), "untracked"))
    s.ok(Reserve("plain", 1, 0, (1,), isl_tokens=4))
    s.ok(AddOutputBlock("untracked"))
    s.ok(AddOutputBlock("plain"))
    assert (outputs["untracked"], outputs["plain"]) == ((0, 1.0, 1), (0, 1.0, 1))


# -- configuration ------------------------------------------------------------------------------------


def test_modes_and_tracking_knobs_come_from_the_environment() -> None:
    config = from_env(
        {
            "DYN_ROUTER_MODE": "round-robin",
            "DYN_ROUTER_TRACK_ACTIVE_BLOCKS": "false",
            "DYN_ROUTER_TRACK_OUTPUT_BLOCKS": "0",
        }
    )
    assert (config.router_mode, config.router_track_active_blocks, config.router_track_output_blocks) == (
        "round_robin",
        False,
        False,
    )


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        ({"DYN_ROUTER_MODE": "fastest"}, "DYN_ROUTER_MODE='fastest' is not a router mode"),
        (
            {"DYN_ROUTER_TRACK_ACTIVE_BLOCKS": "false", "DYN_ROUTER_TRACK_OUTPUT_BLOCKS": "true"},
            "output-block tracking requires active-block tracking "
            "(DYN_ROUTER_TRACK_OUTPUT_BLOCKS, DYN_ROUTER_TRACK_ACTIVE_BLOCKS)",
        ),
    ],
)
def test_bad_mode_settings_are_refused_by_name(env: dict[str, str], problem: str) -> None:
    with pytest.raises(InvalidSettings, match=problem.replace("(", r"\(").replace(")", r"\)")):
        from_env(env)


def test_a_request_can_switch_active_and_output_block_tracking() -> None:
    config = RouterConfigOverride(track_active_blocks=False).apply(RouterConfig())
    assert (config.router_track_active_blocks, config.router_track_output_blocks) == (False, False)
    assert RouterConfigOverride(track_output_blocks=True).apply(RouterConfig()).router_track_output_blocks
