"""The mock worker's OpenAI routes against real hypercorn on 127.0.0.1: completions streamed and not,
cached_tokens, chat, refusals, the request bound and aborts on disconnect."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import trio

from kvrouter.api.openai.tokenizer import render_chat, tokenize
from tests.support.mock_workers import BLOCK, limits, start_mock_worker
from tests.support.raw_http import ResponseReader, connect, request_bytes

PROMPT = list(range(100, 117))  # 17 tokens: 4 full blocks of 4, and one more token


def sse_events(body: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, in order (``[DONE]`` as the string)."""
    events = []
    for block in body.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            data = block.removeprefix("data: ")
            events.append(data if data == "[DONE]" else orjson.loads(data))
    return events


async def test_a_token_prompt_completes_with_usage(nursery: trio.Nursery) -> None:
    worker = await start_mock_worker(nursery)
    async with httpx.AsyncClient(base_url=worker.url, timeout=10) as http:
        answer = await http.post("/v1/completions", json={"model": "mock", "prompt": PROMPT, "max_tokens": 5})
        assert answer.status_code == 200
        body = answer.json()
        assert body["object"] == "text_completion" and body["model"] == "mock"
        (choice,) = body["choices"]
        assert choice["finish_reason"] == "length" and len(choice["text"].split()) == 5
        assert body["usage"] == {
            "prompt_tokens": 17,
            "completion_tokens": 5,
            "total_tokens": 22,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        # Deterministic: the same prompt gets the same text.
        again = (await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5})).json()
        assert again["choices"][0]["text"] == choice["text"]
        models = (await http.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["mock"]
        assert (await http.get("/health")).json() == {"status": "ok"}


async def test_streaming_sends_one_chunk_per_token_then_usage_and_done(nursery: trio.Nursery) -> None:
    worker = await start_mock_worker(nursery)
    async with httpx.AsyncClient(base_url=worker.url, timeout=10) as http:
        whole = (await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})).json()
        request = {"prompt": PROMPT, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
        async with http.stream("POST", "/v1/completions", json=request) as response:
            assert response.status_code == 200
            assert response.headers["content-type"] == "text/event-stream"
            events = sse_events((await response.aread()).decode())
        *chunks, usage, done = events
        assert done == "[DONE]"
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
        assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}  # the first request's blocks
        # Without include_usage there is no usage chunk.
        plain = await http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2, "stream": True})
        assert [e if e == "[DONE]" else "usage" in e for e in sse_events(plain.text)] == [False, False, "[DONE]"]


async def test_cached_tokens_grow_with_a_repeated_prefix(nursery: trio.Nursery) -> None:
    worker = await start_mock_worker(nursery)

    async def cached(prompt: list[int]) -> int:
        body = (await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})).json()
        return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])

    async with httpx.AsyncClient(base_url=worker.url, timeout=10) as http:
        assert await cached(PROMPT[:9]) == 0  # 2 full blocks computed and cached
        assert await cached(PROMPT[:9]) == 8  # both found (the last token is always computed)
        assert await cached(PROMPT) == 8  # the same 2, then 2 more computed
        assert await cached([*PROMPT, 7, 7, 7, 7]) == 16
        assert await cached([5, *PROMPT]) == 0  # another first token: another prefix
    assert worker.app.stats()["kv_blocks_active"] == 0  # everything finished and released


