"""Whole-cluster runs: seeded, complete, invariant-checked, reproducible byte for byte."""

from __future__ import annotations

import attrs
import pytest

from kvrouter.simulations.cluster import ClusterOptions, simulate_policy
from kvrouter.simulations.generators import synthetic
from kvrouter.simulations.report import to_json
from kvrouter.simulations.simulate import build_report, run_policies
from kvrouter.simulations.timing import EngineParams

SMALL = EngineParams(num_blocks=2_048)  # 64-token blocks: enough for the workloads below, little to evict


def options(policy: str = "kv", seed: int = 3, workers: int = 4, **kw: object) -> ClusterOptions:
    return attrs.evolve(ClusterOptions(workers=workers, policy=policy, seed=seed, engine=SMALL), **kw)


@pytest.mark.parametrize("policy", ["kv", "round_robin", "random", "least_loaded"])
def test_every_request_completes_and_the_router_ends_idle(policy: str) -> None:
    trace = synthetic("shared-prefix:requests=150,rate=20", 1)
    run = simulate_policy(trace, options(policy))
    assert run.failures == []
    assert all(r.end_ms is not None and r.rejected is None for r in run.records)
    assert all(r.first_token_ms <= r.end_ms for r in run.records)
    assert sum(w.requests for w in run.workers) == 150
    assert run.journal_records > 0  # every booking, completion and KV batch went through the journal


def test_kv_routing_beats_round_robin_on_shared_prefixes() -> None:
    trace = synthetic("shared-prefix:requests=400,prompts=40,prefix_blocks=12,unique_blocks=1,rate=15", 5)
    outcomes = run_policies(trace, options(), ("kv", "round_robin"))
    kv, rr = outcomes["kv"].summary, outcomes["round_robin"].summary
    assert kv["prefix_reuse"] > rr["prefix_reuse"] + 0.1
    assert kv["ttft_ms"]["p90"] < rr["ttft_ms"]["p90"]
    # The router saw the blocks it routed to: predictions match the workers' caches most of the time.
    assert kv["overlap"]["exact"] > 0.8 * kv["overlap"]["requests"]


def report_bytes(seed: int) -> tuple[bytes, list[str]]:
    trace = synthetic("chat:sessions=40,turns=3,rate=5", seed)
    base = options(seed=seed)
    outcomes = run_policies(trace, base, ("kv", "random"))
    digests = [o.summary["router"]["journal_sha256"] for o in outcomes.values()]
    return to_json(build_report(trace, base, 1.0, outcomes, "dynamo-mocker")), digests


def test_the_same_inputs_and_seed_give_the_same_report_and_journals() -> None:
    first, first_journals = report_bytes(11)
    again, again_journals = report_bytes(11)
    assert first == again
    assert first_journals == again_journals
    other, other_journals = report_bytes(12)
    assert other != first and other_journals != first_journals


def test_parallel_processes_give_the_same_outcomes_as_one() -> None:
    trace = synthetic("agentic:agents=8,steps=4", 2)
    serial = run_policies(trace, options(), ("kv", "round_robin"), jobs=1)
    forked = run_policies(trace, options(), ("kv", "round_robin"), jobs=2)
    assert {p: o.summary for p, o in serial.items()} == {p: o.summary for p, o in forked.items()}


def test_dp_ranks_are_routed_and_report_per_rank() -> None:
    trace = synthetic("shared-prefix:requests=80,rate=20", 4)
    run = simulate_policy(trace, options("round_robin", workers=2, dp_size=2))
    assert [w.requests for w in run.workers] == [20, 20, 20, 20]


def test_kv_batches_through_the_wire_format_index_the_same() -> None:
    trace = synthetic("shared-prefix:requests=80,rate=20", 6)
    plain = simulate_policy(trace, options())
    wired = simulate_policy(trace, options(kv_wire=True))
    assert [r.cached_tokens for r in wired.records] == [r.cached_tokens for r in plain.records]
    assert [r.predicted_tokens for r in wired.records] == [r.predicted_tokens for r in plain.records]
