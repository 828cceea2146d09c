"""A key written twice in a JSON body: a repeated field is refused as 1.6.1's serde refuses it, on every body path.

Before, orjson kept the last value and the request went through: ``{"worker_id": 7, "worker_id": 8}`` registered
worker 8. 1.6.1 answers 422 ``duplicate field `worker_id``` for a field of a struct at any depth, and keeps the
last value of a map's key and of an unknown field (``tests/test_conformance.py`` checks both against it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from trio_websocket import ConnectionClosed

from kvrouter.api.bodies import select_body_reader
from kvrouter.api.bodies.schemas import AddBody, RegisterBody
from kvrouter.api.bodies.select_schemas import SelectBody, WorkerBody
from kvrouter.api.http.json_keys import find_repeated, repeated_field
from kvrouter.client.stream import open_websocket
from tests.api.test_command_stream import results, ws_url
from tests.support.services import running

FAILED = "Failed to deserialize the JSON body into the target type: "
REGISTER = b'{"model_name":"m","worker_id":7,"block_size":16,"dp_start":0,"dp_size":1'


async def post(url: str, path: str, raw: bytes, method: str = "POST") -> tuple[int, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        response = await http.request(method, path, content=raw, headers={"content-type": "application/json"})
    return response.status_code, response.json() if response.content else None


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (REGISTER + b',"worker_id":8}', "duplicate field `worker_id`"),
        (REGISTER + b',"model\\u005fname":"n"}', "duplicate field `model_name`"),  # the same key, escaped
        (REGISTER + b' , "dp_size" : 2}', "duplicate field `dp_size`"),  # spaces around the colon
        (REGISTER + b',"zzz":1,"zzz":2}', None),  # an unknown field: ignored, as in 1.6.1
        (REGISTER + b',"x":{"a":1,"a":2}}', None),  # within an unknown field
        (REGISTER + b',"url":"http://h:1","x":"\\":"}', None),  # colons (and a ":) in strings, no repeat
    ],
)
async def test_the_slot_tracker_refuses_a_repeated_field(tmp_path: Path, raw: bytes, problem: str | None) -> None:
    async with running("slot tracker", tmp_path) as service:
        url = service.urls[0]
        status, body = await post(url, "/register", raw)
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            workers = (await http.get("/workers")).json()
    if problem is None:
        assert (status, body, [w["worker_id"] for w in workers]) == (201, {"status": "ok"}, [7])
    else:  # before: 201, and the last value won (worker 8, model n, 2 ranks)
        assert (status, body, workers) == (422, {"error": FAILED + problem}, [])


WORKER = {
    "worker_id": 1,
    "model_name": "m",
    "endpoint": "http://w1",
    "block_size": 4,
    "kv_events_endpoint": "tcp://h:9",
}
PROMPT = b'{"model_name":"m","token_ids":[1,2,3,4,5,6,7,8]'


@pytest.mark.parametrize(
    ("method", "path", "raw", "status", "problem"),
    [
        ("POST", "/select", PROMPT + b',"model_name":"m"}', 422, "duplicate field `model_name`"),
        ("POST", "/select", PROMPT + b',"token_ids":[1]}', 422, "duplicate field `token_ids`"),
        (
            "POST",
            "/select",
            PROMPT + b',"router_config_override":{"router_temperature":0.0,"router_temperature":1.0}}',
            422,
            "router_config_override: duplicate field `router_temperature`",
        ),
        (
            "POST",
            "/select",
            PROMPT + b',"pinned_worker":{"worker_id":1,"dp_rank":0,"worker_id":1}}',
            422,
            "pinned_worker: duplicate field `worker_id`",
        ),
        ("POST", "/select", PROMPT + b',"router_config_override":{"zz":0,"zz":1}}', 200, None),
        ("POST", "/select", PROMPT + b',"routing_constraints":{"preferred_taints":{"a":1,"a":2}}}', 200, None),
        ("POST", "/select_and_reserve", PROMPT + b',"reservation_id":"a","reservation_id":"b"}', 422, None),
        ("POST", "/overlap_scores", PROMPT + b',"token_ids":[1]}', 422, "duplicate field `token_ids`"),
        ("POST", "/potential_loads", PROMPT + b',"model_name":"m"}', 422, "duplicate field `model_name`"),
        ("PATCH", "/workers/1", b'{"block_size":4,"block_size":8}', 422, "duplicate field `block_size`"),
        ("PATCH", "/workers/1", b'{"taints":["a"],"zz":1,"zz":2}', 200, None),
        (
            "POST",
            "/workers",
            orjson.dumps(WORKER)[:-1] + b',"topology_domains":{"rack":"a","rack":"b"}}',  # a map: the last wins
            201,
            None,
        ),
        ("POST", "/workers", orjson.dumps(WORKER)[:-1] + b',"endpoint":"http://w9"}', 422, None),
    ],
)
async def test_the_selection_service_refuses_a_repeated_field_at_any_depth(
    tmp_path: Path, method: str, path: str, raw: bytes, status: int, problem: str | None
) -> None:
    async with running("selection service", tmp_path) as service:
        url = service.urls[0]
        assert (await post(url, "/workers", orjson.dumps(WORKER)))[0] == 201
        got = await post(url, path, raw, method)
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            loads = (await http.get("/loads")).json()
            worker = (await http.get("/workers")).json()[0]
    assert got[0] == status, got
    if status == 422:
        assert got[1]["error"].startswith(FAILED + (problem or "")), got
        assert loads[0]["loads"][0]["active_requests"] == 0 and worker["block_size"] == 4
        assert worker["endpoint"] == "http://w1"
    if path == "/workers" and status == 201:
        assert got[1]["topology_domains"] == {"rack": "b"}


async def test_a_batch_answers_a_command_with_a_repeated_field_as_its_route_would(tmp_path: Path) -> None:
    register = b'{"method":"POST","path":"/register","body":' + REGISTER + b"}}"
    repeated = b'{"method":"POST","path":"/register","body":' + REGISTER.replace(b"7", b"9") + b',"worker_id":8}}'
    two_paths = b'{"method":"GET","path":"/workers","path":"/loads"}'
    async with running("slot tracker", tmp_path) as service:
        status, answers = await post(service.urls[0], "/batch", b"[%s,%s,%s]" % (register, repeated, two_paths))
        async with httpx.AsyncClient(base_url=service.urls[0], timeout=10) as http:
            workers = (await http.get("/workers")).json()
    assert status == 200
    assert answers[0] == {"status": 201, "body": {"status": "ok"}}
    assert answers[1] == {"status": 422, "body": {"error": FAILED + "duplicate field `worker_id`"}}
    assert answers[2]["status"] == 400 and "`path` twice" in answers[2]["body"]["error"]
    assert [w["worker_id"] for w in workers] == [7]


async def test_the_command_stream_refuses_a_repeated_field_and_a_repeated_message_key(tmp_path: Path) -> None:
    message = b'{"commands":[{"id":1,"method":"POST","path":"/register","body":' + REGISTER + b',"worker_id":8}}]}'
    async with running("slot tracker", tmp_path) as service:
        async with open_websocket(ws_url(service.urls[0])) as ws:
            await ws.send_message(message.decode())
            found = await results(ws, 1)
            assert found[1] == {"id": 1, "status": 422, "body": {"error": FAILED + "duplicate field `worker_id`"}}
        for twice, reason in [
            ('{"commands":[],"ordered":true,"ordered":false}', "`ordered` twice"),
            ('{"commands":[{"id":1,"id":2,"method":"GET","path":"/health"}]}', "and only one"),
        ]:
            async with open_websocket(ws_url(service.urls[0])) as ws:
                await ws.send_message(twice)
                with pytest.raises(ConnectionClosed) as closed:
                    await ws.get_message()
            assert closed.value.reason.code == 1007 and reason in (closed.value.reason.reason or "")


def test_the_select_body_reader_leaves_a_repeated_key_to_the_general_path() -> None:
    assert select_body_reader.read_select_body(PROMPT + b"}") is not None
    assert select_body_reader.read_select_body(PROMPT + b',"model_name":"m"}') is None


def check(cls: type, raw: bytes) -> str | None:
    repeated = find_repeated(raw, orjson.loads(raw))
    return None if repeated is None else repeated_field(cls, repeated)


def test_finding_repeated_keys() -> None:
    assert check(AddBody, b'{"model_name":"m","request_id":"a","request_id":"b"}') == "duplicate field `request_id`"
    assert check(SelectBody, b'{"model_name":"m","token_ids":[1,2,3]}') is None
    assert check(WorkerBody, b'{"kv_events_endpoints":{"0":"tcp://a:1","0":"tcp://a:2"}}') is None  # a map
    assert check(RegisterBody, b'[{"a":1,"a":2}]') is None  # not an object: the body's parse words that
    # A repeat deep inside a body, within lists: found, and named where it is when it is a struct's.
    deep = {"allowed_worker_ids": [1, 2], "session_context": {"session_id": "s", "session_final": True}}
    raw = orjson.dumps(deep)[:-2] + b',"session_final":false}}'
    assert check(SelectBody, raw) == "session_context: duplicate field `session_final`"
    # Nesting as deep as orjson takes it costs no recursion.
    nested = b'{"x":' * 1023 + b"{}" + b"}" * 1023
    assert check(SelectBody, nested) is None
    assert check(SelectBody, b'{"x":' * 1023 + b'{"a":1,"a":2}' + b"}" * 1023) is None
    assert check(SelectBody, b'{"model_name":"a:b","lora_name":"c","lora_name":"d"}') == "duplicate field `lora_name`"
    assert check(SelectBody, json.dumps({"a": ["x: y"] * 3, "b": 1}).encode()) is None
