"""Disaggregated prefill/decode selection on the pure core (seed "Disaggregated Serving", topology seed, spec
behaviour.md#constraints-and-disaggregation): the prefill stage KV-aware, the decode stage load-only, the derived
KV-transfer constraint (required fails
closed before anything is booked; preferred weighs), both bookings in one decision, the decode-only fallback,
worker roles in aggregated selections."""

from __future__ import annotations

import pytest

from kvrouter.actors.core.commands import (
    CompleteReservationPrefill,
    Prompt,
    ReleaseReservation,
    Reserve,
    SelectDisaggregated,
    SelectionOptions,
    SelectWorker,
    UpsertWorker,
)
from kvrouter.actors.core.decisions import Reason
from kvrouter.actors.core.disaggregation import (
    DisaggregatedSelection,
    decode_stage_config,
    part_id,
    prefill_stage_config,
)
from kvrouter.actors.core.events import RequestAdded
from kvrouter.actors.core.ids import WorkerRank
from kvrouter.actors.core.router_config import RouterConfig
from tests.core.test_scope_parts import TOKENS, Scope, record

ZONE_A, ZONE_B = "dynamo.topology/zone=a", "dynamo.topology/zone=b"


def cluster(**prefill_fields: object) -> Scope:
    """Prefill workers 1 (zone a, caches the prompt's first 4 blocks) and 2 (zone b, cold); decode workers 3
    (zone a) and 4 (zone b); the decode workers are idle unless a test loads them."""
    s = Scope()
    for worker_id, zone in ((1, "a"), (2, "b")):
        fields = {"worker_role": "prefill", "topology_domains": (("zone", zone),), **prefill_fields}
        s.ok(UpsertWorker(record(worker_id, **fields)))
    for worker_id, zone in ((3, "a"), (4, "b")):
        s.ok(UpsertWorker(record(worker_id, worker_role="decode", topology_domains=(("zone", zone),))))
    s.store(1, (11, 12, 13, 14), TOKENS[:16])
    return s


def disaggregated(
    reservation_id: str = "r", *, config: RouterConfig | None = None, draw: float = 0.0, **options: object
) -> SelectDisaggregated:
    return SelectDisaggregated(
        Prompt(TOKENS),
        config or RouterConfig(),
        reservation_id,
        SelectionOptions(**options),  # type: ignore[arg-type]
        draw=draw,
        decode_draw=draw,
    )


def bookings(s: Scope, command: SelectDisaggregated) -> tuple[DisaggregatedSelection, dict[str, RequestAdded]]:
    accepted = s.ok(command)
    booked = {e.request_id: e for e in accepted.events if isinstance(e, RequestAdded)}
    return accepted.reply, booked


def test_prefill_is_kv_aware_decode_is_load_only_and_both_are_booked_in_one_decision() -> None:
    s = cluster()
    s.ok(Reserve("old", 3, 0, (1, 2, 3), isl_tokens=4, effective_prefill_tokens=0))  # decode 3 is busier
    reply, booked = bookings(s, disaggregated())
    assert reply.prefill is not None and reply.fallback_reason is None
    assert (reply.prefill.worker_id, reply.decode.worker_id) == (1, 4)  # the warm prefill, the idle decode
    assert reply.prefill.effective_prefill_tokens == 32 - 16
    prefill, decode = booked["r:prefill"], booked["r:decode"]
    # prefill: its tokens, no decode blocks; decode: the prompt's 8 blocks, no prefill tokens
    assert (prefill.worker_id, prefill.prefill_tokens, prefill.sequence_hashes) == (1, 16, ())
    assert (decode.worker_id, decode.prefill_tokens, len(decode.sequence_hashes)) == (4, 0, 8)
    assert s.decode_blocks(1) == 0 and s.decode_blocks(4) == 8
    assert s.state.slots.ranks[WorkerRank(1, 0)].prefill_tokens == 16


def test_the_decode_stage_ignores_cached_blocks() -> None:
    """A decode worker holding the whole prompt is not preferred over an idle one with less load."""
    s = cluster()
    s.store(3, (21, 22, 23, 24, 25, 26, 27, 28), TOKENS)
    s.ok(Reserve("old", 3, 0, (1,), isl_tokens=4, effective_prefill_tokens=0))
    reply, _ = bookings(s, disaggregated())
    assert reply.decode.worker_id == 4
    config = decode_stage_config(RouterConfig(host_cache_hit_weight=0.5))
    assert (config.overlap_score_credit, config.host_cache_hit_weight, config.disk_cache_hit_weight) == (0, 0, 0)
    assert not config.router_track_prefill_tokens
    assert not prefill_stage_config(RouterConfig()).router_track_active_blocks


