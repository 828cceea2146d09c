"""The simulator routes through the same service object, and the same method, as the HTTP route."""

from __future__ import annotations

import httpx
import pytest

from kvrouter.actors.select_service import SelectService
from kvrouter.simulations.cluster import ClusterOptions, simulate_policy
from kvrouter.simulations.generators import synthetic
from kvrouter.simulations.timing import EngineParams
from tests.conftest import start_select_service


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every reservation id that went through ``SelectService.select_and_reserve``."""
    calls: list[str] = []
    original = SelectService.select_and_reserve

    async def counting(self, request):  # type: ignore[no-untyped-def]
        calls.append(request.reservation_id)
        return await original(self, request)

    monkeypatch.setattr(SelectService, "select_and_reserve", counting)
    return calls


async def test_the_http_route_calls_the_service_method(counted: list[str], nursery, tmp_path) -> None:
    handle = await start_select_service(nursery, tmp_path / "data")
    async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
        worker = {"worker_id": 1, "model_name": "m", "endpoint": "http://w1", "block_size": 4}
        worker["kv_events_endpoint"] = "tcp://127.0.0.1:1"
        assert (await http.post("/workers", json=worker)).status_code == 201
        answer = await http.post(
            "/select_and_reserve", json={"model_name": "m", "reservation_id": "r-1", "token_ids": [1, 2, 3, 4, 5]}
        )
    handle.stop()
    assert answer.status_code == 200
    assert counted == ["r-1"]


def test_the_simulated_kv_policy_calls_the_same_method(counted: list[str]) -> None:
    trace = synthetic("shared-prefix:requests=30,rate=20", 3)
    simulate_policy(trace, ClusterOptions(workers=2, policy="kv", engine=EngineParams(num_blocks=1024)))
    assert counted == [f"req-{i}" for i in range(30)]
