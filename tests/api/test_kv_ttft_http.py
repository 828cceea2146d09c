"""The kv_ttft router mode against a real selection service (both process layouts): chosen per request with
``router_mode`` (Dynamo's dash accepted), explained term by term in milliseconds in the reply and on
/ws/decisions, and its prediction error, fitted rates and drift factor in /metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from kvrouter.actors.core.ttft_model import DEFAULT_BATCH_TOKENS, PRIOR
from tests.api.test_live_decisions import LAYOUTS, decision, decisions, selector
from tests.api.test_metrics_http import scrape, value

BLOCK = 16
PROMPT = list(range(1000, 3048))  # 2,048 tokens: 128 blocks


async def add_workers(http: httpx.AsyncClient, *ids: int) -> None:
    for worker in ids:
        body = {"worker_id": worker, "model_name": "m", "block_size": BLOCK, "endpoint": f"http://w{worker}"}
        assert (await http.post("/workers", json=body)).status_code == 201


def body(**fields: Any) -> dict[str, Any]:
    return {"model_name": "m", "token_ids": PROMPT, **fields}


async def warm_worker_one(http: httpx.AsyncClient) -> None:
    """Book the prompt on worker 1 (approximate mode: its blocks become a predicted hit there), prefill done."""
    booked = await http.post("/select_and_reserve", json=body(pinned_worker={"worker_id": 1, "dp_rank": 0}))
    assert booked.status_code == 200, booked.text
    reservation = booked.json()["reservation_id"]
    assert (await http.post(f"/reservations/{reservation}/prefill_complete", json={})).status_code == 200


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_kv_ttft_is_explained_term_by_term_in_the_reply_and_on_the_decision_feed(
    tmp_path: Path, layout: str
) -> None:
    async with selector(tmp_path, layout) as (service, http), decisions(service) as ws:
        await add_workers(http, 1, 2, 3)
        await warm_worker_one(http)
        await decision(ws)  # the warming booking
        reply = await http.post("/select", json=body(router_mode="kv-ttft", explain=True))
        assert reply.status_code == 200, reply.text
        chosen = reply.json()
        assert chosen["worker_id"] == 1
        explain = chosen["explain"]
        assert (explain["router_mode"], explain["reason"], explain["rule"]) == ("kv_ttft", "cache", None)
        rows = {row["worker_id"]: row for row in explain["candidates"]}
        warm, cold = rows[1]["ttft_ms"], rows[2]["ttft_ms"]
        assert warm["cached_tokens"] == 2032 and cold["cached_tokens"] == 0  # the last block is always computed
        for terms in (warm, cold):
            assert terms["ttft"] == pytest.approx(terms["queue"] + terms["prefill"] + terms["decode"], abs=1e-2)
            assert terms["cost"] == pytest.approx(terms["ttft"] + terms["load"], abs=1e-2)
            assert terms["fit_samples"] == 0 and terms["overlap_factor"] == 1.0
        assert rows[1]["cost"] == warm["cost"] and warm["cost"] < cold["cost"]
        assert cold["prefill"] == pytest.approx(PRIOR.compute_ms(2048, DEFAULT_BATCH_TOKENS), abs=1e-2)
        assert warm["queue"] > 0.0 and cold["queue"] == 0.0  # worker 1 runs the warming request: a pass in flight
        seen = await decision(ws)
        assert seen["explain"] == explain


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_kv_ttft_predictions_and_reports_reach_the_metrics(tmp_path: Path, layout: str) -> None:
    async with selector(tmp_path, layout) as (_, http):
        assert "kvrouter_ttft_predictions" not in (await http.get("/metrics")).text  # idle until used
        await add_workers(http, 1, 2)
        await warm_worker_one(http)
        for _ in range(2):
            booked = await http.post("/select_and_reserve", json=body(router_mode="kv_ttft"))
            assert booked.status_code == 200, booked.text
            reservation = booked.json()["reservation_id"]
            assert booked.json()["worker_id"] == 1
            # The engine found nothing cached: below the router's prediction, so worker 1 is discounted.
            done = await http.post(f"/reservations/{reservation}/prefill_complete", json={"cached_tokens": 0})
            assert done.status_code == 200
            assert (await http.delete(f"/reservations/{reservation}")).status_code == 200
        samples = await scrape(http)
    rank = {"model_name": "m", "tenant_id": "default", "worker_id": "1", "dp_rank": "0"}
    assert value(samples, "kvrouter_ttft_predictions_total", **rank) == 2
    assert value(samples, "kvrouter_ttft_prediction_error_ms_count") == 2
    assert value(samples, "kvrouter_ttft_predicted_ms_total", **rank) > 0
    assert value(samples, "kvrouter_ttft_realised_ms_total", **rank) > 0
    assert value(samples, "kvrouter_ttft_fit_samples", **rank) == 1  # the last completion waits for a later one
    assert value(samples, "kvrouter_ttft_overlap_factor", **rank) == pytest.approx(0.8**2)
    assert value(samples, "kvrouter_ttft_prefill_tokens_per_second", **rank) > 0
