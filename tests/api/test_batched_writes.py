"""Slot tracker writes batched into one service call (``SlotService.apply_writes``) by POST /batch and the
command stream: interleaved scopes and refusals in the middle of a run of writes answer exactly as each
request on its own route, in both layouts (the stream in both its formats); results received over the
stream survive kill -9."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import msgpack
import orjson
import trio

from kvrouter.api.process.main import ServiceHandle
from kvrouter.client import StreamClient
from kvrouter.client.compact import FIELDS, OPTIONAL, PATHS, ROUTE, SUBPROTOCOL
from kvrouter.client.stream import open_websocket
from tests.api.test_batch import batched, cmd, one_by_one
from tests.api.test_cli import CLI, Service
from tests.api.test_command_stream import results, send, with_id, ws_url
from tests.api.test_compact_stream import as_json_result, compact_results

JsonCommand = dict[str, Any]


def scoped(body: dict[str, Any], model: str, tenant: str | None) -> dict[str, Any]:
    return {**body, "model_name": model, **({"tenant_id": tenant} if tenant else {})}


def interleaved(first: str, second: str) -> list[JsonCommand]:
    """Writes of two scopes (the second with a tenant) interleaved, refusals of every kind among them, and
    reads in between that must see every write before them."""

    def a(path: str, body: dict[str, Any]) -> JsonCommand:
        return cmd("POST", path, scoped(body, first, None))

    def b(path: str, body: dict[str, Any]) -> JsonCommand:
        return cmd("POST", path, scoped(body, second, "t1"))

    worker = {"worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 2}

    def request(request_id: str, worker_id: int = 1, hashes: list[Any] | None = None) -> dict[str, Any]:
        return {"request_id": request_id, "worker_id": worker_id, "dp_rank": 1, "sequence_hashes": hashes or [1, 2]}

    return [
        b("/free", {"request_id": "before"}),  # no scope yet
        a("/register", worker),
        b("/add", request("r1")),  # 404: no tracker yet
        b("/register", worker),
        a("/add", {"request_id": "bad"}),  # 422: fields missing
        b("/add", request("r1", hashes=[-1, 2**63 - 1])),
        a("/prefill_complete", {"request_id": "ghost"}),  # 404
        a("/add", request("r2", worker_id=99)),  # 404: no such worker
        a("/add", request("r1", hashes=[3, 4, 5])),
        a("/add", request("r1", hashes=[3])),  # the same id again
        a("/prefill_complete", {"request_id": "r1"}),
        b("/free", {"request_id": "r1"}),
        a("/register", worker),  # 409: registered already
        a("/add", request("r3", hashes=["x"])),  # 422: not a hash
        cmd("POST", "/add", "not an object"),
        cmd("GET", f"/loads?model_name={first}"),
        cmd("GET", f"/loads?model_name={second}"),
        b("/add", request("r2", hashes=[7])),
        a("/free", {"request_id": "r1"}),
        a("/add", request("r4")),
        cmd("POST", "/unregister", {"model_name": first, "worker_id": 1}),
        a("/add", request("r5")),  # 404: the scope dissolved with its last worker
        cmd("GET", f"/loads?model_name={first}"),
        cmd("GET", f"/workers?model_name={second}"),
    ]


def renamed(answers: list[dict[str, Any]], names: dict[str, str]) -> list[dict[str, Any]]:
    text = orjson.dumps(answers).decode()
    for old, new in names.items():
        text = text.replace(old, new)
    return orjson.loads(text)  # type: ignore[no-any-return]


async def test_batched_writes_answer_as_their_routes(slot_tracker: ServiceHandle) -> None:
    url = slot_tracker.urls[0]
    expected = await one_by_one(url, interleaved("XoneAX", "XoneBX"))
    statuses = {answer["status"] for answer in expected}
    assert statuses == {200, 201, 404, 409, 422}

    got = await batched(url, interleaved("XbatchAX", "XbatchBX"))
    assert renamed(got, {"XbatchAX": "XoneAX", "XbatchBX": "XoneBX"}) == expected

    async with open_websocket(ws_url(url)) as ws:
        commands = interleaved("XstreamAX", "XstreamBX")
        await send(ws, [with_id(i, command) for i, command in enumerate(commands)], ordered=True)
        found = await results(ws, len(commands))
    streamed = [{"status": found[i]["status"], "body": found[i]["body"]} for i in range(len(commands))]
    assert renamed(streamed, {"XstreamAX": "XoneAX", "XstreamBX": "XoneBX"}) == expected

    async with open_websocket(ws_url(url), subprotocols=[SUBPROTOCOL]) as ws:
        commands = [to_compact(i, command) for i, command in enumerate(interleaved("XpackAX", "XpackBX"))]
        assert sum(command[1] != ROUTE for command in commands) >= 10  # the hot writes positional
        await ws.send_message(msgpack.packb([True, commands]))
        packed = await compact_results(ws, len(commands))
    streamed = [as_json_result(packed[i]) for i in range(len(commands))]
    streamed = [{"status": answer["status"], "body": answer["body"]} for answer in streamed]
    assert renamed(streamed, {"XpackAX": "XoneAX", "XpackBX": "XoneBX"}) == expected


def to_compact(command_id: int, command: JsonCommand) -> list[Any]:
    """``command`` in the compact format: a hot write whose body has exactly its fields as positional fields,
    any other command as a route with its body as JSON bytes."""
    body = command.get("body")
    for code, path in PATHS.items():
        names = FIELDS[code]
        if command["path"] == path and type(body) is dict and set(names) - OPTIONAL <= set(body) <= set(names):
            return [command_id, code, *(body.get(name) for name in names)]
    if "body" in command:
        return [command_id, ROUTE, command["method"], command["path"], orjson.dumps(body)]
    return [command_id, ROUTE, command["method"], command["path"]]


def test_results_of_many_writes_per_message_survive_kill_9(tmp_path: Path) -> None:
    """64 callers on one stream: their adds share messages (and so batches); every add answered before the
    SIGKILL is there after the restart."""
    data = ["--data-dir", str(tmp_path / "data"), "--durability", "always"]
    service = Service([*CLI, "slot-tracker", *data], tmp_path)
    answered: list[bool] = []
    messages = 0
    try:
        url = f"http://127.0.0.1:{service.port}"

        async def run() -> None:
            nonlocal messages
            async with StreamClient.connect(url) as client:
                for model in ("a", "b"):
                    await client.register(1, block_size=16, dp_size=2, model_name=model)

                async def caller(i: int) -> None:
                    model = "ab"[i % 2]
                    for j in range(5):
                        answered.append(
                            await client.add(
                                f"r{i}-{j}", 1, [100 * i + j, 10_000 + 100 * i + j], dp_rank=i % 2, model_name=model
                            )
                        )

                async with trio.open_nursery() as nursery:
                    for i in range(64):
                        nursery.start_soon(caller, i)
                messages = client.messages_sent

        trio.run(run)
        service.process.kill()  # SIGKILL, right after the last result arrived
        assert service.process.wait(30) == -9
    finally:
        service.kill()
    assert answered == [True] * 320 and messages < 100  # most messages carried many adds
    restarted = Service([*CLI, "slot-tracker", *data], tmp_path)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{restarted.port}/loads", timeout=30) as response:
            loads = orjson.loads(response.read())
    finally:
        restarted.stop()
    blocks = {(row["model_name"], row["dp_rank"]): row["active_decode_blocks"] for row in loads}
    assert blocks == {("a", 0): 320, ("a", 1): 0, ("b", 0): 0, ("b", 1): 320}
