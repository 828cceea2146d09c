"""Every routing mode of the selection service runs in the simulator (``router:<mode>`` policies), through the
service object the HTTP route calls, with the mode on each request as a ``router_mode`` body field sets it."""

from __future__ import annotations

import pytest

from kvrouter.actors.core.router_config import ROUTER_MODES
from kvrouter.actors.select_service import SelectService
from kvrouter.simulations.cli import main
from kvrouter.simulations.cluster import ClusterOptions, ClusterRun, simulate_policy
from kvrouter.simulations.generators import synthetic
from kvrouter.simulations.timing import EngineParams

TRACE = synthetic("shared-prefix:requests=120,rate=20", 2)


def run(policy: str, seed: int = 3) -> ClusterRun:
    return simulate_policy(
        TRACE, ClusterOptions(workers=4, policy=policy, seed=seed, engine=EngineParams(num_blocks=2048))
    )


@pytest.fixture
def modes(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """The router mode of every request that went through ``SelectService.select_and_reserve``."""
    seen: list[str | None] = []
    original = SelectService.select_and_reserve

    async def recording(self, request):  # type: ignore[no-untyped-def]
        seen.append(request.router_mode)
        return await original(self, request)

    monkeypatch.setattr(SelectService, "select_and_reserve", recording)
    return seen


@pytest.mark.parametrize("mode", ROUTER_MODES)
def test_each_mode_routes_every_request_through_the_service(mode: str, modes: list[str | None]) -> None:
    outcome = run(f"router:{mode}")
    assert outcome.failures == []
    assert all(r.end_ms is not None and r.rejected is None for r in outcome.records)
    assert sum(w.requests for w in outcome.workers) == len(TRACE.requests)
    assert modes == [mode] * len(TRACE.requests)


def ranks(outcome: ClusterRun) -> list[object]:
    return [r.rank for r in outcome.records]


def test_the_modes_choose_as_the_service_documents() -> None:
    # The service's round robin cycles its eligible ranks in (worker, rank) order, as the client policy does.
    round_robin = ranks(run("round_robin"))
    assert ranks(run("router:round_robin")) == round_robin
    # direct: the client pins each rank (round robin here) and the router books exactly that one.
    assert ranks(run("router:direct")) == round_robin
    # kv is the default mode: naming it changes nothing.
    assert ranks(run("router:kv")) == ranks(run("kv"))
    # random draws from the scope's seeded source: the same seed repeats it, another does not.
    first, again, other = run("router:random"), run("router:random"), run("router:random", seed=4)
    assert ranks(first) == ranks(again) and first.journal_digest == again.journal_digest
    assert ranks(first) != ranks(other)
    assert len({r.rank for r in first.records}) == 4


def test_least_loaded_takes_a_rank_with_the_least_load_at_each_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fewest active requests, then prefill tokens, then decode blocks: checked against the loads the service
    reports just before each selection."""
    checked: list[bool] = []
    original = SelectService.select_and_reserve

    async def checking(self, request):  # type: ignore[no-untyped-def]
        (partition,) = await self.loads()
        keys = {
            row.rank: (row.active_requests, row.active_prefill_tokens, row.active_decode_blocks)
            for row in partition.loads
        }
        selection = await original(self, request)
        checked.append(
            keys.get((selection.worker_id, selection.dp_rank), (0, 0, 0)) == min(keys.values(), default=(0, 0, 0))
        )
        return selection

    monkeypatch.setattr(SelectService, "select_and_reserve", checking)
    outcome = run("router:least_loaded")
    assert outcome.failures == [] and len(checked) == len(TRACE.requests) and all(checked)


def test_the_cli_takes_the_mode_policies(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--synthetic", "shared-prefix:requests=40,rate=20", "--workers", "2", "--no-progress", "--jobs", "1"]
    assert main([*argv, "--compare", ",".join(f"router:{m}" for m in ROUTER_MODES)]) == 0
    out = capsys.readouterr().out
    assert all(f"router:{m}" in out for m in ROUTER_MODES)
    assert main([*argv, "--policy", "router:nonsense"]) == 2
    assert "unknown policy router:nonsense" in capsys.readouterr().err
