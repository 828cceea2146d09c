"""Where the frontend sends a client's prompt: the worker's base URL with the route joined to its path, never a URL
whose ``#`` or ``?`` drops or swallows the route, and never a host outside ``--worker-endpoint-allow``, even for a
record journaled before these checks (or under another allow-list): such a worker is not forwarded to.

Before: ``POST /workers`` with ``http://127.0.0.1:PORT/secret/internal#`` made the frontend POST every prompt of
the model to ``/secret/internal`` and relay the answer."""

from __future__ import annotations

from pathlib import Path

import attrs
import httpx
import trio

from kvrouter import IN_PROCESS_KV_EVENTS
from kvrouter.actors.core.catalog import WorkerRecord
from kvrouter.actors.core.events import WorkerUpserted
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.worker_endpoints import parse_allow_list
from kvrouter.actors.persistence.codec import encode_record
from kvrouter.api.frontend.service import run_frontend
from tests.support.frontends import frontend_options
from tests.support.journal_files import append_records


@attrs.define
class Recorder:
    """A worker that answers every request with a completion and remembers each request's target."""

    port: int = 0
    targets: list[str] = attrs.Factory(list)

    async def serve(self, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        async def answer(stream: trio.SocketStream) -> None:
            async with stream:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        return
                    data += chunk
                self.targets.append(data.split(b" ", 2)[1].decode())
                body = b'{"choices":[{"index":0,"text":"ok","finish_reason":"length"}]}'
                head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                await stream.send_all(head + b"content-length: %d\r\n\r\n" % len(body) + body)

        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(answer, listeners)


def worker(endpoint: str, worker_id: int = 1) -> dict[str, object]:
    return {
        "worker_id": worker_id,
        "model_name": "mock",
        "endpoint": endpoint,
        "block_size": 4,
        "kv_events_endpoint": IN_PROCESS_KV_EVENTS,
    }


async def test_the_route_is_joined_to_the_workers_base_path(nursery: trio.Nursery) -> None:
    recorder = Recorder()
    port = await nursery.start(recorder.serve)
    frontend = await nursery.start(run_frontend, frontend_options())
    async with httpx.AsyncClient(base_url=frontend.url, timeout=10) as http:
        registered = await http.post("/workers", json=worker(f"http://127.0.0.1:{port}/base/"))
        assert registered.status_code == 201, registered.text
        assert (await http.post("/v1/completions", json={"prompt": "hi"})).status_code == 200
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200
    assert recorder.targets == ["/base/v1/completions", "/base/v1/chat/completions"]


async def test_an_endpoint_that_would_drop_the_route_is_refused_and_nothing_reaches_it(nursery: trio.Nursery) -> None:
    recorder = Recorder()
    port = await nursery.start(recorder.serve)
    frontend = await nursery.start(run_frontend, frontend_options())
    async with httpx.AsyncClient(base_url=frontend.url, timeout=10) as http:
        for endpoint in (
            f"http://127.0.0.1:{port}/secret/internal#",
            f"http://127.0.0.1:{port}/secret/internal?x=",
            f"http://user:pw@127.0.0.1:{port}",
        ):
            refused = await http.post("/workers", json=worker(endpoint))
            assert refused.status_code == 400 and list(refused.json()) == ["error"], refused.text
        answer = await http.post("/v1/completions", json={"prompt": "hi"})
        assert answer.status_code == 503  # no worker serves the model
    assert recorder.targets == []


async def run_once(options: object, prompt: str = "hi") -> httpx.Response:
    """Start a frontend with ``options``, send one completion, stop it; its answer."""
    async with trio.open_nursery() as nursery:
        frontend = await nursery.start(run_frontend, options)
        async with httpx.AsyncClient(base_url=frontend.url, timeout=10) as http:
            answer = await http.post("/v1/completions", json={"prompt": prompt})
        frontend.stop()
    return answer


async def test_a_journaled_record_with_a_bad_endpoint_starts_the_frontend_and_is_not_forwarded_to(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    recorder = Recorder()
    port = await nursery.start(recorder.serve)
    data_dir = tmp_path / "frontend"
    legacy = WorkerRecord(
        1,
        "mock",
        endpoint=f"http://127.0.0.1:{port}/secret/internal#",
        block_size=16,
        kv_events_endpoint=IN_PROCESS_KV_EVENTS,
    )
    await append_records(data_dir, [encode_record(ScopeKey("mock", "default"), (WorkerUpserted(legacy, 16),))])
    answer = await run_once(frontend_options(data_dir=data_dir))
    assert answer.status_code == 503
    assert "is not forwarded to: endpoint:" in answer.json()["error"] and "fragment" in answer.json()["error"]
    assert recorder.targets == []


async def test_the_allow_list_is_checked_again_before_forwarding(nursery: trio.Nursery, tmp_path: Path) -> None:
    """A worker registered under no allow-list is recovered by a frontend started with one that excludes it: it
    stays in the catalog (the operator sees it and can remove it) and gets no prompt."""
    recorder = Recorder()
    port = await nursery.start(recorder.serve)
    data_dir = tmp_path / "frontend"
    async with trio.open_nursery() as first:
        frontend = await first.start(run_frontend, frontend_options(data_dir=data_dir))
        async with httpx.AsyncClient(base_url=frontend.url, timeout=10) as http:
            assert (await http.post("/workers", json=worker(f"http://127.0.0.1:{port}"))).status_code == 201
            assert (await http.post("/v1/completions", json={"prompt": "hi"})).status_code == 200
        frontend.stop()
    assert recorder.targets == ["/v1/completions"]
    fenced = RouterConfig(worker_endpoint_allow=parse_allow_list(["10.0.0.0/8"]))
    answer = await run_once(frontend_options(data_dir=data_dir, router=fenced))
    assert answer.status_code == 503
    assert "host `127.0.0.1` is not in the operator's allow-list" in answer.json()["error"]
    assert recorder.targets == ["/v1/completions"]
