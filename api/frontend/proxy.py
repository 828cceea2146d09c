"""One proxied completion, from the client's body to the end of the worker's answer, and its booking's lifecycle.

1. Refuse early (in-flight bound, content type, body size and deadline, JSON, the OpenAI fields the workers
   accept, the model, the prompt's size): a 4xx ``{"error"}`` and nothing is booked.
2. Book a rank through the selection service's core (``Routing``); with prefill workers registered, a prefill
   rank first: the request goes there with ``max_tokens`` 1 (its KV cache is what a transfer would carry),
   and a prefill that fails falls back to the decode worker alone, as the seed's prefill router does.
3. Forward the client's body as it came to the chosen worker and relay its answer byte for byte (SSE chunks
   as they arrive), with ``x-kvrouter-*`` headers naming the worker, rank and predicted overlap. The first
   streamed token marks the booking's prefill complete.
4. Free the booking when the answer ends, the client disconnects, the worker fails or time runs out (the
   free is shielded from cancellation). A worker that refuses the connection is freed and the request booked
   once more on another worker.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, cast

import attrs
import httpx
import orjson
import trio

from kvrouter.actors.core.breakers import BreakerPolicy, Cause
from kvrouter.actors.core.endpoints import InvalidEndpoint
from kvrouter.actors.core.worker_endpoints import allow_list_problem
from kvrouter.api.embedded import RouterError
from kvrouter.api.frontend.liveness import Liveness, worker_route_url
from kvrouter.api.frontend.options import FrontendLimits
from kvrouter.api.frontend.routing import BOOKING_PREFIX, Plan, Target
from kvrouter.api.frontend.selection_calls import SelectionCalls
from kvrouter.api.frontend.tokenizers import Tokenize
from kvrouter.api.frontend.tokenizing import Tokenizing
from kvrouter.api.http import Response, error_response
from kvrouter.api.openai.body import Refusal, read_json_body

log = logging.getLogger("kvrouter.frontend")

ASGIScope = dict[str, Any]
SSE_DATA = b"data: "
DONE = b"[DONE]"
_BODY_UNREAD = frozenset({408, 413, 415, 503})
# Connected, and the connection closed before any answer.
DROPPED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
# Response headers of the worker worth passing on (hop-by-hop and length headers are the server's business).
PASSED_HEADERS = frozenset({b"content-type", b"cache-control", b"retry-after"})


class WorkerUnreachable(Exception):
    """A worker could not be used: it refused the connection, could not be reached within the connect timeout,
    dropped the connection before any answer or answered a 5xx other than 503 (``cause`` says which; None: the
    catalog's endpoint may not be used, which says nothing of the worker's health)."""

    def __init__(self, target: Target, reason: str, cause: Cause | None = None, status: int = 503) -> None:
        super().__init__(reason)
        self.target = target
        self.reason = reason
        self.cause = cause
        self.status = status  # what the client gets when no other worker takes the request


@attrs.define
class Counters:
    """What the proxy has done since it started (``GET /frontend/stats``)."""

    in_flight: int = 0
    requests: int = 0
    refused: int = 0  # 4xx/5xx decided before a worker was called
    retried: int = 0  # a worker failed (refused, unreachable, dropped, 5xx): booked again elsewhere
    worker_errors: int = 0  # a worker answered an error, failed mid-answer or timed out
    disconnects: int = 0  # the client left before the answer ended
    prefill_fallbacks: int = 0  # a disaggregated prefill failed: decode alone


class Proxy:
    def __init__(
        self, routing: SelectionCalls, client: httpx.AsyncClient, tokenize: Tokenize, limits: FrontendLimits
    ) -> None:
        self.routing = routing
        self.client = client
        self.tokenizing = Tokenizing(tokenize, limits)
        self.limits = limits
        self.counters = Counters()
        policy = BreakerPolicy(limits.breaker_cool_down, limits.breaker_max_cool_down)
        self.liveness = Liveness(routing, client, policy, probe_timeout=limits.connect_timeout)
        self._prefix = f"{BOOKING_PREFIX}{secrets.token_hex(4)}"
        self._ids = itertools.count()

    def worker_url(self, target: Target, route: str) -> httpx.URL:
        """Where ``route`` of ``target``'s worker is: its endpoint's base path joined with the route, checked again
        (a record journaled before endpoints were checked, or under another allow-list, is recovered as it was,
        and not forwarded to). ``WorkerUnreachable`` if it may not be used (the caller logs it and tries another)."""
        if not target.endpoint:
            raise WorkerUnreachable(target, "has no endpoint in the catalog (register it with one)")
        allow = self.routing.worker_endpoint_allow
        problem: str | None
        try:
            url = worker_route_url(target.endpoint, route)
        except InvalidEndpoint as exc:
            problem = f"endpoint: {exc}"
        else:
            problem = allow_list_problem("endpoint", target.endpoint, allow)
            if problem is None:
                return url
        raise WorkerUnreachable(target, f"is not forwarded to: {problem}")

    def stats(self) -> dict[str, Any]:
        """``GET /frontend/stats``: the counters, and each worker's circuit breaker (why it is out, if it is)."""
        return {**attrs.asdict(self.counters), "workers": self.liveness.workers()}

    # -- the request ---------------------------------------------------------------------------------

    async def handle(self, scope: ASGIScope, receive: Any, send: Any, *, chat: bool) -> None:
        counters = self.counters
        counters.requests += 1
        if counters.in_flight >= self.limits.max_in_flight:
            counters.refused += 1
            message = f"the frontend is full: {self.limits.max_in_flight} requests in flight (--max-in-flight); retry"
            await send_response(send, error_response(503, message, ((b"retry-after", b"1"),)), body_unread=True)
            return
        counters.in_flight += 1
        try:
            try:
                raw = await self._read_body(scope, receive)
                body, model, tokens = await self._parse(raw, chat)
            except Refusal as refusal:
                counters.refused += 1
                await send_response(send, refusal.response, body_unread=refusal.response.status in _BODY_UNREAD)
                return
            exchange = Exchange(self, send, raw, body, model, tokens, chat, f"{self._prefix}-{next(self._ids)}")
            await exchange.run(receive)
        finally:
            counters.in_flight -= 1

    async def _read_body(self, scope: ASGIScope, receive: Any) -> bytes:
        limit = self.limits.body_limit
        too_large = f"the request body is larger than {limit} bytes (--max-body-bytes)"
        return await read_json_body(
            scope, receive, limit=limit, arrival_seconds=self.limits.body_timeout, too_large=too_large
        )

    async def _parse(self, raw: bytes, chat: bool) -> tuple[dict[str, Any], str, list[int]]:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise Refusal(error_response(400, f"the body is not valid JSON: {exc}")) from None
        if not isinstance(body, dict):
            raise Refusal(error_response(400, "the body must be a JSON object"))
        model = self._model(body.get("model"))
        request = await self.tokenizing.request(body, chat=chat, model=model)
        return body, model, request.prompt

    def _model(self, named: Any) -> str:
        served = self.routing.models()
        if not served:
            raise Refusal(
                error_response(
                    503,
                    f"no worker is registered: add one with {self.routing.registration_hint}",
                    ((b"retry-after", b"1"),),
                )
            )
        if named is None:
            if len(served) == 1:
                return served[0]
            raise Refusal(error_response(400, f"model is required: this frontend serves {', '.join(served)}"))
        if not isinstance(named, str):
            raise Refusal(error_response(400, "model must be a string"))
        if named not in served:
            raise Refusal(error_response(404, f"model {named!r} not found; this frontend serves {', '.join(served)}"))
        return named


