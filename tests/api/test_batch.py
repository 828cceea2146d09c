"""POST /batch on both services (real hypercorn on port 0): each command answered exactly as its own route
answers the same request, in order, a rejected command changing nothing, and the batch's bounds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import trio

from kvrouter.api.process.main import SLOT_TRACKER_BODY_LIMIT, ServiceHandle
from kvrouter.api.streams.command_runner import MAX_BATCH_COMMANDS
from tests.support.services import running

JsonCommand = dict[str, Any]


def cmd(method: str, path: str, body: Any = None) -> JsonCommand:
    command: JsonCommand = {"method": method, "path": path}
    if body is not None:
        command["body"] = body
    return command


def register(worker_id: int, model: str = "m") -> JsonCommand:
    body = {"model_name": model, "worker_id": worker_id, "block_size": 16, "dp_start": 0, "dp_size": 2}
    return cmd("POST", "/register", body)


def add(request_id: str, model: str = "m", worker_id: int = 1, first_hash: int = 1) -> JsonCommand:
    body = {"model_name": model, "request_id": request_id, "worker_id": worker_id, "dp_rank": 0}
    hashes = [first_hash, first_hash + 1, first_hash + 2]
    return cmd("POST", "/add", {**body, "sequence_hashes": hashes, "new_isl_tokens": 48})


def ref(path: str, request_id: str, model: str = "m") -> JsonCommand:
    return cmd("POST", path, {"model_name": model, "request_id": request_id})


SLOT_TRACKER_COMMANDS = [
    register(1),
    register(1),
    cmd("POST", "/register", {"model_name": "m", "worker_id": "one", "block_size": 16, "dp_start": 0, "dp_size": 1}),
    add("r1"),
    add("r1"),
    add("r2", worker_id=99),
    ref("/prefill_complete", "r1"),
    cmd("GET", "/loads"),
    cmd("GET", "/workers?model_name=m"),
    cmd("GET", "/loads?model_name=a&model_name=b"),
    cmd("POST", "/potential_loads", {"model_name": "m", "sequence_hashes": [1, 9], "new_isl_tokens": 32}),
    ref("/free", "r1"),
    ref("/free", "r1"),
    ref("/prefill_complete", "ghost"),
    cmd("POST", "/add"),
    cmd("POST", "/add", [1, 2]),
    cmd("DELETE", "/add"),
    cmd("GET", "/nowhere"),
    cmd("GET", "/health"),
    cmd("HEAD", "/loads"),
    cmd("POST", "/unregister", {"model_name": "m", "worker_id": 1}),
    cmd("GET", "/workers"),
]

WORKER = {
    "worker_id": 5,
    "model_name": "m",
    "endpoint": "http://w5",
    "block_size": 4,
    "kv_events_endpoint": "tcp://127.0.0.1:9",
}
PROMPT = {"model_name": "m", "token_ids": list(range(12))}
SELECTION_COMMANDS = [
    cmd("POST", "/select", PROMPT),
    cmd("POST", "/workers", WORKER),
    cmd("POST", "/workers", {**WORKER, "worker_id": 6, "endpoint": "http://w6"}),
    cmd("POST", "/workers", {"worker_id": "x"}),
    cmd("POST", "/select", {**PROMPT, "selection_id": "s1"}),
    cmd("POST", "/select_and_reserve", {**PROMPT, "reservation_id": "b1"}),
    cmd("POST", "/select_and_reserve", {**PROMPT, "reservation_id": "b1"}),
    cmd("POST", "/reservations", {"model_name": "m", "selection_id": "s1"}),
    cmd("POST", "/reservations/b1/prefill_complete"),
    cmd("POST", "/reservations/b1/output_block", {"decay_fraction": 2.0}),
    cmd("GET", "/loads"),
    cmd("DELETE", "/reservations/b1"),
    cmd("DELETE", "/reservations/b1"),
    cmd("PATCH", "/workers/6", {"endpoint": "http://w6b"}),
    cmd("DELETE", "/workers/77"),
    cmd("DELETE", "/workers/%C2%B2"),
    cmd("POST", "/select_disaggregated", {**PROMPT, "pinned_worker": {"worker_id": 5, "dp_rank": 0}}),
    cmd("GET", "/workers"),
    cmd("GET", "/dump"),
]


def shown(value: Any) -> Any:
    """A worker listing without its live KV-listener health (it changes with time, not with commands)."""
    if isinstance(value, list):
        return [shown(item) for item in value]
    if isinstance(value, dict):
        return {k: shown(v) for k, v in value.items() if k not in ("kv_listeners", "kv_modes")}
    return value


def as_result(response: httpx.Response, method: str) -> dict[str, Any]:
    """A single route's answer in a batch result's shape."""
    if not response.content:
        body = None
    elif response.headers.get("content-type", "").startswith("application/json"):
        body = response.json()
    else:
        body = response.text
    result = {"status": response.status_code, "body": shown(body)}
    if "allow" in response.headers:
        result["allow"] = response.headers["allow"]
    return result


async def one_by_one(url: str, commands: list[JsonCommand]) -> list[dict[str, Any]]:
    answers = []
    async with httpx.AsyncClient(base_url=url) as client:
        for command in commands:
            content = orjson.dumps(command["body"]) if "body" in command else None
            headers = {"content-type": "application/json"}  # what a command is sent as
            response = await client.request(command["method"], command["path"], content=content, headers=headers)
            answers.append(as_result(response, command["method"]))
    return answers


async def batched(url: str, commands: list[Any], headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/batch", json=commands, headers=headers)
    assert response.status_code == 200, response.text
    results = response.json()
    assert len(results) == len(commands)
    flattened = []
    for result in results:
        entry = {"status": result["status"], "body": shown(result["body"])}
        if "allow" in result.get("headers", {}):
            entry["allow"] = result["headers"]["allow"]
        flattened.append(entry)
    return flattened


async def test_each_slot_tracker_command_answers_as_its_route(tmp_path: Path) -> None:
    async with running("slot tracker", tmp_path / "one") as single:
        expected = await one_by_one(single.urls[0], SLOT_TRACKER_COMMANDS)
    async with running("slot tracker", tmp_path / "batch") as service:
        got = await batched(service.urls[0], SLOT_TRACKER_COMMANDS)
    assert got == expected
    statuses = [result["status"] for result in got]
    assert 201 in statuses and 422 in statuses and 404 in statuses and 405 in statuses and 400 in statuses


async def test_each_selection_command_answers_as_its_route(tmp_path: Path) -> None:
    async with running("selection service", tmp_path / "one") as single:
        expected = await one_by_one(single.urls[0], SELECTION_COMMANDS)
    async with running("selection service", tmp_path / "batch") as service:
        got = await batched(service.urls[0], SELECTION_COMMANDS)
    assert got == expected
    assert {result["status"] for result in got} >= {200, 201, 400, 404, 409, 422, 503}


async def test_commands_of_one_scope_apply_in_order(slot_tracker: ServiceHandle) -> None:
    """Lifecycles whose every step depends on the one before (prefill_complete and free of a request not yet
    added answer 404), interleaved over two scopes, then reads that must see all of them. In both layouts:
    through a front's proxy, the calls of one message must reach the actors in the order they were sent."""
    commands = [register(1, "a"), register(1, "b")]
    for i in range(150):
        for model in ("a", "b"):
            commands += [add(f"r{i}", model, first_hash=10 * i), ref("/prefill_complete", f"r{i}", model)]
    commands += [ref("/free", f"r{i}", model) for i in range(0, 150, 2) for model in ("a", "b")]
    commands.append(cmd("GET", "/loads"))
    results = await batched(slot_tracker.urls[0], commands)
    statuses = {(c["path"], r["status"]) for c, r in zip(commands[:-1], results[:-1], strict=True)}
    assert statuses == {("/register", 201), ("/add", 201), ("/prefill_complete", 200), ("/free", 200)}
    loads = results[-1]["body"]
    # 75 requests left per scope, each 3 blocks of decode on rank 0 and none prefilling any more
    assert {(row["model_name"], row["dp_rank"]): row["active_decode_blocks"] for row in loads} == {
        ("a", 0): 225,
        ("a", 1): 0,
        ("b", 0): 225,
        ("b", 1): 0,
    }
    assert all(row["active_prefill_tokens"] == 0 for row in loads)


