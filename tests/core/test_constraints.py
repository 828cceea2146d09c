"""Routing constraints and topology (behaviour.md#constraints-and-disaggregation, seed topology-aware-kv-transfer.md):
taints, the preferred-taint
factor, the decode constraint derived from a prefill worker, and the catalog rules, on the pure core."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrouter.actors.core.catalog import WorkerRecord, record_view
from kvrouter.actors.core.commands import Prompt, SelectionOptions, SelectWorker, UpsertWorker
from kvrouter.actors.core.constraints import (
    NO_CONSTRAINTS,
    RoutingConstraints,
    catalog_problem,
    decode_constraint,
    preference_factor,
    routing_taints,
    topology_taint,
)
from kvrouter.actors.core.decisions import Reason
from kvrouter.actors.core.router_config import RouterConfig
from tests.core.test_scope_parts import TOKENS, Scope, record

ZONE_A = "dynamo.topology/zone=a"


def test_a_topology_entry_is_a_canonical_taint() -> None:
    assert topology_taint("zone", "us-east-1a") == "dynamo.topology/zone=us-east-1a"
    assert routing_taints(("gpu",), (("rack", "r7"), ("zone", "a"))) == {"gpu", "dynamo.topology/rack=r7", ZONE_A}
    assert record(1, taints=("gpu",), topology_domains=(("zone", "a"),)).taint_set == {"gpu", ZONE_A}


@pytest.mark.parametrize(
    ("taints", "preferred", "factor"),
    [
        (set(), {"a": 1.0}, 1.0),  # carries none of them: unchanged
        ({"a"}, {"a": 1.0}, math.exp(-math.tanh(1.0))),  # attracts: cost x 0.4666
        ({"a"}, {"a": -1.0}, math.exp(math.tanh(1.0))),  # negative weights repel: cost x 2.143
        ({"a", "b"}, {"a": 0.25, "b": 0.5, "c": 9.0}, math.exp(-math.tanh(0.75))),  # the matched weights add up
        ({"a", "b"}, {"a": 1.0, "b": -1.0}, 1.0),  # and cancel
        ({"a"}, {"a": 0.0}, 1.0),
    ],
)
def test_preferred_taints_multiply_the_cost_by_exp_minus_tanh_of_the_matched_weights(
    taints: set[str], preferred: dict[str, float], factor: float
) -> None:
    assert preference_factor(frozenset(taints), preferred) == pytest.approx(factor, rel=1e-15)


@given(st.dictionaries(st.sampled_from("abcdef"), st.floats(-1e6, 1e6), max_size=6), st.sets(st.sampled_from("abc")))
def test_the_preference_factor_stays_between_one_over_e_and_e(preferred: dict[str, float], taints: set[str]) -> None:
    assert math.exp(-1) <= preference_factor(frozenset(taints), preferred) <= math.e


def test_merged_constraints_keep_every_required_taint_and_the_derived_weight() -> None:
    own = RoutingConstraints.of(["user.required"], {"user.preferred": 0.25, ZONE_A: 0.1})
    derived = RoutingConstraints.of([ZONE_A], {ZONE_A: 0.85})
    merged = own.merged(derived)
    assert merged.required == {"user.required", ZONE_A}
    assert dict(merged.preferred) == {"user.preferred": 0.25, ZONE_A: 0.85}
    assert own.merged(NO_CONSTRAINTS) == own


def prefill_worker(**fields: object) -> WorkerRecord:
    return record(3, topology_domains=(("rack", "r7"), ("zone", "a")), **fields)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, NO_CONSTRAINTS),  # no policy: decode is unconstrained
        ({"kv_transfer_domain": "zone"}, RoutingConstraints.of([ZONE_A])),  # a domain alone means required
        ({"kv_transfer_domain": "zone", "kv_transfer_enforcement": "required"}, RoutingConstraints.of([ZONE_A])),
        (
            {"kv_transfer_domain": "rack", "kv_transfer_enforcement": "required"},
            RoutingConstraints.of(["dynamo.topology/rack=r7"]),
        ),  # only the transfer domain is used, other domains stay ordinary taints
        (
            {
                "kv_transfer_domain": "zone",
                "kv_transfer_enforcement": "preferred",
                "kv_transfer_preferred_weight": 0.85,
            },
            RoutingConstraints.of(preferred={ZONE_A: 0.85}),
        ),
        # a preference that cannot be derived prefers nothing (it never refuses a request)
        (
            {"kv_transfer_domain": "dc", "kv_transfer_enforcement": "preferred", "kv_transfer_preferred_weight": 1.0},
            NO_CONSTRAINTS,
        ),
        ({"kv_transfer_enforcement": "preferred", "kv_transfer_preferred_weight": 1.0}, NO_CONSTRAINTS),
    ],
)
def test_the_decode_constraint_comes_from_the_prefill_workers_transfer_domain(
    fields: dict[str, object], expected: RoutingConstraints
) -> None:
    assert decode_constraint(prefill_worker(**fields)) == expected


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"kv_transfer_domain": "dc"}, "has kv_transfer_domain 'dc' (required) but no topology_domains value"),
        ({"kv_transfer_domain": "dc", "kv_transfer_enforcement": "required"}, "no topology_domains value"),
        ({"kv_transfer_enforcement": "required"}, "requires KV transfer within a domain but has no kv_transfer_domain"),
        # an enforcement this build does not know (an old journal may hold one): fail closed
        ({"kv_transfer_domain": "dc", "kv_transfer_enforcement": "prefer"}, "no topology_domains value"),
    ],
)
def test_a_required_policy_that_cannot_be_derived_is_a_refusal(fields: dict[str, object], problem: str) -> None:
    derived = decode_constraint(prefill_worker(**fields))
    assert isinstance(derived, str) and problem in derived and "prefill worker 3" in derived


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({}, None),
        (
            {
                "taints": ("gpu",),
                "topology_domains": (("zone", "a"),),
                "kv_transfer_domain": "zone",
                "kv_transfer_enforcement": "preferred",
                "kv_transfer_preferred_weight": 0.0,
                "worker_role": "prefill",
            },
            None,
        ),
        ({"kv_transfer_enforcement": "preferred"}, None),  # 1.6.1 accepts a policy without a domain
        ({"kv_transfer_domain": "zone"}, None),  # the value may arrive later (derivation fails closed until then)
        ({"worker_role": "prefiller"}, "worker_role must be one of prefill, decode, both, got 'prefiller'"),
        ({"taints": (ZONE_A,)}, "uses the reserved prefix 'dynamo.topology/': set topology_domains instead"),
        ({"topology_domains": (("", "a"),)}, "topology domain '' must be non-empty and must not contain '='"),
        ({"topology_domains": (("a=b", "c"),)}, "must not contain '='"),
        ({"topology_domains": (("zone", ""),)}, "topology domain 'zone' must have a non-empty value"),
        ({"kv_transfer_domain": ""}, "kv_transfer_domain must not be empty"),
        ({"kv_transfer_enforcement": "prefer"}, "kv_transfer_enforcement must be required or preferred, got 'prefer'"),
        ({"kv_transfer_preferred_weight": 1.5}, "kv_transfer_preferred_weight must be between 0 and 1, got 1.5"),
        ({"kv_transfer_preferred_weight": -0.1}, "must be between 0 and 1"),
        ({"kv_transfer_preferred_weight": math.nan}, "must be between 0 and 1"),
        (
            {"kv_transfer_domain": "zone", "kv_transfer_enforcement": "preferred"},
            "kv_transfer_enforcement preferred needs kv_transfer_preferred_weight (between 0 and 1)",
        ),
    ],
)
def test_catalog_rules(fields: dict[str, object], problem: str | None) -> None:
    found = catalog_problem(record(1, **fields))
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


def test_a_refused_record_changes_nothing() -> None:
    s = Scope()
    message = s.rejected(UpsertWorker(record(1, kv_transfer_preferred_weight=2.0)), Reason.INVALID)
    assert "kv_transfer_preferred_weight" in message
    assert s.state.selection.catalog == {} and s.state.slots.ranks == {}


def test_the_catalog_view_shows_the_topology_fields_and_a_role_only_when_set() -> None:
    plain = record_view(record(1, topology_domains=(("zone", "a"),), kv_transfer_domain="zone"), "schedulable", [])
    assert (plain["topology_domains"], plain["kv_transfer_domain"], plain["kv_transfer_enforcement"]) == (
        {"zone": "a"},
        "zone",
        None,
    )
    assert "worker_role" not in plain  # as 1.6.1 shows its optional router hints
    assert record_view(record(1, worker_role="decode"), "schedulable", [])["worker_role"] == "decode"


# -- constraints in a selection -----------------------------------------------------------------------


def topology_scope() -> Scope:
    s = Scope()
    s.ok(UpsertWorker(record(1, topology_domains=(("zone", "a"),))))
    s.ok(UpsertWorker(record(2, taints=("spot",), topology_domains=(("zone", "b"),))))
    return s


def pick(s: Scope, draw: float = 0.0, **options: object) -> int:
    command = SelectWorker(Prompt(TOKENS), RouterConfig(), SelectionOptions(**options), draw=draw)  # type: ignore[arg-type]
    return s.ok(command).reply.worker_id  # type: ignore[no-any-return]


def test_required_topology_taints_select_the_workers_in_that_domain() -> None:
    s = topology_scope()
    for draw in (0.0, 0.99):  # the two workers tie on cost: the draw alone would split them
        assert pick(s, draw, required_taints=frozenset({ZONE_A})) == 1
        assert pick(s, draw, required_taints=frozenset({"dynamo.topology/zone=b", "spot"})) == 2


def test_required_taints_nobody_carries_are_a_503_that_names_them() -> None:
    s = topology_scope()
    command = SelectWorker(
        Prompt(TOKENS), RouterConfig(), SelectionOptions(required_taints=frozenset({"dynamo.topology/zone=c", "gpu"}))
    )
    message = s.rejected(command, Reason.UNAVAILABLE)
    assert message == (
        "no endpoints available to route work: no eligible worker carries every required taint of "
        "routing_constraints [dynamo.topology/zone=c, gpu]"
    )


def test_preferred_taints_break_a_tie_and_negative_weights_repel() -> None:
    s = topology_scope()
    for draw in (0.0, 0.99):
        assert pick(s, draw, preferred_taints=((ZONE_A, 0.5),)) == 1
        assert pick(s, draw, preferred_taints=(("spot", -0.5),)) == 1
        assert pick(s, draw, preferred_taints=(("spot", 0.5),)) == 2
