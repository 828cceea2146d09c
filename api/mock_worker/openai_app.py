"""The mock worker's HTTP routes as a raw ASGI app: ``/v1/completions``, ``/v1/chat/completions`` (both
streaming with SSE or not), ``/v1/models``, ``/health`` and ``/stats``.

Its own small app rather than ``kvrouter.api.http.app.make_app``, which sends each response as one body: a
streamed completion goes out a chunk per token (``data: {...}\\n\\n``, then ``data: [DONE]\\n\\n``). Errors are
``{"error": "..."}`` with a 4xx, decided before the request reaches the engine.

Bounds: the body (``body_limit`` bytes, 413; it must arrive within ``body_timeout`` seconds, 408) and the
requests inside the engine (``max_requests``, running and waiting, served first come first served; overflow
policy *reject newest*: 503 with ``Retry-After: 1``). A client that disconnects has its request aborted
and its KV blocks released.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import attrs
import orjson
import trio

from kvrouter.api.http import JSON, Response, error_response, json_response
from kvrouter.api.mock_worker.engine_loop import EngineLoop, Generation
from kvrouter.api.mock_worker.kv_publisher import KvEventPublisher
from kvrouter.api.openai.body import Refusal, read_json_body
from kvrouter.api.openai.requests import GenerateRequest, RequestProblem, parse_request

log = logging.getLogger("kvrouter.mock_worker")

ASGIScope = dict[str, Any]
SSE = b"text/event-stream"
DONE = b"data: [DONE]\n\n"
BODY_TOO_LARGE = "the request body is larger than --max-body-bytes ({limit} bytes)"
DEFAULT_BODY_LIMIT = 8 * 1024 * 1024
DEFAULT_BODY_TIMEOUT = 30.0
DEFAULT_MAX_REQUESTS = 1024
_MAYBE_BODY_UNREAD = frozenset({404, 405, 408, 413, 415})


@attrs.frozen
class AppLimits:
    body_limit: int = DEFAULT_BODY_LIMIT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    max_requests: int = DEFAULT_MAX_REQUESTS


class MockWorkerApp:
    def __init__(
        self, loop: EngineLoop, publisher: KvEventPublisher, model: str, limits: AppLimits = AppLimits()
    ) -> None:
        self.loop = loop
        self.publisher = publisher
        self.model = model
        self.limits = limits
        self.created = int(time.time())
        self._ids = itertools.count()
        self.aborted = 0
        self.routes: dict[str, dict[str, Any]] = {
            "/health": {"GET": self._health},
            "/v1/models": {"GET": self._models},
            "/stats": {"GET": self._stats},
            "/v1/completions": {"POST": self._completions},
            "/v1/chat/completions": {"POST": self._chat},
        }

    # -- ASGI ---------------------------------------------------------------------------------------

    async def __call__(self, scope: ASGIScope, receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "websocket":
            await self._refuse_websocket(scope, send)
        elif kind == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    async def _http(self, scope: ASGIScope, receive: Any, send: Any) -> None:
        method = scope["method"]
        methods = self.routes.get(scope["path"])
        if methods is None:
            await _send(send, error_response(404, "route not found"), scope)
            return
        handler = methods.get(method) or (methods.get("GET") if method == "HEAD" else None)
        if handler is None:
            allow = ",".join([*methods, "HEAD"] if "GET" in methods else methods)
            await _send(send, error_response(405, "method not allowed", ((b"allow", allow.encode()),)), scope)
            return
        try:
            await handler(scope, receive, send)
        except Refusal as refusal:
            await _send(send, refusal.response, scope)

    async def _refuse_websocket(self, scope: ASGIScope, send: Any) -> None:
        if "websocket.http.response" not in scope.get("extensions", {}):
            await send({"type": "websocket.close"})
            return
        known = scope["path"] in self.routes
        response = error_response(400 if known else 404, "WebSocket is not served here; send plain HTTP requests")
        headers = [(b"content-length", str(len(response.body)).encode()), (b"content-type", JSON)]
        await send({"type": "websocket.http.response.start", "status": response.status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": response.body})

    # -- small routes -------------------------------------------------------------------------------

    async def _health(self, scope: ASGIScope, receive: Any, send: Any) -> None:
        await _send(send, json_response(200, {"status": "ok"}), scope)

    async def _models(self, scope: ASGIScope, receive: Any, send: Any) -> None:
        model = {"id": self.model, "object": "model", "created": self.created, "owned_by": "kvrouter-mock-worker"}
        await _send(send, json_response(200, {"object": "list", "data": [model]}), scope)

    async def _stats(self, scope: ASGIScope, receive: Any, send: Any) -> None:
        await _send(send, json_response(200, self.stats()), scope)

    def stats(self) -> dict[str, Any]:
        engine = self.loop.engine
        cache = engine.cache
        publisher = self.publisher
        return {
            "model": self.model,
            "block_size": self.loop.params.block_size,
            "total_kv_blocks": self.loop.params.num_blocks,
            "kv_blocks_used": cache.used,
            "kv_blocks_active": cache.active,
            "running": len(engine.running),
            "waiting": len(engine.waiting),
            "requests_finished": self.loop.finished,
            "requests_aborted": self.aborted,
            "preemptions": engine.preemptions,
            "kv_blocks_stored": cache.stored,
            "kv_blocks_evicted": cache.evicted,
            "kv_batches_published": publisher.next_seq,
            "kv_replay_buffer_batches": len(publisher.buffer),
        }

    # -- completions --------------------------------------------------------------------------------

    async def _completions(self, scope: ASGIScope, receive: Any, send: Any) -> None:
        await self._generate(scope, receive, send, chat=False)

    async def _chat(self, scope: ASGIScope, receive: Any, send: Any) -> None:
        await self._generate(scope, receive, send, chat=True)

    async def _generate(self, scope: ASGIScope, receive: Any, send: Any, *, chat: bool) -> None:
        body = await self._read_json(scope, receive)
        try:
            request = parse_request(body, chat=chat, model=self.model)
        except RequestProblem as problem:
            raise Refusal(error_response(problem.status, problem.message)) from None
        params = self.loop.params
        if not self.loop.engine.fits(len(request.prompt), request.max_tokens):
            needed = -(-(len(request.prompt) + request.max_tokens) // params.block_size)
            raise Refusal(
                error_response(
                    400,
                    f"prompt ({len(request.prompt)} tokens) + max_tokens ({request.max_tokens}) need {needed} KV "
                    f"blocks of {params.block_size} tokens; this worker has {params.num_blocks} (--blocks)",
                )
            )
        if self.loop.load >= self.limits.max_requests:
            raise Refusal(
                error_response(
                    503,
                    f"the worker is full: {self.limits.max_requests} requests are running or queued "
                    "(--max-requests); retry later",
                    ((b"retry-after", b"1"),),
                )
            )
        number = next(self._ids)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-mock-{number}"
        generation = self.loop.new_generation(request_id, request.prompt, request.max_tokens)
        self.loop.submit(generation)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._abort_on_disconnect, receive, generation)
                if request.stream:
                    await self._stream(send, request, generation)
                else:
                    await _wait_done(generation)
                    if not generation.aborted:
                        await _send(send, json_response(200, self._whole(request, generation)), scope)
                nursery.cancel_scope.cancel()
        finally:
            if not generation.done:  # cancelled (the server is stopping): free the engine
                self.loop.abort(generation)

    async def _abort_on_disconnect(self, receive: Any, generation: Generation) -> None:
        """The body has been read: the next message says the client went away (or the response ended).

        This task never cancels the response: hypercorn delivers ``http.disconnect`` from inside the final
        ``send`` too, and cancelling that send would stop hypercorn from closing the connection. Instead the
        request is aborted, which wakes the handler.
        """
        while (await receive())["type"] != "http.disconnect":
            pass
        if not generation.done:
            self.aborted += 1
            self.loop.abort(generation)
            log.debug("%s aborted: the client went away", generation.request_id)

    async def _read_json(self, scope: ASGIScope, receive: Any) -> Any:
        limit = self.limits.body_limit
        raw = await read_json_body(
            scope,
            receive,
            limit=limit,
            arrival_seconds=self.limits.body_timeout,
            too_large=BODY_TOO_LARGE.format(limit=limit),
        )
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise Refusal(error_response(400, f"the body is not valid JSON: {exc}")) from None

    # -- response bodies ----------------------------------------------------------------------------

    def _usage(self, request: GenerateRequest, generation: Generation) -> dict[str, Any]:
        prompt, completion = len(request.prompt), len(generation.output_tokens)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": generation.cached_tokens or 0},
        }

    def _whole(self, request: GenerateRequest, generation: Generation) -> dict[str, Any]:
        text = generation.text(0, len(generation.output_tokens))
        base = {"id": generation.request_id, "created": int(time.time()), "model": self.model}
        if request.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "length",
            }
            return {**base, "object": "chat.completion", "choices": [choice], "usage": self._usage(request, generation)}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        return {**base, "object": "text_completion", "choices": [choice], "usage": self._usage(request, generation)}

    async def _stream(self, send: Any, request: GenerateRequest, generation: Generation) -> None:
        headers = [
            (b"content-type", SSE),
            (b"cache-control", b"no-cache"),
            (b"x-request-id", generation.request_id.encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        created = int(time.time())
        kind = "chat.completion.chunk" if request.chat else "text_completion"
        base = {"id": generation.request_id, "object": kind, "created": created, "model": self.model}

        async def event(value: dict[str, Any]) -> None:
            await send(
                {"type": "http.response.body", "body": b"data: " + orjson.dumps(value) + b"\n\n", "more_body": True}
            )

        if request.chat:
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            await event({**base, "choices": [first]})
        sent = 0
        while True:
            # Re-read after every send: tokens (and the end) arrive while a chunk is being written.
            while sent < len(generation.output_tokens):
                last = generation.done and sent == len(generation.output_tokens) - 1
                text = generation.text(sent, sent + 1)
                reason = "length" if last else None
                if request.chat:
                    choice: dict[str, Any] = {
                        "index": 0,
                        "delta": {"content": text},
                        "logprobs": None,
                        "finish_reason": reason,
                    }
                else:
                    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
                await event({**base, "choices": [choice]})
                sent += 1
            if generation.done:
                break
            generation.changed = trio.Event()
            await generation.changed.wait()
        if generation.aborted:
            return  # nobody is reading
        if request.include_usage:
            await event({**base, "choices": [], "usage": self._usage(request, generation)})
        await send({"type": "http.response.body", "body": DONE, "more_body": False})


async def _wait_done(generation: Generation) -> None:
    while not generation.done:
        generation.changed = trio.Event()
        await generation.changed.wait()


async def _send(send: Any, response: Response, scope: ASGIScope) -> None:
    headers = [(b"content-length", str(len(response.body)).encode())]
    if response.status in _MAYBE_BODY_UNREAD:
        headers.append((b"connection", b"close"))  # a body the client may still be sending was not read
    if response.content_type is not None:
        headers.append((b"content-type", response.content_type))
    headers.extend(response.headers)
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else response.body})
