"""``kvrouter frontend`` end to end: real mock workers and the frontend on 127.0.0.1 (real hypercorn, real ZMQ KV
events), driven with httpx as a client would. The lifecycle is checked through ``GET /loads`` on the same port."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import trio

from kvrouter import IN_PROCESS_KV_EVENTS
from kvrouter.api.openai.tokenizer import render_chat, tokenize
from tests.support.frontends import loads, small_limits, start_frontend, start_workers, wait_idle
from tests.support.mock_workers import start_mock_worker
from tests.support.raw_http import connect, exchange, request_bytes

PROMPT = list(range(100, 117))  # 17 tokens: 4 full blocks of 4, and one more


def sse_events(body: str) -> list[Any]:
    events = []
    for block in body.split("\n\n"):
        if block.strip():
            data = block.removeprefix("data: ")
            events.append(data if data == "[DONE]" else orjson.loads(data))
    return events


async def wait_indexed(http: httpx.AsyncClient) -> None:
    """Until the KV events of a served prompt have reached the frontend's index."""
    with trio.fail_after(10):
        while not any(scope["events"] for scope in (await http.get("/dump")).json().values()):  # noqa: ASYNC110
            await trio.sleep(0.01)


async def test_a_completion_is_proxied_with_routing_headers_and_the_booking_freed(nursery: trio.Nursery) -> None:
    frontend = await start_frontend(nursery)
    workers = await start_workers(nursery, frontend, 2)
    async with httpx.AsyncClient(base_url=frontend.url, timeout=10) as http:
        answer = await http.post("/v1/completions", json={"model": "mock", "prompt": PROMPT, "max_tokens": 5})
        assert answer.status_code == 200, answer.text
        served_by = int(answer.headers["x-kvrouter-worker-id"])
        assert served_by in (1, 2)
        assert answer.headers["x-kvrouter-dp-rank"] == "0"
        assert answer.headers["x-kvrouter-overlap-blocks"] == "0"
        body = answer.json()
        assert body["usage"]["prompt_tokens"] == 17 and body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        # What the worker itself answers, word for word (the frontend relays the worker's bytes).
        direct = await http.post(
            workers[served_by - 1].url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5}
        )
        assert direct.json()["choices"] == body["choices"]
        assert workers[served_by - 1].app.loop.finished == 2
        assert all(row["active_requests"] == 0 for row in (await wait_idle(http)).values())
        models = (await http.get("/v1/models")).json()
        assert [model["id"] for model in models["data"]] == ["mock"]