def test_required_transfer_domain_keeps_decode_in_the_prefill_workers_zone() -> None:
    s = cluster(kv_transfer_domain="zone", kv_transfer_enforcement="required")
    s.ok(Reserve("old", 3, 0, (1, 2, 3), isl_tokens=4, effective_prefill_tokens=0))  # zone a's decode is busier
    reply, booked = bookings(s, disaggregated())
    assert (reply.prefill and reply.prefill.worker_id, reply.decode.worker_id) == (1, 3)
    assert reply.decode_constraints.required == {ZONE_A}
    assert set(booked) == {"r:prefill", "r:decode"}


def test_required_transfer_domain_without_a_matching_decode_worker_fails_closed() -> None:
    s = cluster(kv_transfer_domain="zone")  # a domain without an enforcement is required
    s.ok(UpsertWorker(record(3, worker_role="decode", topology_domains=(("zone", "c"),))))
    before = dict(s.state.slots.requests)
    message = s.rejected(disaggregated(), Reason.UNAVAILABLE)
    assert message == (
        "no endpoints available to route work: no eligible decode worker carries [dynamo.topology/zone=a], "
        "which prefill worker 1's kv_transfer_domain requires"
    )
    assert s.state.slots.requests == before  # nothing booked, the prefill part neither


def test_a_required_policy_that_cannot_be_derived_fails_before_anything_is_booked() -> None:
    s = cluster(kv_transfer_domain="rack")  # no prefill worker has a rack
    message = s.rejected(disaggregated(), Reason.UNAVAILABLE)
    assert "prefill worker 1 has kv_transfer_domain 'rack' (required) but no topology_domains value" in message
    assert s.state.slots.requests == {}


def test_preferred_transfer_domain_weighs_but_does_not_exclude() -> None:
    preferred = {"kv_transfer_domain": "zone", "kv_transfer_enforcement": "preferred"}
    s = cluster(**preferred, kv_transfer_preferred_weight=1.0)
    # Decode costs are 8 (the prompt's prefill blocks, the same everywhere) + active + 8 new blocks.
    s.ok(Reserve("old", 3, 0, (1,), isl_tokens=4, effective_prefill_tokens=0))
    reply, _ = bookings(s, disaggregated())
    assert reply.decode_constraints.preferred == ((ZONE_A, 1.0),)
    assert reply.decode.worker_id == 3  # zone a: 17 x exp(-tanh 1) = 7.9 < zone b: 16
    s.ok(Reserve("older", 3, 0, tuple(range(100, 120)), isl_tokens=4, effective_prefill_tokens=0))
    s.ok(ReleaseReservation("r:decode"))
    reply, _ = bookings(s, disaggregated("r2"))
    assert reply.decode.worker_id == 4  # 37 x 0.47 = 17.3 > 16: still eligible, no longer preferred enough
    s = cluster(**preferred, kv_transfer_preferred_weight=0.0)
    s.ok(Reserve("old", 3, 0, (1,), isl_tokens=4, effective_prefill_tokens=0))
    assert bookings(s, disaggregated())[0].decode.worker_id == 4  # weight 0: no preference


def test_the_requests_own_constraints_apply_to_both_stages() -> None:
    s = cluster()
    reply, _ = bookings(s, disaggregated(required_taints=frozenset({ZONE_B})))
    assert reply.prefill is not None and (reply.prefill.worker_id, reply.decode.worker_id) == (2, 4)


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        ("no_prefill_workers", "no schedulable worker can prefill (worker_role prefill or both)"),
        ("constraints_exclude_them", "no prefill rank is available (no endpoints available to route work"),
    ],
)
def test_without_an_eligible_prefill_rank_the_request_falls_back_to_decode_only(setup: str, reason: str) -> None:
    s = cluster()
    options: dict[str, object] = {}
    if setup == "no_prefill_workers":
        for worker_id in (1, 2):
            s.ok(UpsertWorker(record(worker_id, worker_role="decode")))
    else:
        options["allowed_worker_ids"] = frozenset({3, 4})
    s.store(4, (31, 32, 33, 34, 35, 36), TOKENS[:24])
    reply, booked = bookings(s, disaggregated(**options))
    assert reply.prefill is None and reply.fallback_reason is not None and reason in reply.fallback_reason
    # chosen like an aggregated selection: KV-aware (worker 4 holds 6 blocks), prefill tracked on the decode worker
    assert reply.decode.worker_id == 4
    assert set(booked) == {"r:decode"}
    decode = booked["r:decode"]
    assert (decode.prefill_tokens, len(decode.sequence_hashes)) == (8, 8)


