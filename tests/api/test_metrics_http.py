"""GET /metrics on both services, in both process layouts (tests/conftest.py): the exposition parses as
Prometheus text, its counters move when traffic flows, and the predicted-vs-realised cache-hit accounting
gives the figures of a worked example. (--fronts 2 with real processes: tests/api/test_metrics_fronts.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from kvrouter.actors.core.router_config import RouterConfig
from tests.conftest import LAYOUTS, start_select_service

M = {"model_name": "m", "tenant_id": "t"}
BLOCK = 4
PROMPT = list(range(100, 112))  # 12 tokens: 3 blocks of 4


def parsed(text: str) -> dict[str, Any]:
    """Every sample by (name, sorted labels), from an exposition prometheus_client's parser accepts."""
    samples: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


async def scrape(http: httpx.AsyncClient) -> dict[str, Any]:
    response = await http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parsed(response.text)


def value(samples: dict[str, Any], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_slot_tracker_metrics_move_with_traffic(client: httpx.AsyncClient) -> None:
    before = await scrape(client)
    assert value(before, "kvrouter_http_requests_total", method="POST", route="/add", status="201") == 0
    register = {**M, "worker_id": 1, "block_size": 4, "dp_start": 0, "dp_size": 1}
    assert (await client.post("/register", json=register)).status_code == 201
    for i in range(3):
        add = {**M, "request_id": f"r{i}", "worker_id": 1, "dp_rank": 0, "sequence_hashes": [1], "new_isl_tokens": 4}
        assert (await client.post("/add", json=add)).status_code == 201
    assert (await client.post("/add", json={"model_name": 5})).status_code == 422
    assert (await client.get("/reservations/nope")).status_code == 404  # not a slot-tracker route
    after = await scrape(client)
    assert value(after, "kvrouter_http_requests_total", method="POST", route="/add", status="201") == 3
    assert value(after, "kvrouter_http_requests_total", method="POST", route="/add", status="422") == 1
    assert value(after, "kvrouter_http_requests_total", method="GET", route="unmatched", status="404") == 1
    assert value(after, "kvrouter_http_requests_total", method="GET", route="/metrics", status="200") == 1
    assert value(after, "kvrouter_http_request_duration_seconds_count", method="POST", route="/add") == 4
    assert value(after, "kvrouter_scopes") == 1
    assert value(after, "kvrouter_mailbox_peak_depth", model_name="m", tenant_id="t") >= 1
    assert value(after, "kvrouter_mailbox_depth", model_name="m", tenant_id="t") == 0
    assert value(after, "kvrouter_mailbox_rejections_total", model_name="m", tenant_id="t") == 0
    # Four durable writes: at least one batch and one fsync, each timed.
    assert value(after, "kvrouter_journal_last_lsn") == 4
    assert value(after, "kvrouter_journal_batches_total") >= 1
    # Who wrote them (the loop itself, or the I/O thread after a slow fsync) is counted; the segment's first batch
    # always goes to the thread.
    assert ("kvrouter_journal_inline_batches_total", ()) in after
    assert value(after, "kvrouter_journal_inline_batches_total") < value(after, "kvrouter_journal_batches_total")
    assert value(after, "kvrouter_journal_fsync_seconds_count") >= 1
    assert value(after, "kvrouter_journal_batch_write_seconds_count") == value(after, "kvrouter_journal_batches_total")
    assert value(after, "kvrouter_metrics_actor_side_up") == 1
    assert value(after, "kvrouter_replica_sync_enabled") == 0


def approximate_worker() -> dict[str, Any]:
    return {"worker_id": 1, "model_name": "m", "tenant_id": "t", "endpoint": "http://w1", "block_size": BLOCK}


async def book(http: httpx.AsyncClient, reservation_id: str) -> dict[str, Any]:
    body = {**M, "token_ids": PROMPT, "reservation_id": reservation_id}
    response = await http.post("/select_and_reserve", json=body)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_predicted_vs_realised_cache_hits_worked_example(tmp_path: Path, layout: str) -> None:
    """Without KV events a booking's blocks count as cached on its worker (predicted blocks). One worker,
    block size 4, a 12-token prompt (3 blocks):

    * r1: nothing cached yet, the router predicts 0 tokens; the engine reports 0: exact (error 0).
    * r2, the same prompt: the router predicts all 3 blocks, 12 tokens; the engine reports 8 (vLLM recomputes
      the last block of a fully cached prompt): over-predicted by 4 (error 4).
    * r3, the same prompt, prediction 12, the engine reports 12: exact.

    So worker 1: 3 reports, 24 tokens predicted, 20 realised, 1 over-predicted, 0 under-predicted; the error
    histogram has two observations <= 0, three <= 16, sum 4.
    """
    async with trio.open_nursery() as nursery:
        handle = await start_select_service(
            nursery, tmp_path / "data", RouterConfig(use_kv_events=False), proxied=layout == "proxied"
        )
        async with httpx.AsyncClient(base_url=handle.urls[0], timeout=10) as http:
            assert (await http.post("/workers", json=approximate_worker())).status_code == 201
            reports = {"r1": 0, "r2": 8, "r3": 12}
            predicted = {}
            for reservation, cached in reports.items():
                selection = await book(http, reservation)
                predicted[reservation] = selection["isl_tokens"] - selection["effective_prefill_tokens"]
                done = await http.post(f"/reservations/{reservation}/prefill_complete", json={"cached_tokens": cached})
                assert (done.status_code, done.json()) == (200, {"status": "ok"})
            assert predicted == {"r1": 0, "r2": 12, "r3": 12}
            samples = await scrape(http)
            handle.stop()
    worker = {"worker_id": "1"}
    assert value(samples, "kvrouter_cache_hit_reports_total", **worker) == 3
    assert value(samples, "kvrouter_cache_hit_predicted_tokens_total", **worker) == 24
    assert value(samples, "kvrouter_cache_hit_realised_tokens_total", **worker) == 20
    assert value(samples, "kvrouter_cache_hit_overpredicted_total", **worker) == 1
    assert value(samples, "kvrouter_cache_hit_underpredicted_total", **worker) == 0
    assert value(samples, "kvrouter_cache_hit_error_tokens_bucket", le="0.0") == 2
    assert value(samples, "kvrouter_cache_hit_error_tokens_bucket", le="16.0") == 3
    assert value(samples, "kvrouter_cache_hit_error_tokens_bucket", le="+Inf") == 3
    assert value(samples, "kvrouter_cache_hit_error_tokens_count") == 3
    assert value(samples, "kvrouter_cache_hit_error_tokens_sum") == 4
    assert value(samples, "kvrouter_cache_hit_unpredicted_reports_total") == 0


async def test_prefill_complete_without_a_usable_body_behaves_as_before(selector: httpx.AsyncClient) -> None:
    """No body, an empty one or one of another type: 1.6.1's answer, no accounting. A JSON body that is not
    an object with a non-negative integer cached_tokens: 400 {error}, and the prefill is not completed."""
    worker = {
        "worker_id": 1,
        "model_name": "m",
        "endpoint": "http://w1",
        "block_size": BLOCK,
        "kv_events_endpoint": "tcp://127.0.0.1:1",
    }
    assert (await selector.post("/workers", json=worker)).status_code == 201
    for reservation in ("a", "b", "c", "d"):
        body = {"model_name": "m", "token_ids": PROMPT, "reservation_id": reservation}
        assert (await selector.post("/select_and_reserve", json=body)).status_code == 200

    async def prefill_tokens() -> int:
        partitions = (await selector.get("/loads")).json()
        return sum(row["potential_prefill_tokens"] for partition in partitions for row in partition["loads"])

    pending = await prefill_tokens()
    assert pending == 4 * len(PROMPT)
    must = "cached_tokens must be an integer from 0 to 4294967296, got "
    refused = [
        (b'{"cached_tokens": -1}', must + "-1"),
        (b'{"cached_tokens": "8"}', must + 'string "8"'),
        (b'{"cached_tokens": 8.5}', must + "floating point `8.5`"),
        (b"[8]", "the prefill_complete body must be a JSON object, got sequence"),
        (b"not json", "Failed to parse the request body as JSON: "),
    ]
    for raw, error in refused:
        answer = await selector.post(
            "/reservations/a/prefill_complete", content=raw, headers={"content-type": "application/json"}
        )
        assert answer.status_code == 400, raw
        assert answer.json()["error"].startswith(error), (raw, answer.json())
    assert await prefill_tokens() == pending  # nothing changed
    ignored = [
        (None, None),
        (b"hello", "text/plain"),
        (b"", "application/json"),
        (b"{}", "application/json"),
    ]
    for reservation, (raw, content_type) in zip("abcd", ignored, strict=True):
        headers = {"content-type": content_type} if content_type else {}
        answer = await selector.post(f"/reservations/{reservation}/prefill_complete", content=raw, headers=headers)
        assert (answer.status_code, answer.json()) == (200, {"status": "ok"})
    assert await prefill_tokens() == 0
    samples = await scrape(selector)
    assert value(samples, "kvrouter_cache_hit_reports_total", worker_id="1") == 0
    assert value(samples, "kvrouter_cache_hit_unpredicted_reports_total") == 0
    assert (await selector.post("/reservations/zz/prefill_complete", json={"cached_tokens": 3})).status_code == 404
