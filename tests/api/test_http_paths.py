"""Paths are matched on the raw, percent-encoded request target (real hypercorn on 127.0.0.1).

An id is one path segment: a reservation booked as ``a/b`` is reached at ``/reservations/a%2Fb``, and
the empty id at ``/reservations/`` (reachable, like every id a body can book).
"""

from __future__ import annotations

import httpx
import pytest

from tests.api.test_select_http import worker

PROMPT = {"model_name": "m", "token_ids": list(range(8))}


async def book(selector: httpx.AsyncClient, reservation_id: str) -> None:
    booked = await selector.post("/select_and_reserve", json={**PROMPT, "reservation_id": reservation_id})
    assert booked.status_code == 200, booked.text
    assert booked.json()["reservation_id"] == reservation_id


async def active_requests(selector: httpx.AsyncClient) -> int:
    return (await selector.get("/loads")).json()[0]["loads"][0]["active_requests"]


@pytest.mark.parametrize(
    ("reservation_id", "in_path"),
    [("a/b", "a%2Fb"), ("", ""), ("x y?#%", "x%20y%3F%23%25"), ("ü/..", "%C3%BC%2F..")],
)
async def test_every_bookable_reservation_id_can_be_completed_and_deleted(
    selector: httpx.AsyncClient, reservation_id: str, in_path: str
) -> None:
    await selector.post("/workers", json=worker(1, "tcp://127.0.0.1:1"))
    await book(selector, reservation_id)
    assert await active_requests(selector) == 1
    assert (await selector.post(f"/reservations/{in_path}/output_block", json={})).status_code == 200
    assert (await selector.post(f"/reservations/{in_path}/prefill_complete")).status_code == 200
    deleted = await selector.delete(f"/reservations/{in_path}")
    assert (deleted.status_code, deleted.json()) == (200, {"status": "ok"})
    assert await active_requests(selector) == 0
    again = await selector.delete(f"/reservations/{in_path}")
    assert (again.status_code, again.json()) == (404, {"error": f"reservation {reservation_id} not found"})


async def test_a_slash_inside_an_id_is_not_a_path_separator(selector: httpx.AsyncClient) -> None:
    await selector.post("/workers", json=worker(1, "tcp://127.0.0.1:1"))
    await book(selector, "a")
    # /reservations/a/b is a different route shape (three segments): not reservation "a/b", nor "a".
    assert (await selector.delete("/reservations/a/b")).status_code == 404
    assert (await selector.delete("/reservations/a%2Fb")).json() == {"error": "reservation a/b not found"}
    assert await active_requests(selector) == 1


@pytest.mark.parametrize("method", ["PATCH", "DELETE"])
@pytest.mark.parametrize("raw_id", ["%C2%B2", "%FF", "", "1%2F2", "-1", "18446744073709551616"])
async def test_a_worker_id_that_is_not_a_u64_is_400(selector: httpx.AsyncClient, method: str, raw_id: str) -> None:
    response = await selector.request(method, f"/workers/{raw_id}", json={})
    assert response.status_code == 400
    assert set(response.json()) == {"error"}


async def test_literal_segments_match_decoded_and_never_empty(selector: httpx.AsyncClient) -> None:
    assert (await selector.get("/he%61lth")).json() == {"status": "ok"}
    assert (await selector.get("/health/")).status_code == 404
    assert (await selector.get("/health%2F")).status_code == 404
    bad = await selector.get("/%FF")
    assert bad.status_code == 400 and set(bad.json()) == {"error"}