def test_parts_are_reservations_with_their_own_lifecycle() -> None:
    s = cluster()
    bookings(s, disaggregated())
    s.ok(CompleteReservationPrefill("r:prefill"))
    assert s.state.slots.ranks[WorkerRank(1, 0)].prefill_tokens == 0
    s.ok(ReleaseReservation("r:prefill"))
    assert set(s.state.slots.requests) == {"r:decode"}
    assert s.rejected(disaggregated(), Reason.CONFLICT) == "selection r:decode is already reserved or being reserved"
    s.ok(ReleaseReservation(part_id("r", "decode")))
    bookings(s, disaggregated())  # the id is free again


def test_direct_mode_is_refused_for_a_disaggregated_selection() -> None:
    message = cluster().rejected(disaggregated(config=RouterConfig(router_mode="direct")), Reason.INVALID)
    assert message.startswith("router_mode direct is not available for a disaggregated selection")


def test_other_modes_apply_to_both_stages() -> None:
    s = cluster()
    s.ok(Reserve("old", 4, 0, (1,), isl_tokens=4, effective_prefill_tokens=0))
    reply, _ = bookings(s, disaggregated(config=RouterConfig(router_mode="least_loaded"), draw=0.99))
    assert reply.prefill is not None and (reply.prefill.worker_id, reply.decode.worker_id) == (2, 3)


def test_aggregated_selections_skip_prefill_only_workers() -> None:
    s = cluster()
    for draw in (0.0, 0.99):
        assert s.ok(SelectWorker(Prompt(TOKENS), RouterConfig(), draw=draw)).reply.worker_id in (3, 4)
    only_prefill = Scope()
    only_prefill.ok(UpsertWorker(record(1, worker_role="prefill")))
    message = only_prefill.rejected(SelectWorker(Prompt(TOKENS), RouterConfig()), Reason.UNAVAILABLE)
    assert message.endswith("every schedulable worker has worker_role prefill (use POST /select_disaggregated)")
    assert only_prefill.rejected(disaggregated(), Reason.UNAVAILABLE).endswith("(every one has worker_role prefill)")


def test_busy_prefill_workers_fall_back_to_decode_only_and_busy_decode_workers_refuse() -> None:
    s = cluster()
    for worker_id in (1, 2):
        s.ok(Reserve(f"load{worker_id}", worker_id, 0, (), isl_tokens=64))  # 64 prefill tokens each
    busy_prefill = RouterConfig(active_prefill_tokens_threshold=31)  # a rank above 31 tokens is busy
    reply, booked = bookings(s, disaggregated(config=busy_prefill))
    assert reply.prefill is None and reply.fallback_reason is not None
    assert reply.fallback_reason.startswith("no prefill rank is available (all 2 eligible workers are overloaded")
    assert set(booked) == {"r:decode"} and booked["r:decode"].prefill_tokens == 32
    # now the decode worker that took it is busy too, and so is the other one
    s.ok(Reserve("load4", 4 if reply.decode.worker_id == 3 else 3, 0, (), isl_tokens=64))
    assert s.rejected(disaggregated("r2", config=busy_prefill), Reason.OVERLOADED)


def test_kv_ttft_predicts_the_prefill_stage_and_decodes_with_kvs_load_terms() -> None:
    s = cluster()
    s.ok(Reserve("old", 3, 0, (1, 2, 3), isl_tokens=4, effective_prefill_tokens=0))  # decode 3 is busier
    reply, _ = bookings(s, disaggregated(config=RouterConfig(router_mode="kv_ttft"), draw=0.99))
    assert reply.prefill is not None and (reply.prefill.worker_id, reply.decode.worker_id) == (1, 4)
    assert decode_stage_config(RouterConfig(router_mode="kv_ttft")).router_mode == "kv"
    # A long queue on the warm prefill worker sends the prefill to the cold one.
    s.ok(Reserve("queue", 1, 0, (1,), isl_tokens=20_000))
    reply, _ = bookings(s, disaggregated("r2", config=RouterConfig(router_mode="kv_ttft")))
    assert reply.prefill is not None and reply.prefill.worker_id == 2