async def test_chat_uses_the_built_in_template_and_tokenizer(nursery: trio.Nursery) -> None:
    worker = await start_mock_worker(nursery)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]
    expected_prompt = tokenize(render_chat([(m["role"], m["content"]) for m in messages]))
    async with httpx.AsyncClient(base_url=worker.url, timeout=10) as http:
        first = (await http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3})).json()
        assert first["object"] == "chat.completion"
        assert first["choices"][0]["message"]["role"] == "assistant"
        assert len(first["choices"][0]["message"]["content"].split()) == 3
        assert first["usage"]["prompt_tokens"] == len(expected_prompt)
        second = (
            await http.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 2})
        ).json()
        full_blocks = (len(expected_prompt) - 1) // BLOCK
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == full_blocks * BLOCK > 0
        streamed = await http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3, "stream": True})
        events = sse_events(streamed.text)
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(e["choices"][0]["delta"]["content"] for e in events[1:-1])
        assert text == first["choices"][0]["message"]["content"] and events[-1] == "[DONE]"
        # Text prompts on /v1/completions go through the same tokenizer.
        by_text = (await http.post("/v1/completions", json={"prompt": "a b, c", "max_tokens": 1})).json()
        assert by_text["usage"]["prompt_tokens"] == len(tokenize("a b, c")) == 4


