"""The slot tracker over real HTTP (hypercorn on 127.0.0.1, ephemeral port): every route and status."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import orjson
import pytest

from tests.support.raw_http import exchange, request_bytes

REG = {"worker_id": 7, "model_name": "llama", "tenant_id": "default", "block_size": 16, "dp_start": 0, "dp_size": 2}


async def post(client: httpx.AsyncClient, path: str, body: object) -> httpx.Response:
    return await client.post(path, json=body)


async def register(client: httpx.AsyncClient, **overrides: object) -> httpx.Response:
    return await post(client, "/register", {**REG, **overrides})


def add_body(request_id: str, hashes: list[int], isl: int = 0, rank: int = 0, worker: int = 7) -> dict:
    return {
        "model_name": "llama",
        "request_id": request_id,
        "worker_id": worker,
        "dp_rank": rank,
        "sequence_hashes": hashes,
        "new_isl_tokens": isl,
    }


async def test_health_is_200_with_an_empty_body(client: httpx.AsyncClient) -> None:
    response = await client.get("/health")
    assert response.status_code == 200 and response.content == b""
    assert "content-type" not in response.headers


async def test_register_lists_workers_and_zero_loads(client: httpx.AsyncClient) -> None:
    response = await register(client)
    assert (response.status_code, response.json()) == (201, {"status": "ok"})
    workers = (await client.get("/workers")).json()
    assert workers == [
        {
            "worker_id": 7,
            "model_name": "llama",
            "tenant_id": "default",
            "routing_group": "default",
            "block_size": 16,
            "dp_start": 0,
            "dp_size": 2,
        }
    ]
    loads = (await client.get("/loads")).json()
    assert [(r["dp_rank"], r["active_prefill_tokens"], r["active_decode_blocks"]) for r in loads] == [
        (0, 0, 0),
        (1, 0, 0),
    ]


async def test_lifecycle_moves_loads(client: httpx.AsyncClient) -> None:
    await register(client)
    assert (await post(client, "/add", add_body("r1", [101, -22, 303], isl=48))).status_code == 201
    row = (await client.get("/loads", params={"model_name": "llama"})).json()[0]
    assert (row["active_prefill_tokens"], row["active_decode_blocks"]) == (48, 3)
    potential = (
        await post(
            client,
            "/potential_loads",
            {"model_name": "llama", "sequence_hashes": [101, -22, 303, 404], "new_isl_tokens": 48},
        )
    ).json()
    by_rank = {p["dp_rank"]: p for p in potential}
    assert by_rank[0] == {
        "worker_id": 7,
        "dp_rank": 0,
        "potential_prefill_tokens": 96,
        "potential_decode_blocks": 4,
        "active_requests": 1,
    }
    assert by_rank[1]["potential_decode_blocks"] == 4 and by_rank[1]["potential_prefill_tokens"] == 48
    ref = {"model_name": "llama", "request_id": "r1"}
    assert (await post(client, "/prefill_complete", ref)).status_code == 200
    assert (await post(client, "/prefill_complete", ref)).status_code == 200
    row = (await client.get("/loads")).json()[0]
    assert (row["active_prefill_tokens"], row["active_decode_blocks"]) == (0, 3)
    assert (await post(client, "/free", ref)).json() == {"status": "ok"}
    assert (await post(client, "/free", ref)).status_code == 200
    row = (await client.get("/loads")).json()[0]
    assert (row["active_prefill_tokens"], row["active_decode_blocks"]) == (0, 0)


async def test_write_errors_carry_the_reference_messages(client: httpx.AsyncClient) -> None:
    await register(client)
    cases = [
        ("/register", {**REG, "block_size": 0}, 400, "block_size must be greater than 0"),
        ("/register", {**REG, "dp_size": 0}, 400, "dp_size must be greater than 0"),
        (
            "/register",
            {**REG, "dp_start": 4294967295, "dp_size": 1},
            400,
            "dp range overflows u32: start=4294967295 size=1",
        ),
        ("/register", REG, 409, "worker 7 already registered for model=llama tenant_id=default"),
        (
            "/register",
            {**REG, "worker_id": 8, "block_size": 32},
            409,
            "block_size mismatch for model=llama tenant_id=default: existing=16, requested=32",
        ),
        (
            "/unregister",
            {"worker_id": 9, "model_name": "llama"},
            404,
            "worker 9 not found for model=llama tenant_id=default",
        ),
        (
            "/add",
            {**add_body("r", [1]), "model_name": "other"},
            404,
            "no slot tracker for model=other tenant_id=default",
        ),
        ("/prefill_complete", {"model_name": "llama", "request_id": "nope"}, 404, "Request nope not found"),
        ("/free", {"model_name": "other", "request_id": "x"}, 404, "no slot tracker for model=other tenant_id=default"),
        (
            "/potential_loads",
            {"model_name": "other", "sequence_hashes": []},
            404,
            "no slot tracker for model=other tenant_id=default",
        ),
    ]
    for path, body, status, message in cases:
        response = await post(client, path, body)
        assert (response.status_code, response.json()) == (status, {"error": message}), path
    response = await post(client, "/add", add_body("r", [1], rank=2))
    assert response.json() == {"error": "Worker WorkerWithDpRank { worker_id: 7, dp_rank: 2 } not found"}
    assert (await post(client, "/add", add_body("dup", [1]))).status_code == 201
    response = await post(client, "/add", add_body("dup", [2], rank=1))
    assert response.json() == {
        "error": "Request dup already exists (assigned to worker WorkerWithDpRank { worker_id: 7, dp_rank: 0 })"
    }
    loads = (await client.get("/loads")).json()
    assert [r["active_decode_blocks"] for r in loads] == [1, 0]  # the rejected adds booked nothing


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"block_size": 16, "dp_start": 0, "dp_size": 1, "worker_id": 1}, "missing field `model_name`"),
        ({**REG, "worker_id": "7"}, "worker_id: invalid type"),
        ({**REG, "worker_id": 1.5}, "worker_id: invalid type"),
        ({**REG, "worker_id": -1}, "worker_id: invalid value"),
        ({**REG, "worker_id": 2**64}, "worker_id: invalid"),
        ({**REG, "dp_size": None}, "dp_size: invalid type: null"),
        ({**REG, "worker_id": True}, "worker_id: invalid type"),
        ([1, 2], "invalid type: sequence"),
    ],
)
async def test_wrong_types_are_422_and_change_nothing(client: httpx.AsyncClient, body: object, fragment: str) -> None:
    response = await post(client, "/register", body)
    assert response.status_code == 422
    assert response.json()["error"].startswith("Failed to deserialize the JSON body into the target type: ")
    assert fragment in response.json()["error"]
    assert (await client.get("/workers")).json() == []


async def test_hash_range_and_missing_hashes_are_422(client: httpx.AsyncClient) -> None:
    await register(client)
    for hashes in ([2**63], [2**64 - 1], ["1"]):
        assert (await post(client, "/add", add_body("r", hashes))).status_code == 422
    body = add_body("r", [])
    del body["sequence_hashes"]
    assert (await post(client, "/add", body)).status_code == 422
    assert (await post(client, "/add", {**add_body("r", [1]), "new_isl_tokens": -1})).status_code == 422


async def test_transport_errors(client: httpx.AsyncClient) -> None:
    cases = [
        (await client.post("/register", content=b"{not json", headers={"content-type": "application/json"}), 400),
        (await client.post("/register", content=b"", headers={"content-type": "application/json"}), 400),
        (await client.post("/register", content=b"{}", headers={"content-type": "text/plain"}), 415),
        (await client.post("/register", content=b"{}"), 415),
        (await client.get("/nowhere"), 404),
        (await client.get("/health/"), 404),
        (await client.get("/register"), 405),
        (await client.post("/loads", json={}), 405),
    ]
    for response, status in cases:
        assert response.status_code == status
        assert response.headers["content-type"] == "application/json"
        assert set(response.json()) == {"error"}
    assert (await client.get("/nowhere")).json() == {"error": "route not found"}
    assert (await client.get("/register")).json() == {"error": "method not allowed"}


async def test_body_limit_is_two_mebibytes(client: httpx.AsyncClient) -> None:
    await register(client)
    body = b'{"model_name": "llama", "request_id": "r"}'
    limit = 2 * 1024 * 1024
    padded = body[:-1] + b" " * (limit - len(body)) + b"}"
    assert len(padded) == limit
    headers = {"content-type": "application/json"}
    assert (await client.post("/free", content=padded, headers=headers)).status_code == 200
    # Refused from its content-length, before a byte of the body is read (a raw socket sends only the head).
    head = request_bytes("POST", "/free", headers={**headers, "content-length": str(limit + 1)})
    too_big = await exchange(str(client.base_url), head)
    assert too_big.status == 413 and "error" in too_big.json()  # type: ignore[operator]


async def test_routing_group_is_an_alias_for_tenant_id(client: httpx.AsyncClient) -> None:
    by_alias = {k: v for k, v in REG.items() if k != "tenant_id"} | {"routing_group": "a"}
    assert (await post(client, "/register", by_alias)).status_code == 201
    assert (await register(client, tenant_id="b")).status_code == 201
    assert len((await client.get("/workers")).json()) == 2
    only_a = (await client.get("/workers", params={"routing_group": "a"})).json()
    assert [w["tenant_id"] for w in only_a] == ["a"]
    only_b = (await client.get("/loads", params={"tenant_id": "b", "unknown": "1"})).json()
    assert {r["tenant_id"] for r in only_b} == {"b"}
    body = {**add_body("r", [1]), "routing_group": "a"}
    assert (await post(client, "/add", body)).status_code == 201


async def test_workers_and_loads_are_sorted(client: httpx.AsyncClient) -> None:
    for model, tenant, worker in [("m2", "x", 3), ("m1", "z", 2), ("m1", "a", 9), ("m1", "a", 1)]:
        await register(client, model_name=model, tenant_id=tenant, worker_id=worker, dp_size=1)
    rows = (await client.get("/workers")).json()
    assert [(r["model_name"], r["tenant_id"], r["worker_id"]) for r in rows] == [
        ("m1", "a", 1),
        ("m1", "a", 9),
        ("m1", "z", 2),
        ("m2", "x", 3),
    ]
    loads = (await client.get("/loads", params={"model_name": "m1"})).json()
    assert [(r["tenant_id"], r["worker_id"]) for r in loads] == [("a", 1), ("a", 9), ("z", 2)]


async def test_unregistering_the_last_worker_dissolves_the_tracker(client: httpx.AsyncClient) -> None:
    await register(client)
    await post(client, "/add", add_body("busy", [1, 2, 3], isl=10))
    assert (await post(client, "/unregister", {"worker_id": 7, "model_name": "llama"})).status_code == 200
    assert (await client.get("/loads")).json() == []
    assert (await post(client, "/free", {"model_name": "llama", "request_id": "busy"})).status_code == 404
    await register(client, block_size=32)
    assert {r["active_decode_blocks"] for r in (await client.get("/loads")).json()} == {0}


async def test_reference_quirks_that_clients_see(client: httpx.AsyncClient) -> None:
    assert (await client.get("/register")).headers["allow"] == "POST"
    assert (await client.post("/loads", json={})).headers["allow"] == "GET,HEAD"
    await register(client)
    head = await client.head("/loads")
    get = await client.get("/loads")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-length"] == get.headers["content-length"]
    duplicated = await client.get("/loads?model_name=a&model_name=b")
    assert duplicated.status_code == 400 and duplicated.headers["content-type"].startswith("text/plain")
    assert duplicated.text == "Failed to deserialize query string: duplicate field `model_name`"
    too_wide = await register(client, worker_id=9, dp_size=4097)
    assert too_wide.json() == {"error": "dp_size 4097 exceeds the maximum 4096"}
    null_group = await register(client, worker_id=9, tenant_id=None, routing_group=None)
    assert null_group.status_code == 422 and "null" in null_group.json()["error"]
    spaced = await client.post(
        "/free",
        content=b'{"model_name":"llama","request_id":"x"}',
        headers={"content-type": "application/json ; charset=utf-8"},
    )
    assert spaced.status_code == 415


async def test_prefill_load_never_overflows_u64(client: httpx.AsyncClient) -> None:
    await register(client)
    assert (await post(client, "/add", add_body("a", [1], isl=2**64 - 1))).status_code == 201
    overflow = await post(client, "/add", add_body("b", [2], isl=2))
    assert overflow.status_code == 400 and "overflow" in overflow.json()["error"]
    potential = (
        await post(client, "/potential_loads", {"model_name": "llama", "sequence_hashes": [], "new_isl_tokens": 5})
    ).json()
    assert max(p["potential_prefill_tokens"] for p in potential) == 2**64 - 1
    assert (await client.get("/loads")).status_code == 200


@pytest.mark.parametrize("chunked", [False, True])
async def test_a_body_of_exactly_the_limit_is_read_and_one_byte_more_is_413(
    client: httpx.AsyncClient, chunked: bool
) -> None:
    """2 MiB is inclusive, as 1.6.1's (axum's default body limit): a body of 2,097,152 bytes is parsed (here a
    registration padded with spaces: 201), one of 2,097,153 is refused with 413 without being applied."""
    limit = 2 * 1024 * 1024
    base = orjson.dumps(REG)
    for size, status in ((limit, 201), (limit + 1, 413)):
        body = base[:-1] + b" " * (size - len(base)) + b"}"
        assert len(body) == size
        answer = await client.post(
            "/register", content=_in_two(body) if chunked else body, headers={"content-type": "application/json"}
        )
        assert answer.status_code == status, (size, answer.text)
        if status == 413:
            assert answer.json() == {"error": "Failed to buffer the request body: length limit exceeded"}
        await client.post("/unregister", json={k: REG[k] for k in ("worker_id", "model_name", "tenant_id")})


async def _in_two(body: bytes) -> AsyncIterator[bytes]:
    """``body`` sent chunked (no content-length), in two chunks."""
    yield body[:65536]
    yield body[65536:]
