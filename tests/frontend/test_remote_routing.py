"""A frontend whose selection is a selection service's, over HTTP (``--selection-url``): a real selection service
and mock workers in-process on 127.0.0.1, the first URL of the list one where nothing listens. Requests are booked,
completed and freed at the service; a refusal keeps the service's status; no URL reachable is a 503 naming each;
the service's own routes are not served on the frontend's port."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from kvrouter.api.embedded import RouterError
from kvrouter.api.frontend.remote_routing import RemoteRouting, selection_client
from kvrouter.api.frontend.remote_service import RemoteFrontendHandle, run_remote_frontend
from kvrouter.api.frontend.routing import Target
from tests.support.frontends import frontend_options, wait_idle
from tests.support.mock_workers import start_mock_worker
from tests.support.processes import free_port
from tests.support.services import running


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A ``/metrics`` answer's samples by name and sorted labels."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def schedulable(http: httpx.AsyncClient, count: int) -> None:
    with trio.fail_after(10):
        while True:
            rows = (await http.get("/workers")).json()
            if len([row for row in rows if row["lifecycle"] == "schedulable"]) >= count:
                return
            await trio.sleep(0.01)


async def test_requests_are_booked_and_freed_at_the_service(tmp_path: Path) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    async with running("selection service", tmp_path / "service") as service, trio.open_nursery() as nursery:
        url = service.urls[0]
        for worker_id in (1, 2):
            await start_mock_worker(nursery, register_url=url, worker_id=worker_id)
        async with httpx.AsyncClient(base_url=url, trust_env=False) as at_service:
            await schedulable(at_service, 2)
            options = frontend_options(selection_urls=(nowhere, url), seed=None)
            front: RemoteFrontendHandle = await nursery.start(run_remote_frontend, options)
            async with httpx.AsyncClient(base_url=front.url, trust_env=False, timeout=10) as http:
                assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == ["mock"]
                body = {"model": "mock", "prompt": "the same words, sent to the frontend twice", "max_tokens": 2}
                answers = [await http.post("/v1/completions", json=body) for _ in range(2)]
                assert [answer.status_code for answer in answers] == [200, 200], answers[0].text
                assert answers[0].headers["x-kvrouter-worker-id"] in ("1", "2")
                assert (await http.post("/workers", json={})).status_code == 404  # the service's route, not here
                assert (await http.get("/health")).status_code == 200
                figures = samples((await http.get("/metrics")).text)
                calls = "kvrouter_frontend_selection_calls_total"
                assert figures[calls, (("outcome", "not_sent"), ("url", nowhere))] >= 1  # then the next URL
                assert figures[calls, (("outcome", "answered"), ("url", url))] >= 4  # catalog, book, free x2
                assert figures["kvrouter_frontend_selection_catalog_workers", ()] == 2
                assert 0 <= figures["kvrouter_frontend_selection_catalog_age_seconds", ()] < 5
            rows = await wait_idle(at_service)  # each booking freed at the service
            assert sorted(rows) == [1, 2]
            front.stop()
        nursery.cancel_scope.cancel()


async def test_refusals_keep_the_service_status_and_no_url_reachable_is_a_503(tmp_path: Path) -> None:
    nowhere = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    async with running("selection service", tmp_path / "service") as service, selection_client(4) as client:
        routing = RemoteRouting([service.urls[0]], client, None, None)
        gone = Target("never-booked", 1, 0, "http://127.0.0.1:1", 0)
        await routing.free(gone)  # an unknown booking: already gone, not an error
        with pytest.raises(RouterError) as refused:
            await routing.prefill_complete(gone)
        assert refused.value.status == 404
        with pytest.raises(RouterError) as no_worker:
            await routing.book("mock", [1, 2, 3], "fe-x-1")
        assert 400 <= no_worker.value.status < 600 and no_worker.value.message
        unreachable = RemoteRouting(nowhere, client, None, None)
        with pytest.raises(RouterError) as down:
            await unreachable.book("mock", [1, 2, 3], "fe-x-2")
        assert down.value.status == 503 and all(url in down.value.message for url in nowhere), down.value.message