async def test_a_stream_is_relayed_chunk_by_chunk_with_usage(nursery: trio.Nursery) -> None:
    frontend = await start_frontend(nursery)
    await start_workers(nursery, frontend, 2)
    request = {"prompt": PROMPT, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(base_url=frontend.url, timeout=10) as http:
        async with http.stream("POST", "/v1/completions", json=request) as response:
            assert response.status_code == 200
            assert response.headers["content-type"] == "text/event-stream"
            assert response.headers["x-kvrouter-worker-id"] in ("1", "2")
            text = (await response.aread()).decode()
        events = sse_events(text)
        assert events[-1] == "[DONE]"
        assert [len(event["choices"]) for event in events[:-1]] == [1, 1, 1, 1, 0]
        assert events[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        chat = {"messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 3, "stream": True}
        answer = await http.post("/v1/chat/completions", json=chat)
        assert answer.status_code == 200
        chunks = sse_events(answer.text)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert len(chunks) == 5 and chunks[-1] == "[DONE]"
        await wait_idle(http)


async def test_kv_mode_sends_a_repeated_prompt_back_to_the_worker_that_cached_it(nursery: trio.Nursery) -> None:
    frontend = await start_frontend(nursery, "kv")
    workers = await start_workers(nursery, frontend, 3)
    text = "You are a careful assistant. " * 4 + "Summarise the plot of Hamlet."
    async with httpx.AsyncClient(base_url=frontend.url, timeout=10) as http:
        first = await http.post("/v1/completions", json={"prompt": text, "max_tokens": 2})
        owner = first.headers["x-kvrouter-worker-id"]
        await wait_indexed(http)
        for _ in range(3):
            again = await http.post("/v1/completions", json={"prompt": text + " Briefly.", "max_tokens": 2})
            assert again.headers["x-kvrouter-worker-id"] == owner
            cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            overlap = int(again.headers["x-kvrouter-overlap-blocks"])
            assert overlap >= len(tokenize(text)) // 4  # the first prompt's blocks (later: also the previous turn's)
            # The worker found what the router predicted (a prompt of whole blocks recomputes its last one).
            assert (overlap - 1) * 4 <= cached <= overlap * 4 and cached > 0
        assert sum(worker.app.loop.finished for worker in workers) == 4
        await wait_idle(http)


async def test_round_robin_mode_spreads_the_same_prompt(nursery: trio.Nursery) -> None:
    frontend = await start_frontend(nursery, "round_robin")
    await start_workers(nursery, frontend, 3)
    async with httpx.AsyncClient(base_url=frontend.url, timeout=10) as http:
        served = []
        for _ in range(6):
            answer = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
            served.append(answer.headers["x-kvrouter-worker-id"])
        assert served == ["1", "2", "3", "1", "2", "3"]


async def test_prefill_completes_at_the_first_streamed_token(nursery: trio.Nursery) -> None:
    frontend = await start_frontend(nursery)
    # Slow enough that the stream is still open when the first token has arrived (a pass takes ~17 ms).
    await start_workers(nursery, frontend, 1, speedup=1.0)
    request = {"prompt": PROMPT, "max_tokens": 40, "stream": True}
    async with httpx.AsyncClient(base_url=frontend.url, timeout=10) as http:
        async with http.stream("POST", "/v1/completions", json=request) as response:
            lines = response.aiter_lines()
            async for line in lines:
                if line.startswith("data: "):
                    break
            # The relay marks prefill complete just after passing the chunk on: wait for it.
            with trio.fail_after(5):
                while (row := (await loads(http))[1])["potential_prefill_tokens"] != 0:  # noqa: ASYNC110
                    await trio.sleep(0.005)
            assert row["active_requests"] == 1 and row["potential_decode_blocks"] > 0
            async for _ in lines:
                pass
        assert (await wait_idle(http))[1]["potential_decode_blocks"] == 0


async def test_a_client_that_disconnects_mid_stream_frees_the_booking_and_aborts_the_worker(
    nursery: trio.Nursery,
) -> None:
    frontend = await start_frontend(nursery)
    (worker,) = await start_workers(nursery, frontend, 1, speedup=1.0)
    request = orjson.dumps({"prompt": PROMPT, "max_tokens": 200, "stream": True})
    async with httpx.AsyncClient(base_url=frontend.url, timeout=10) as http:
        stream = await connect(frontend.url)
        async with stream:
            headers = {"content-type": "application/json"}
            await stream.send_all(request_bytes("POST", "/v1/completions", request, headers))
            received = b""
            while b"data: " not in received:
                received += await stream.receive_some(65536)
            assert (await loads(http))[1]["active_requests"] == 1
        # The connection closed after the first of 200 tokens.
        await wait_idle(http)
        with trio.fail_after(5):
            while worker.app.aborted != 1:  # noqa: ASYNC110 - the worker's counter
                await trio.sleep(0.01)
        assert worker.app.loop.finished == 0
        stats = (await http.get("/frontend/stats")).json()
        assert stats["disconnects"] == 1 and stats["in_flight"] == 0


async def test_a_worker_error_is_passed_on_and_frees_the_booking(nursery: trio.Nursery) -> None:
    frontend = await start_frontend(nursery)
    await start_workers(nursery, frontend, 1)
    async with httpx.AsyncClient(base_url=frontend.url, timeout=10) as http:
        # 300 tokens do not fit the small worker's 64 blocks of 4: the worker refuses with 400.
        answer = await http.post("/v1/completions", json={"prompt": list(range(300)), "max_tokens": 1})
        assert answer.status_code == 400
        assert "KV blocks" in answer.json()["error"]
        assert answer.headers["x-kvrouter-worker-id"] == "1"
        await wait_idle(http)
        assert (await http.get("/frontend/stats")).json()["worker_errors"] == 1


async def broken_worker(task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """A worker that starts a stream, sends one token and drops the connection."""

    async def serve(stream: trio.SocketStream) -> None:
        async with stream:
            data = b""
            while b"\r\n\r\n" not in data:
                data += await stream.receive_some(65536)
            head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            event = b'data: {"choices":[{"index":0,"text":"half","finish_reason":null}]}\n\n'
            await stream.send_all(head + f"{len(event):x}\r\n".encode() + event + b"\r\n")

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(serve, listeners)


async def test_a_worker_failing_mid_stream_ends_the_stream_with_an_error_and_frees(nursery: trio.Nursery) -> None:
    frontend = await start_frontend(nursery)
    port = await nursery.start(broken_worker)
    async with httpx.AsyncClient(base_url=frontend.url, timeout=10) as http:
        worker = {"worker_id": 9, "model_name": "mock", "endpoint": f"http://127.0.0.1:{port}", "block_size": 4}
        worker["kv_events_endpoint"] = IN_PROCESS_KV_EVENTS
        assert (await http.post("/workers", json=worker)).status_code in (200, 201)
        answer = await http.post("/v1/completions", json={"prompt": PROMPT, "stream": True})
        assert answer.status_code == 200
        events = sse_events(answer.text)
        assert events[0]["choices"][0]["text"] == "half"
        assert "failed mid-answer" in events[-1]["error"]["message"] and events[-1]["error"]["code"] == 502
        await wait_idle(http)


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def test_a_refused_connection_is_retried_once_on_another_worker(nursery: trio.Nursery) -> None:
    frontend = await start_frontend(nursery, "round_robin")
    dead = {"worker_id": 1, "model_name": "mock", "endpoint": f"http://127.0.0.1:{closed_port()}", "block_size": 4}
    dead["kv_events_endpoint"] = IN_PROCESS_KV_EVENTS
    async with httpx.AsyncClient(base_url=frontend.url, timeout=10) as http:
        await http.post("/workers", json=dead)
        await start_mock_worker(nursery, register_url=frontend.url, worker_id=2)
        answer = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert answer.status_code == 200
        assert answer.headers["x-kvrouter-worker-id"] == "2"  # round robin chose 1 first
        assert (await http.get("/frontend/stats")).json()["retried"] == 1
        await wait_idle(http)
        await http.delete("/workers/2")
        alone = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert alone.status_code == 503
        assert "cannot be reached" in alone.json()["error"] and "no other worker" in alone.json()["error"]
        await wait_idle(http)


async def test_disaggregated_prefill_then_decode(nursery: trio.Nursery) -> None:
    frontend = await start_frontend(nursery)
    prefill = await start_mock_worker(nursery)
    decode = await start_mock_worker(nursery)
    async with httpx.AsyncClient(base_url=frontend.url, timeout=10) as http:
        for worker_id, worker, role in ((1, prefill, "prefill"), (2, decode, "decode")):
            body = {
                "worker_id": worker_id,
                "model_name": "mock",
                "endpoint": worker.url,
                "block_size": 4,
                "kv_events_endpoint": worker.kv_events_endpoint,
                "worker_role": role,
            }
            assert (await http.post("/workers", json=body)).status_code in (200, 201)
        chat = {"messages": [{"role": "user", "content": "Tell me a story " * 3}], "max_tokens": 6}
        answer = await http.post("/v1/chat/completions", json=chat)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-kvrouter-prefill-worker-id"] == "1"
        assert answer.headers["x-kvrouter-worker-id"] == "2"
        assert answer.headers["x-kvrouter-prefill-cached-tokens"] == "0"
        assert answer.json()["usage"]["completion_tokens"] == 6
        # The prefill worker produced one token; the decode worker the whole answer.
        assert prefill.app.loop.finished == 1 and decode.app.loop.finished == 1
        assert prefill.loop.engine.cache.stored >= len(tokenize(render_chat([("user", "Tell me a story " * 3)]))) // 4
        await wait_idle(http)
        # A prefill worker that cannot be reached: decode alone, said in a header.
        await http.patch("/workers/1", json={"endpoint": f"http://127.0.0.1:{closed_port()}"})
        fallback = await http.post("/v1/chat/completions", json=chat)
        assert fallback.status_code == 200
        assert fallback.headers["x-kvrouter-prefill-fallback"] == "1"
        assert decode.app.loop.finished == 2
        await wait_idle(http)


async def test_bad_requests_are_refused_before_anything_is_booked(nursery: trio.Nursery) -> None:
    frontend = await start_frontend(nursery)
    async with httpx.AsyncClient(base_url=frontend.url, timeout=10) as http:
        none = await http.post("/v1/completions", json={"prompt": "hi"})
        assert none.status_code == 503 and "no worker is registered" in none.json()["error"]
        (worker,) = await start_workers(nursery, frontend, 1)
        cases: list[tuple[bytes, dict[str, str], int, str]] = [
            (b"{bad", {"content-type": "application/json"}, 400, "not valid JSON"),
            (b"[1]", {"content-type": "application/json"}, 400, "JSON object"),
            (b'{"prompt": "hi"}', {"content-type": "text/plain"}, 415, "Content-Type"),
            (b'{"prompt": "hi", "model": "gpt"}', {"content-type": "application/json"}, 404, "not found"),
            (b'{"prompt": "hi", "model": 3}', {"content-type": "application/json"}, 400, "model must be a string"),
            (b'{"prompt": "hi", "max_tokens": 0}', {"content-type": "application/json"}, 400, "max_tokens"),
            (b'{"max_tokens": 1}', {"content-type": "application/json"}, 400, "prompt is required"),
            (b'{"prompt": [1, -2]}', {"content-type": "application/json"}, 400, "token ids"),
        ]
        for content, headers, status, words in cases:
            answer = await http.post("/v1/completions", content=content, headers=headers)
            assert answer.status_code == status, (content, answer.text)
            assert words in answer.json()["error"], answer.text
        huge = await exchange(
            frontend.url,
            request_bytes(
                "POST", "/v1/completions", headers={"content-type": "application/json", "content-length": "9999999"}
            ),
        )
        assert huge.status == 413 and "larger than" in orjson.loads(huge.body)["error"]
        wrong_method = await http.get("/v1/completions")
        assert wrong_method.status_code == 405
        assert (await loads(http))[1]["active_requests"] == 0
        assert worker.app.loop.finished == 0
        stats = (await http.get("/frontend/stats")).json()
        assert stats["refused"] == 10 and stats["in_flight"] == 0


async def flaky_worker(task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """A worker whose first connection is closed once a request has arrived on it (a keep-alive connection its
    idle timeout closed as the request was sent); later connections get a whole answer."""
    connections = 0

    async def serve(stream: trio.SocketStream) -> None:
        nonlocal connections
        connections += 1
        async with stream:
            data = b""
            while b"\r\n\r\n" not in data:
                data += await stream.receive_some(65536)
            if connections == 1:
                return
            body = b'{"choices":[{"index":0,"text":"fine","finish_reason":"length"}],"usage":{"prompt_tokens":17}}'
            head = f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
            await stream.send_all(head.encode() + body)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(serve, listeners)


async def test_a_connection_dropped_before_any_answer_is_sent_again(nursery: trio.Nursery) -> None:
    """Before: the dropped connection answered the client 502 (seen in the demo: a pooled connection that the
    worker's idle timeout had closed)."""
    frontend = await start_frontend(nursery)
    port = await nursery.start(flaky_worker)
    async with httpx.AsyncClient(base_url=frontend.url, timeout=10) as http:
        worker = {"worker_id": 3, "model_name": "mock", "endpoint": f"http://127.0.0.1:{port}", "block_size": 4}
        worker["kv_events_endpoint"] = IN_PROCESS_KV_EVENTS
        assert (await http.post("/workers", json=worker)).status_code in (200, 201)
        answer = await http.post("/v1/completions", json={"prompt": PROMPT})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == "fine"
        assert (await http.get("/frontend/stats")).json()["retried"] == 0  # the same worker, on a new connection
        await wait_idle(http)


async def gzip_worker(task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """A worker that answers every completion gzip-compressed, whatever the request asked for."""
    import gzip

    async def serve(stream: trio.SocketStream) -> None:
        async with stream:
            data = b""
            while b"\r\n\r\n" not in data:
                data += await stream.receive_some(65536)
            body = gzip.compress(b'{"choices":[{"index":0,"text":"packed","finish_reason":"length"}]}')
            head = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n"
            await stream.send_all(f"{head}content-length: {len(body)}\r\n\r\n".encode() + body)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(serve, listeners)


async def test_a_gzip_answer_is_relayed_decoded_to_a_client_that_did_not_ask_for_it(nursery: trio.Nursery) -> None:
    """Before: the compressed bytes went on labelled plain JSON."""
    frontend = await start_frontend(nursery)
    port = await nursery.start(gzip_worker)
    async with httpx.AsyncClient(base_url=frontend.url, timeout=10) as http:
        worker = {"worker_id": 4, "model_name": "mock", "endpoint": f"http://127.0.0.1:{port}", "block_size": 4}
        worker["kv_events_endpoint"] = IN_PROCESS_KV_EVENTS
        assert (await http.post("/workers", json=worker)).status_code in (200, 201)
        request = {"json": {"prompt": "hi"}, "headers": {"accept-encoding": "identity"}}
        async with http.stream("POST", "/v1/completions", **request) as answer:  # type: ignore[arg-type]
            raw = b"".join([chunk async for chunk in answer.aiter_raw()])
        assert answer.status_code == 200 and "content-encoding" not in answer.headers
        assert answer.headers["content-type"] == "application/json"
        assert orjson.loads(raw)["choices"][0]["text"] == "packed"
        await wait_idle(http)


async def test_a_prompt_over_the_character_bound_is_refused_before_tokenizing(nursery: trio.Nursery) -> None:
    frontend = await start_frontend(nursery, limits=small_limits(max_prompt_tokens=100))
    (worker,) = await start_workers(nursery, frontend, 1)
    async with httpx.AsyncClient(base_url=frontend.url, timeout=10) as http:
        answer = await http.post("/v1/completions", json={"prompt": "x" * 1601})
        assert answer.status_code == 400
        assert "1601 characters" in answer.json()["error"] and "--max-prompt-tokens 100" in answer.json()["error"]
        chat = {"messages": [{"role": "user", "content": "y" * 1600}]}
        assert (await http.post("/v1/chat/completions", json=chat)).status_code == 400
        many = await http.post("/v1/completions", json={"prompt": "a " * 700})  # 1400 characters, 700 tokens
        assert many.status_code == 400 and "more than 100 tokens" in many.json()["error"]
        assert (await loads(http))[1]["active_requests"] == 0 and worker.app.loop.finished == 0