async def state_of(client: httpx.AsyncClient) -> tuple[Any, Any]:
    return (await client.get("/workers")).json(), (await client.get("/loads")).json()


async def test_rejected_commands_change_nothing(tmp_path: Path) -> None:
    async with running("slot tracker", tmp_path) as service, httpx.AsyncClient(base_url=service.urls[0]) as client:
        await batched(service.urls[0], [register(1), add("r1")])
        before = await state_of(client)
        rejected = [
            cmd("POST", "/register", {"model_name": "m", "worker_id": 1, "block_size": 8, "dp_start": 0, "dp_size": 2}),
            cmd("POST", "/register", {"model_name": "m", "worker_id": -1, "block_size": 16}),
            add("r1"),  # already there: answered, nothing new
            add("r9", worker_id=42),
            cmd("POST", "/add", {"model_name": "m", "request_id": "r8", "worker_id": 1, "dp_rank": 7}),
            ref("/free", "never"),
            7,
            cmd("POST", "/free"),
        ]
        results = await batched(service.urls[0], rejected)
        assert all(result["status"] >= 400 or result["status"] == 200 for result in results), results
        assert await state_of(client) == before


async def test_a_batch_beyond_its_bounds_is_refused_whole(tmp_path: Path) -> None:
    async with running("slot tracker", tmp_path) as service, httpx.AsyncClient(base_url=service.urls[0]) as client:
        too_many = [register(1)] + [cmd("GET", "/health")] * MAX_BATCH_COMMANDS
        response = await client.post("/batch", json=too_many)
        assert response.status_code == 413
        assert f"at most {MAX_BATCH_COMMANDS} commands" in response.json()["error"]
        status, error = await declared_too_long(service.urls[0], "/batch", SLOT_TRACKER_BODY_LIMIT + 1)
        assert status == 413 and "length limit exceeded" in error
        for not_a_batch in ({"commands": []}, "x", 1):
            response = await client.post("/batch", json=not_a_batch)
            assert response.status_code == 400 and response.json()["error"] == "a batch is a JSON array of commands"
        assert (await client.post("/batch", json=[])).json() == []
        assert (await client.get("/workers")).json() == []