BAD = [
    ({"prompt": [1, 2, -1]}, 400, "token ids must be integers"),
    ({"prompt": [1, 2, 2**32]}, 400, "token ids must be integers"),
    ({"prompt": [1, True]}, 400, "token ids must be integers"),
    ({"prompt": []}, 400, "the prompt is empty"),
    ({"prompt": ""}, 400, "the prompt is empty"),
    ({"prompt": ["a", "b"]}, 400, "one prompt per request"),
    ({}, 400, "prompt is required"),
    ({"prompt": 7}, 400, "prompt must be a text or a list of token ids"),
    ({"prompt": [1], "max_tokens": 0}, 400, "max_tokens must be an integer from 1"),
    ({"prompt": [1], "max_tokens": 1.5}, 400, "max_tokens must be an integer from 1"),
    ({"prompt": [1], "n": 2}, 400, "n must be 1"),
    ({"prompt": [1], "stream": "yes"}, 400, "stream must be true or false"),
    ({"prompt": [1], "stream_options": {"include_usage": 1}}, 400, "include_usage must be true or false"),
    ({"prompt": [1], "model": "other"}, 404, "model 'other' not found; this worker serves 'mock'"),
    ({"prompt": list(range(300))}, 400, "need 79 KV blocks of 4 tokens; this worker has 64 (--blocks)"),
    ([1, 2], 400, "the body must be a JSON object"),
]
BAD_CHAT = [
    ({"messages": []}, 400, "messages must be a non-empty list"),
    ({"messages": [{"content": "x"}]}, 400, "messages[0].role must be a non-empty string"),
    ({"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "only text parts"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}, 400, "max_completion_tokens"),
]


async def test_bad_requests_are_4xx_errors_and_change_nothing(nursery: trio.Nursery) -> None:
    worker = await start_mock_worker(nursery, limits=limits(body_limit=4096))
    async with httpx.AsyncClient(base_url=worker.url, timeout=10) as http:
        await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        before = (await http.get("/stats")).json()
        for path, table in (("/v1/completions", BAD), ("/v1/chat/completions", BAD_CHAT)):
            for body, status, text in table:
                answer = await http.post(path, json=body)
                assert (answer.status_code, text in answer.json()["error"]) == (status, True), (body, answer.text)
        raw = [
            (await http.post("/v1/completions", content=b"{nope", headers={"content-type": "application/json"}), 400),
            (await http.post("/v1/completions", content=b"{}", headers={"content-type": "text/plain"}), 415),
            (await http.post("/v1/completions", json={"prompt": "x" * 5000}), 413),
            (await http.get("/v1/completions"), 405),
            (await http.post("/v1/models", json={}), 405),
            (await http.get("/v2/nothing"), 404),
        ]
        for answer, status in raw:
            assert answer.status_code == status and isinstance(answer.json()["error"], str), answer.text
        assert raw[3][0].headers["allow"] == "POST"
        assert (await http.get("/stats")).json() == before


async def test_a_full_worker_answers_503_and_a_disconnect_aborts_the_request(nursery: trio.Nursery) -> None:
    # A pass of the dynamo-mocker model takes >= 17 ms; at speedup 0.001 the first request stays in flight.
    worker = await start_mock_worker(nursery, speedup=0.001, limits=limits(max_requests=1))
    async with httpx.AsyncClient(base_url=worker.url, timeout=10) as http:
        async with trio.open_nursery() as streams:
            started = trio.Event()

            async def slow() -> None:
                request = {"prompt": PROMPT, "max_tokens": 50, "stream": True}
                async with http.stream("POST", "/v1/completions", json=request) as response:
                    assert response.status_code == 200
                    started.set()
                    await trio.sleep_forever()  # the client goes away when cancelled

            streams.start_soon(slow)
            await started.wait()
            stats = (await http.get("/stats")).json()
            assert stats["running"] + stats["waiting"] == 1
            full = await http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
            assert full.status_code == 503 and full.headers["retry-after"] == "1"
            assert "--max-requests" in full.json()["error"]
            streams.cancel_scope.cancel()
        with trio.fail_after(10):
            while worker.app.stats()["requests_aborted"] != 1:  # noqa: ASYNC110 - the server sees the close later
                await trio.sleep(0.01)
        stats = worker.app.stats()
        assert stats["running"] == stats["waiting"] == stats["kv_blocks_active"] == 0


async def test_a_completion_asked_with_connection_close_is_answered_and_the_connection_closed(
    nursery: trio.Nursery,
) -> None:
    """Before: the response went out but the connection stayed open (the end of the response reached the
    handler as a disconnect, which cancelled hypercorn's own close), so a client reading to EOF hung."""
    worker = await start_mock_worker(nursery)
    for stream in (False, True):
        body = orjson.dumps({"prompt": [1, 2, 3], "max_tokens": 2, "stream": stream})
        headers = {"content-type": "application/json", "connection": "close"}
        connection = await connect(worker.url)
        async with connection:
            await connection.send_all(request_bytes("POST", "/v1/completions", body, headers))
            received = b""
            with trio.fail_after(10):
                while chunk := await connection.receive_some(65536):
                    received += chunk
        assert received.startswith(b"HTTP/1.1 200") and (b"[DONE]" in received) == stream
    assert worker.app.stats()["requests_aborted"] == 0


async def test_a_prompt_that_quotes_an_answer_finds_the_answers_blocks_cached(nursery: trio.Nursery) -> None:
    """Generated tokens are the tokenizer's ids of the generated words (not engine-internal ids), so a
    follow-up turn that sends the answer back as text reuses the blocks the answer filled."""
    worker = await start_mock_worker(nursery)
    async with httpx.AsyncClient(base_url=worker.url, timeout=10) as http:
        first = (await http.post("/v1/completions", json={"prompt": [1, 2, 3, 4], "max_tokens": 6})).json()
        answer = first["choices"][0]["text"]
        assert len(tokenize(answer)) == 6
        follow_up = [1, 2, 3, 4, *tokenize(answer)]  # 10 tokens: the prompt's block, then the answer's
        again = (await http.post("/v1/completions", json={"prompt": follow_up, "max_tokens": 1})).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 8


async def test_a_body_that_stalls_gets_408_naming_the_body_timeout(nursery: trio.Nursery) -> None:
    worker = await start_mock_worker(nursery, limits=limits(body_timeout=0.5))
    body = b'{"prompt": [1, 2, 3], "max_tokens": 1}'
    head = request_bytes("POST", "/v1/completions", headers={"content-type": "application/json",
                                                               "content-length": str(len(body))})  # fmt: skip
    stream = await connect(worker.url)
    async with stream:
        await stream.send_all(head + body[:10])  # then nothing more: the client stalls, still connected
        with trio.fail_after(20):
            reader = ResponseReader(stream)
            response = await reader.response()
    assert response.status == 408, response
    assert response.json() == {"error": "the request body did not arrive within 0.5 s"}