class Exchange:
    """One request's trip through the workers (its own object: the state of one booking lifecycle)."""

    def __init__(
        self,
        proxy: Proxy,
        send: Any,
        raw: bytes,
        body: dict[str, Any],
        model: str,
        tokens: list[int],
        chat: bool,
        request_id: str,
    ) -> None:
        self.proxy = proxy
        self.routing = proxy.routing
        self.limits = proxy.limits
        self.send = send
        self.raw = raw
        self.body = body
        self.model = model
        self.tokens = tokens
        self.path = "/v1/chat/completions" if chat else "/v1/completions"
        self.streaming = body.get("stream") is True
        self.request_id = request_id
        self.started = False  # a response start went to the client
        self.ending = False  # the response's last message is being sent: a disconnect now cancels nothing
        self.disconnected = False
        self.extra_headers: list[tuple[bytes, bytes]] = [(b"x-kvrouter-request-id", request_id.encode())]

    async def run(self, receive: Any) -> None:
        """Route, forward and relay, with the client's disconnect cancelling the work (never the final send)."""
        finished = False
        async with trio.open_nursery() as nursery:
            with trio.CancelScope() as work:
                nursery.start_soon(self._watch_disconnect, receive, work)
                with trio.move_on_after(self.limits.request_timeout) as deadline:
                    finished = await self._route_and_relay()
                if deadline.cancelled_caught:
                    self.proxy.counters.worker_errors += 1
                    finished = await self._fail(
                        504, f"the request did not finish within {self.limits.request_timeout:g} s"
                    )
            if work.cancelled_caught:
                self.proxy.counters.disconnects += 1
                log.debug("%s: the client disconnected", self.request_id)
            elif finished:
                self.ending = True
                await self.send({"type": "http.response.body", "body": b"", "more_body": False})
            nursery.cancel_scope.cancel()

    async def _watch_disconnect(self, receive: Any, work: trio.CancelScope) -> None:
        # The body has been read: the next message is the client going away (hypercorn also sends one after
        # the response ended, by which time ``work`` has finished and cancelling it does nothing).
        while (await receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True
        if not self.ending:
            # Never cancel the last send: hypercorn reports the disconnect from inside it once the response
            # is complete, and a cancelled last send leaves the connection open.
            work.cancel()

    async def _route_and_relay(self) -> bool:
        """True when a response is open and waits for its final (empty) body message."""
        liveness = self.proxy.liveness
        allowed = liveness.allowed(self.model)  # None: no worker is out (the common case)
        if allowed == []:
            self.proxy.counters.refused += 1
            retry_after = str(liveness.retry_after()).encode()
            await self._answer(error_response(503, liveness.out_text(self.model), ((b"retry-after", retry_after),)))
            return False
        try:
            with trio.CancelScope(shield=True):  # a booking made must be known, to be freed
                plan = await self.routing.plan(self.model, self.tokens, self.request_id, allowed)
        except RouterError as exc:
            self.proxy.counters.refused += 1
            headers = ((b"retry-after", b"1"),) if exc.retry_after is not None else ()
            await self._answer(error_response(exc.status, exc.message, headers))
            return False
        if plan.prefill is not None:
            await self._prefill(plan)
        return await self._decode(plan.decode)

    # -- disaggregated prefill ------------------------------------------------------------------------

    async def _prefill(self, plan: Plan) -> None:
        """Run the prompt on the prefill worker (one token), then hand over to the decode worker."""
        target = plan.prefill
        assert target is not None
        self.extra_headers += [
            (b"x-kvrouter-prefill-worker-id", str(target.worker_id).encode()),
            (b"x-kvrouter-prefill-dp-rank", str(target.dp_rank).encode()),
        ]
        body = {key: value for key, value in self.body.items() if key not in ("stream_options",)}
        body.update(max_tokens=1, stream=False)
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        problem = None
        try:
            response = await self._post(target, orjson.dumps(body))
            try:
                answer = await _read_limited(response, self.limits.error_body_limit, self.limits.read_timeout)
            finally:
                await response.aclose()
            if response.status_code != 200:
                problem = f"answered {response.status_code}: {_error_text(answer)}"
                if _breaks(response.status_code):
                    self._worker_failed(WorkerUnreachable(target, problem, Cause.SERVER_ERROR, 502))
            else:
                cached = _cached_tokens(answer)
                if cached is not None:
                    self.extra_headers.append((b"x-kvrouter-prefill-cached-tokens", str(cached).encode()))
                await self.routing.prefill_complete(target, cached)
        except WorkerUnreachable as exc:
            problem = exc.reason
            self._worker_failed(exc)
        except httpx.HTTPError as exc:
            problem = f"failed: {_describe(exc)}"
        finally:
            with trio.CancelScope(shield=True):
                await self._free(target)
        if problem is not None:
            self.proxy.counters.prefill_fallbacks += 1
            log.warning(
                "%s: prefill worker %d %s; decoding on worker %d alone",
                self.request_id,
                target.worker_id,
                problem,
                plan.decode.worker_id,
            )
            self.extra_headers.append((b"x-kvrouter-prefill-fallback", b"1"))

    # -- the worker that answers ----------------------------------------------------------------------

    async def _decode(self, target: Target) -> bool:
        tried: list[Target] = []
        try:
            while True:
                try:
                    response = await self._post(target, self.raw)
                    if _breaks(response.status_code):
                        await self._server_error(target, response)
                    break
                except WorkerUnreachable as exc:
                    tried.append(target)
                    with trio.CancelScope(shield=True):
                        await self._free(target)
                    self._worker_failed(exc)
                    log.warning("%s: worker %d %s", self.request_id, target.worker_id, exc.reason)
                    retarget = await self._retarget(tried, exc)
                    if isinstance(retarget, bool):
                        return retarget
                    target = retarget
                except httpx.HTTPError as exc:  # connected, then no answer within the read timeout
                    self.proxy.counters.worker_errors += 1
                    status = 504 if isinstance(exc, httpx.TimeoutException) else 502
                    worker = f"worker {target.worker_id} ({target.endpoint})"
                    return await self._fail(status, f"{worker} did not answer: {_describe(exc)}")
            try:
                return await self._relay(target, response)
            finally:
                await response.aclose()
        finally:
            with trio.CancelScope(shield=True):
                await self._free(target)

    def _worker_failed(self, exc: WorkerUnreachable) -> None:
        """A failure that says the worker is unwell opens its breaker: the next requests do not choose it."""
        if exc.cause is not None and exc.target.endpoint is not None:
            self.proxy.liveness.failed(exc.target.endpoint, exc.cause, exc.reason)

    async def _retarget(self, tried: list[Target], exc: WorkerUnreachable) -> Target | bool:
        """Another worker's booking for the request (once), or the client's answer sent (what ``_decode``
        returns) when there is none."""
        if len(tried) > 1:
            return await self._fail(exc.status, _unreachable(tried, exc, alternative=True))
        tried_ids = {t.worker_id for t in tried}
        allowed = self.proxy.liveness.allowed(self.model)
        candidates = self.routing.worker_ids(self.model) if allowed is None else allowed
        others = [w for w in candidates if w not in tried_ids]
        if not others:
            return await self._fail(exc.status, _unreachable(tried, exc, alternative=False))
        self.proxy.counters.retried += 1
        self.proxy.liveness.retried += 1
        try:
            with trio.CancelScope(shield=True):
                target = await self.routing.book(self.model, self.tokens, f"{self.request_id}:retry", allowed=others)
        except RouterError as refused:
            return await self._fail(refused.status, f"{_unreachable(tried, exc, alternative=False)}: {refused.message}")
        return target

    async def _server_error(self, target: Target, response: httpx.Response) -> None:
        """A 5xx (not 503) before anything was relayed: read (bounded), closed, raised as the worker failing."""
        self.proxy.counters.worker_errors += 1
        try:
            answer = await _read_limited(response, self.limits.error_body_limit, self.limits.read_timeout)
        finally:
            await response.aclose()
        reason = f"answered {response.status_code}: {_error_text(answer)}"
        raise WorkerUnreachable(target, reason, Cause.SERVER_ERROR, 502)

    async def _post(self, target: Target, content: bytes) -> httpx.Response:
        """The worker's response, open for reading (headers in); ``WorkerUnreachable`` if it cannot be reached."""
        request = self.proxy.client.build_request(
            "POST",
            self.proxy.worker_url(target, self.path),
            content=content,
            headers={
                "content-type": "application/json",
                "x-request-id": self.request_id,
                # Relayed bytes are labelled as the worker labels them, minus its encoding: ask for none.
                "accept-encoding": "identity",
            },
        )
        try:
            try:
                return await self.proxy.client.send(request, stream=True)
            except DROPPED:
                # Connected, and the connection dropped before any answer (a pooled connection the worker's idle
                # timeout closed as the request went out): once more to the same worker, on a new connection.
                return await self.proxy.client.send(request, stream=True)
        except httpx.ConnectTimeout as exc:
            reason = f"at {target.endpoint} cannot be reached ({_describe(exc)})"
            raise WorkerUnreachable(target, reason, Cause.CONNECT_TIMEOUT) from None
        except httpx.ConnectError as exc:
            reason = f"at {target.endpoint} cannot be reached ({_describe(exc)})"
            raise WorkerUnreachable(target, reason, Cause.REFUSED) from None
        except DROPPED as exc:
            reason = f"at {target.endpoint} dropped the connection twice before answering ({_describe(exc)})"
            raise WorkerUnreachable(target, reason, Cause.DROPPED, 502) from None

    async def _relay(self, target: Target, response: httpx.Response) -> bool:
        worker = f"worker {target.worker_id} ({target.endpoint})"
        headers = [
            *self.extra_headers,
            (b"x-kvrouter-worker-id", str(target.worker_id).encode()),
            (b"x-kvrouter-dp-rank", str(target.dp_rank).encode()),
            (b"x-kvrouter-overlap-blocks", str(target.overlap_blocks).encode()),
        ]
        if response.status_code != 200:
            self.proxy.counters.worker_errors += 1
            try:
                answer = await _read_limited(response, self.limits.error_body_limit, self.limits.read_timeout)
            except httpx.HTTPError as exc:
                return await self._fail(502, f"{worker} failed: {_describe(exc)}")
            status = response.status_code
            if 400 <= status < 500 and status != 408:
                passed = error_response(status, _error_text(answer), tuple(headers))
            elif status == 503:
                message = f"{worker} is unavailable: {_error_text(answer)}"
                passed = error_response(503, message, (*headers, (b"retry-after", b"1")))
            else:
                passed = error_response(502, f"{worker} answered {status}: {_error_text(answer)}", tuple(headers))
            await self._answer(passed)
            return False
        headers += [(name, value) for name, value in response.headers.raw if name.lower() in PASSED_HEADERS]
        # A worker that compresses anyway is decoded (httpx's decoders): the client may not have asked for it.
        encoded = response.headers.get("content-encoding", "identity").strip().lower() not in ("", "identity")
        length = response.headers.get("content-length")
        if not self.streaming and length is not None and not encoded:
            headers.append((b"content-length", length.encode()))  # a whole JSON answer: framed as the worker did
        await self.send({"type": "http.response.start", "status": 200, "headers": headers})
        self.started = True
        scanner = FirstToken(self.limits.sse_scan_limit) if self.streaming else None
        prefill_done = False
        try:
            # Closed here whatever ends the relay (the client gone, a cancellation), not left to the collector.
            async with _closing(response.aiter_bytes() if encoded else response.aiter_raw()) as chunks:
                async for chunk in chunks:
                    if not chunk:
                        continue
                    await self.send({"type": "http.response.body", "body": chunk, "more_body": True})
                    if not prefill_done and (scanner is None or scanner.feed(chunk)):
                        prefill_done = True
                        with trio.CancelScope(shield=True):
                            await self.routing.prefill_complete(target)
        except httpx.HTTPError as exc:
            self.proxy.counters.worker_errors += 1
            return await self._fail(502, f"{worker} failed mid-answer: {_describe(exc)}")
        return True

    async def _fail(self, status: int, message: str) -> bool:
        """Tell the client: an error response if none started, else (a stream) a last SSE event with the error."""
        log.warning("%s: %s", self.request_id, message)
        if not self.started:
            headers = ((b"retry-after", b"1"),) if status == 503 else ()
            await self._answer(error_response(status, message, (*self.extra_headers, *headers)))
            return False
        if not self.streaming:
            return False  # a JSON answer cut short: the connection closes and the client sees it incomplete
        event = SSE_DATA + orjson.dumps({"error": {"message": message, "code": status}}) + b"\n\n"
        await self.send({"type": "http.response.body", "body": event, "more_body": True})
        return True

    async def _answer(self, response: Response) -> None:
        """A whole response, the request's last: not cancelled by the client's disconnect (see above)."""
        self.started = self.ending = True
        with trio.CancelScope(shield=True):
            await send_response(self.send, response)

    async def _free(self, target: Target) -> None:
        with trio.move_on_after(self.limits.connect_timeout):
            try:
                await self.routing.free(target)
            except RouterError as exc:
                log.warning("%s: could not free booking %s: %s", self.request_id, target.reservation_id, exc)


class FirstToken:
    """Finds the first SSE event carrying generated output in a stream of chunks (the role-only opening chunk
    of a chat stream carries none). Past ``limit`` bytes without one, it gives up and says found."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pending = b""
        self.scanned = 0

    def feed(self, chunk: bytes) -> bool:
        self.scanned += len(chunk)
        if self.scanned > self.limit:
            return True
        self.pending += chunk
        *events, self.pending = self.pending.replace(b"\r\n", b"\n").split(b"\n\n")
        return any(_carries_output(event) for event in events)


def _carries_output(event: bytes) -> bool:
    for line in event.split(b"\n"):
        if not line.startswith(SSE_DATA):
            continue
        payload = line[len(SSE_DATA) :].strip()
        if payload == DONE:
            return True
        try:
            value = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return True  # not ours to judge: count it
        if not isinstance(value, dict):
            return True
        choices = value.get("choices")
        if not isinstance(choices, list) or not choices:
            return True  # usage or error: the output is over
        for choice in choices:
            if not isinstance(choice, dict):
                return True
            delta = choice.get("delta")
            if choice.get("text") or choice.get("finish_reason") or (isinstance(delta, dict) and delta.get("content")):
                return True
    return False


async def send_response(send: Any, response: Response, *, body_unread: bool = False, head: bool = False) -> None:
    headers = [(b"content-length", str(len(response.body)).encode())]
    if response.content_type is not None:
        headers.append((b"content-type", response.content_type))
    if body_unread:
        headers.append((b"connection", b"close"))
    headers.extend(response.headers)
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if head else response.body})


async def _read_limited(response: httpx.Response, limit: int, seconds: float) -> bytes:
    """The first ``limit`` bytes of a (short) answer. The rest is read and dropped, within ``seconds``: leaving
    httpx's body iterators half-read would leave them to the garbage collector."""
    chunks: list[bytes] = []
    size = 0
    with trio.move_on_after(seconds):
        async with _closing(response.aiter_raw()) as body:
            async for chunk in body:
                if size < limit:
                    chunks.append(chunk[: limit - size])
                size += len(chunk)
    return b"".join(chunks)


def _closing(chunks: AsyncIterator[bytes]) -> contextlib.aclosing[AsyncGenerator[bytes, None]]:
    """httpx's body iterators are async generators: closed on leaving the block, even half-read."""
    return contextlib.aclosing(cast(AsyncGenerator[bytes, None], chunks))


def _error_text(body: bytes) -> str:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:300].decode("utf-8", "replace").strip() or "(empty body)"
    if isinstance(value, dict):
        error = value.get("error")
        if isinstance(error, str):
            return error
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
    return body[:300].decode("utf-8", "replace")


def _cached_tokens(body: bytes) -> int | None:
    try:
        cached = orjson.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    return cached if isinstance(cached, int) else None


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _unreachable(tried: Sequence[Target], exc: WorkerUnreachable, *, alternative: bool) -> str:
    names = ", ".join(f"{t.worker_id} ({t.endpoint})" for t in tried)
    if exc.cause is Cause.SERVER_ERROR:
        if alternative:
            return f"workers {names} failed (last: {exc.reason})"
        return f"worker {names} {exc.reason}; no other worker of this model is available"
    if alternative:
        return f"workers {names} cannot be reached (last: {exc.reason}); check that they are running"
    return f"worker {names} cannot be reached ({exc.reason}) and no other worker of this model is available"


def _breaks(status: int) -> bool:
    """A worker's answer that opens its breaker: a 5xx, except 503 (the worker shedding load is alive)."""
    return status >= 500 and status != 503
