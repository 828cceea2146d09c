"""kv_ttft in the simulator: the policy and its ablations run through the service, the model learns from the
completions and the cached_tokens the simulated clients report, and a seed gives the same report byte for
byte."""

from __future__ import annotations

import statistics

import attrs
import pytest

from kvrouter.actors.core.ttft_model import PRIOR, Outcome, PrefillModel
from kvrouter.simulations.cli import main
from kvrouter.simulations.cluster import ClusterOptions, ClusterRun, simulate_policy
from kvrouter.simulations.generators import synthetic
from kvrouter.simulations.report import to_json
from kvrouter.simulations.simulate import build_report, run_policies
from kvrouter.simulations.timing import EngineParams

TRACE = synthetic("agentic:agents=12,rate=4", 5)
OPTIONS = ClusterOptions(workers=3, seed=7, engine=EngineParams(num_blocks=2048))


def run(policy: str) -> ClusterRun:
    return simulate_policy(TRACE, attrs.evolve(OPTIONS, policy=policy))


def test_kv_ttft_is_the_services_kv_ttft_mode() -> None:
    policy, mode = run("kv_ttft"), run("router:kv_ttft")
    assert policy.failures == [] and all(r.end_ms is not None for r in policy.records)
    assert [r.rank for r in policy.records] == [r.rank for r in mode.records]
    assert policy.journal_digest == mode.journal_digest


def test_a_seed_gives_the_same_report_byte_for_byte() -> None:
    reports = []
    for _ in range(2):
        outcomes = run_policies(TRACE, OPTIONS, ("kv", "kv_ttft"))
        reports.append(to_json(build_report(TRACE, OPTIONS, 1.0, outcomes, "dynamo-mocker")))
    assert reports[0] == reports[1]


@pytest.fixture
def outcomes(monkeypatch: pytest.MonkeyPatch) -> list[Outcome]:
    """Every completion the router's models saw, with the prediction of the selection that booked it."""
    seen: list[Outcome] = []
    original = PrefillModel.completed

    def recording(self: PrefillModel, request_id: str, at: int, batch_tokens: int) -> Outcome | None:
        outcome = original(self, request_id, at, batch_tokens)
        if outcome is not None:
            seen.append(outcome)
        return outcome

    monkeypatch.setattr(PrefillModel, "completed", recording)
    return seen


def test_every_booking_is_predicted_and_compared_with_its_completion(outcomes: list[Outcome]) -> None:
    result = run("kv_ttft")
    assert len(outcomes) == len(result.records)
    errors = [abs(o.realised_ms - o.predicted_ms) for o in outcomes if o.predicted_ms is not None]
    assert len(errors) == len(outcomes)
    assert statistics.median(errors) < 50.0  # ms: a pass or two


def test_the_ablations_leave_their_term_out(monkeypatch: pytest.MonkeyPatch) -> None:
    models: list[PrefillModel] = []
    original = PrefillModel.__init__

    def keeping(self: PrefillModel, **kwargs: object) -> None:
        original(self, **kwargs)  # type: ignore[arg-type]
        models.append(self)

    monkeypatch.setattr(PrefillModel, "__init__", keeping)
    run("kv_ttft")
    assert all(row.rates != PRIOR for row in models[-1].rows() if row.samples)
    assert any(row.samples for row in models[-1].rows())
    run("kv_ttft_no_fit")
    assert all(row.rates == PRIOR and row.samples == 0 for row in models[-1].rows())
    assert models[-1].fit_enabled is False
    run("kv_ttft_no_drift")
    assert models[-1].drift_enabled is False
    queueless = run("kv_ttft_no_queue")
    assert queueless.failures == []


def test_the_cli_takes_kv_ttft_and_its_ablations(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--synthetic", "chat:sessions=10,rate=4", "--workers", "2", "--no-progress", "--jobs", "1"]
    policies = "kv,kv_ttft,kv_ttft_no_queue,kv_ttft_no_fit,kv_ttft_no_drift"
    assert main([*argv, "--compare", policies]) == 0
    out = capsys.readouterr().out
    assert all(p in out for p in policies.split(","))
    assert main([*argv, "--policy", "kv_ttft_no_cache"]) == 2
    assert "unknown policy kv_ttft_no_cache" in capsys.readouterr().err