async def test_a_batch_needs_the_token_and_its_commands_need_no_other(tmp_path: Path) -> None:
    async with running("slot tracker", tmp_path, token="tok") as service:
        async with httpx.AsyncClient(base_url=service.urls[0]) as client:
            refused = await client.post("/batch", json=[register(1)])
            assert refused.status_code == 401 and "bearer token" in refused.json()["error"]
        results = await batched(service.urls[0], [register(1)], {"authorization": "Bearer tok"})
        assert results[0]["status"] == 201


async def declared_too_long(base_url: str, path: str, length: int) -> tuple[int, str]:
    """Status and error of a POST whose Content-Length is over the limit, its body never sent.

    The service refuses such a request from its headers alone. Sending the body too would race: the
    service answers and closes with the body unread, and the kernel may reset the connection before the
    client reads the answer (a connection reset failed this test under load)."""
    url = httpx.URL(base_url)
    stream = await trio.open_tcp_stream(url.host, url.port or 80)
    async with stream:
        head = f"POST {path} HTTP/1.1\r\nhost: {url.host}\r\ncontent-type: application/json\r\n"
        await stream.send_all(f"{head}content-length: {length}\r\n\r\n".encode())
        received = b""
        with trio.fail_after(30):
            while b"\r\n\r\n" not in received or len(received.partition(b"\r\n\r\n")[2]) < _declared(received):
                chunk = await stream.receive_some()
                assert chunk, f"the service closed before answering in full: {received!r}"
                received += chunk
    head_bytes, _, body = received.partition(b"\r\n\r\n")
    return int(head_bytes.split(b" ", 2)[1]), orjson.loads(body[: _declared(received)])["error"]


def _declared(received: bytes) -> int:
    """The content-length of the response head in ``received`` (0 until the head is complete)."""
    head = received.partition(b"\r\n\r\n")[0].lower()
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip() == b"content-length":
            return int(value)
    return 0


async def test_an_unordered_batch_answers_each_command_as_its_route(tmp_path: Path) -> None:
    """``POST /batch?ordered=false``: independent commands (many clients' selections), each answered as on its
    own route; an ``ordered`` other than true or false is a 400 and runs nothing."""
    workers = [cmd("POST", "/workers", WORKER), cmd("POST", "/workers", {**WORKER, "worker_id": 6, "endpoint": "h"})]
    independent = [cmd("POST", "/select_and_reserve", {**PROMPT, "reservation_id": f"u{n}"}) for n in range(20)]
    independent += [cmd("POST", "/select", PROMPT), cmd("POST", "/select_and_reserve", {"model_name": "m"})]
    async with running("selection service", tmp_path) as service, httpx.AsyncClient(base_url=service.urls[0]) as http:
        await batched(service.urls[0], workers)
        for bad in ("maybe", "", "False", "0"):
            refused = await http.post("/batch", params={"ordered": bad}, json=independent)
            assert refused.status_code == 400, refused.text
            assert refused.json() == {"error": f"`ordered` must be true or false, not {bad!r}"}
        assert (await http.delete("/reservations/u0")).status_code == 404  # nothing ran
        answer = await http.post("/batch", params={"ordered": "false"}, json=independent)
        assert answer.status_code == 200, answer.text
        results = answer.json()
        assert [r["status"] for r in results] == [200] * 21 + [400], results
        assert sorted(r["body"]["reservation_id"] for r in results[:20]) == sorted(f"u{n}" for n in range(20))
        releases = [cmd("DELETE", f"/reservations/u{n}") for n in range(20)]
        released = await http.post("/batch?ordered=false", json=releases)
        assert [r["status"] for r in released.json()] == [200] * 20
        assert (await http.delete("/reservations/u0")).status_code == 404
