"""Commands: many requests in one message, each answered exactly as its own route would answer it.

A command is a JSON object naming a route of the service and what the request would carry::

    {"method": "POST", "path": "/add", "body": {...}}
    {"method": "GET", "path": "/loads?model_name=m"}

It is dispatched through the service's one route table (the same ``Route`` objects the HTTP app
serves), so it gets the same path parameters, parsing, validation, service-object call and error
mapping as the single request; its result is ``{"status": ..., "body": ...}`` with the route's status
and JSON body (``null`` for an empty body, a string for a text one) and, where the route sends any,
``"headers"`` (``retry-after``, ``allow``, ...). A command that names no route, or is not a command,
gets the 4xx a request would get (404 ``route not found``, 405, 400).

Order (``run`` with ``ordered=True``, as ``POST /batch`` runs them by default): commands start in list
order. A command of a *pipelined* route (a slot tracker write: its handler puts its one command into
its scope's mailbox before its first wait) lets the next command start as soon as it waits for its
decision, so the commands of one scope are decided in list order and share fsyncs (group commit),
while other scopes proceed at the same time. Any other command (a read, a selection, a catalog or
reservation change, whose handler reads state first) starts once every earlier command has finished,
and the next starts once it has: it sees every earlier command's effect. Every result is durable
under the service's ``--durability`` before it is delivered (each route's own guarantee). A failing
command does not stop the others: each has its own result. The answer is bounded in bytes
(``--max-batch-answer-bytes``): past it, commands are answered 413 without being run (``api/streams/answer_budget.py``).

``POST /batch?ordered=false`` (as a stream message's ``"ordered": false``): the commands are independent, and all
start at once (the batched writes of each kind still go in one service call, in list order); a read whose answer
would take the batch's answer past its cap has run, and is answered 413 (it changed nothing). A batch another
replica forwarded (``FORWARDED_BATCH``) may answer up to what the forwarding replica takes back (64 MiB), if that is
more than the cap: it carries many clients' commands, and none of them chose to share a cap. A cluster replica
forwards the selection service's commands this way: one batch carries the requests of many clients, which owe each
other no order, and each selection that books waits for its own durability, not for the ones before it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol
from urllib.parse import unquote

import orjson
import trio

from kvrouter.actors.cluster.marks import FORWARDED_ANSWER_BYTES, FORWARDED_BATCH
from kvrouter.api.http import JSON, UNPARSED, HttpError, Request, Response, Route, error_response, release
from kvrouter.api.http.app import RouteTable, call_route, http_error_response
from kvrouter.api.http.json_keys import RepeatedKeys, find_repeated
from kvrouter.api.routes.operations import route
from kvrouter.api.streams.answer_budget import DEFAULT_BUDGETS, AnswerBudgets, AnswerMetrics, BatchAnswer, StreamOutput

log = logging.getLogger("kvrouter.api")

BATCH_PATH = "/batch"
MAX_BATCH_COMMANDS = 1000  # per POST /batch and per stream message (policy beyond: 413 / close 1009)
NOT_A_COMMAND = (
    "a command is a JSON object with a string `method`, a string `path` starting with `/`, and an optional `body`"
)
NESTED_BATCH = "a batch cannot contain a batch"
COMMAND_FIELDS = ("method", "path", "body", "id")  # a command's own keys (``id``: the command stream's)
NOT_A_BATCH = "a batch is a JSON array of commands"
ORDERED_QUERY = "ordered"  # POST /batch?ordered=false: the commands are independent (start at once)

Resolved = tuple[Route, Request]
Deliver = Callable[[int, Response], None]


class Ready:
    """A command of a batched route already parsed and checked into its plain item (``Batched.prepare``'s
    result), as the command stream's compact format gives its hot writes: no request, no route lookup.
    ``apply``: the route's ``Batched.apply``."""

    __slots__ = ("apply", "prepared")

    def __init__(self, apply: Callable[[list[Any]], Awaitable[list[Response]]], prepared: Any) -> None:
        self.apply = apply
        self.prepared = prepared


Item = Resolved | Response | Ready


class Gate(Protocol):
    """How a run admits its commands by the bytes of their answers (``api/streams/answer_budget.py``): ``closed``: no
    command starts any more, each is answered ``refusal()`` (POST /batch past its cap); ``run(item)``: the answer
    of a command that runs alone (not a pipelined or batched write), run when the gate lets it."""

    @property
    def closed(self) -> bool: ...

    def refusal(self) -> Response: ...

    async def run(self, item: Resolved) -> Response: ...


class BatchGate:
    """POST /batch's gate: commands run while its answer is under the cap; none once it reached it."""

    __slots__ = ("answer",)

    def __init__(self, answer: BatchAnswer) -> None:
        self.answer = answer

    @property
    def closed(self) -> bool:
        return self.answer.closed

    def refusal(self) -> Response:
        return self.answer.refusal()

    async def run(self, item: Resolved) -> Response:
        if self.answer.closed:  # an earlier command's answer reached the cap while this one waited its turn
            return self.answer.refusal()
        return await answer(*item)


class StreamGate:
    """The command stream's gate: a read starts once its connection has room for its answer (backpressure);
    writes are not held."""

    __slots__ = ("output",)

    closed = False

    def __init__(self, output: StreamOutput) -> None:
        self.output = output

    def refusal(self) -> Response:
        raise AssertionError("a stream's gate never closes")

    async def run(self, item: Resolved) -> Response:
        route, request = item
        if _writes(item):  # a write's answer is small: it is never held (its effect would wait for a reader)
            return await answer(route, request)
        return await self.output.run_read((route.method, route.path), lambda: answer(route, request))


def too_many(count: int) -> str:
    return f"a batch holds at most {MAX_BATCH_COMMANDS} commands; this one has {count}: split it"


class CommandRunner:
    """Resolves commands against a route table and runs them (see the module doc)."""

    def __init__(self) -> None:
        self.table = RouteTable(())

    def serve(self, routes: Iterable[Route]) -> None:
        """Dispatch to ``routes`` (the service's whole table, this runner's own routes included)."""
        self.table = RouteTable(routes)

    def resolve(self, command: Any, repeated: RepeatedKeys | None = None) -> Resolved | Response:
        """The route and request ``command`` names, or the response refusing it (nothing runs).

        ``repeated``: the keys the command's JSON repeated (``find_repeated`` of the batch or message, under the
        command); a repeated key of the command itself is refused, one of its body as its route refuses it."""
        if type(command) is not dict:
            return error_response(400, NOT_A_COMMAND)
        if repeated is not None:
            twice = [key for key in repeated.at(()) if key in COMMAND_FIELDS]
            if twice:
                return error_response(400, f"{NOT_A_COMMAND}; this one has `{twice[0]}` twice")
        method, target = command.get("method"), command.get("path")
        if "body" in command:
            body_keys = repeated.under(("body",)) if repeated is not None else None
            return self.resolve_target(method, target, parsed=command["body"], repeated=body_keys)
        return self.resolve_target(method, target)

    def resolve_target(
        self,
        method: Any,
        target: Any,
        body: bytes = b"",
        parsed: Any = UNPARSED,
        repeated: RepeatedKeys | None = None,
    ) -> Resolved | Response:
        """The route and request of ``method`` and ``target`` (a path with an optional query) with ``body``
        (the request's bytes, parsed as JSON by the route as on its own) or ``parsed`` (a body already parsed,
        whose repeated keys are ``repeated``)."""
        if type(method) is not str or type(target) is not str or not target.startswith("/"):
            return error_response(400, NOT_A_COMMAND)
        raw_path, _, query = target.partition("?")
        try:
            found = self.table.lookup(raw_path.encode("utf-8", "surrogatepass"))
        except HttpError as exc:
            return error_response(exc.status, exc.message)
        if found is None:
            return error_response(404, "route not found")
        methods, params = found
        route = methods.get(method) or (methods.get("GET") if method == "HEAD" else None)
        if route is None:
            allowed = ",".join([*methods, "HEAD"] if "GET" in methods else methods)
            return error_response(405, "method not allowed", ((b"allow", allowed.encode()),))
        if route.path == BATCH_PATH:
            return error_response(400, NESTED_BATCH)
        query_string = query.encode("utf-8", "surrogatepass")
        path = unquote(raw_path) if "%" in raw_path else raw_path
        return route, Request(method, path, query_string, body, params, parsed, route.body_type, repeated)

    async def run(self, commands: Sequence[Item], deliver: Deliver, *, ordered: bool, gate: Gate | None = None) -> None:
        """Run ``commands``; ``deliver(index, response)`` as each finishes (refusals at once).

        ``ordered=False``: every command starts at once (they are independent: no order between them); the
        batched ones (``Route.batched``) of each kind go in one service call. ``gate``: see ``Gate``.
        """
        async with trio.open_nursery() as nursery:
            if ordered:
                await self.run_ordered(commands, deliver, nursery, _Running(), gate)
                return
            groups: dict[Any, list[tuple[int, Any]]] = {}
            for index, item in enumerate(commands):
                if isinstance(item, Response):
                    deliver(index, item)
                elif isinstance(item, Ready):
                    groups.setdefault(item.apply, []).append((index, item.prepared))
                elif item[0].batched is not None:
                    prepared = _prepare(item)
                    if isinstance(prepared, Response):
                        deliver(index, prepared)
                    else:
                        groups.setdefault(item[0].batched.apply, []).append((index, prepared))
                else:
                    nursery.start_soon(_run_one, index, item, deliver, gate)
            for apply, members in groups.items():
                nursery.start_soon(_run_batch, apply, members, deliver)

    async def run_ordered(
        self,
        commands: Sequence[Item],
        deliver: Deliver,
        nursery: trio.Nursery,
        running: _Running,
        gate: Gate | None = None,
    ) -> None:
        """Start ``commands`` in order (the module doc's rules) in ``nursery``; ``running`` holds the pipelined
        commands of the sequence not yet finished (a stream's ordered messages share one). Consecutive
        batched commands of one kind go in one service call, started where the first of them would start.
        ``gate``: see ``Gate``."""
        run: list[tuple[int, Any]] = []
        run_apply: Any = None
        for index, item in enumerate(commands):
            if isinstance(item, Response):
                deliver(index, item)
                continue
            if gate is not None and gate.closed:
                deliver(index, gate.refusal())  # not run (POST /batch past its answer cap)
                continue
            if isinstance(item, Ready) or item[0].batched is not None:
                if isinstance(item, Ready):
                    apply, prepared = item.apply, item.prepared
                else:
                    apply, prepared = item[0].batched.apply, _prepare(item)  # type: ignore[union-attr]
                    if isinstance(prepared, Response):
                        deliver(index, prepared)  # refused before it reached the service: it changes nothing
                        continue
                if run and apply is not run_apply:
                    await nursery.start(running.batch, run_apply, run, deliver)
                    run = []
                run_apply = apply
                run.append((index, prepared))
                continue
            route = item[0]
            if run:
                await nursery.start(running.batch, run_apply, run, deliver)
                run = []
            if route.pipelined:
                await nursery.start(running.pipelined, index, item, deliver)
            else:
                await running.all_done()
                deliver(index, await answer(*item) if gate is None else await gate.run(item))
        if run:
            await nursery.start(running.batch, run_apply, run, deliver)


def _prepare(item: Resolved) -> Any:
    """The batched route's plain item for this request, or the response refusing it (as its handler would)."""
    route, request = item
    assert route.batched is not None
    try:
        return route.batched.prepare(request)
    except HttpError as exc:
        release(exc)
        return http_error_response(exc)
    except Exception as exc:
        log.exception("unhandled error in %s %s", request.method, request.path)
        release(exc)
        return error_response(500, "internal error")


async def _run_batch(apply: Any, members: list[tuple[int, Any]], deliver: Deliver) -> None:
    try:
        responses = await apply([prepared for _, prepared in members])
    except Exception as exc:  # a bug below (``Batched.apply`` answers the service's failures itself)
        log.exception("unhandled error in a batch of %d commands", len(members))
        release(exc)
        responses = [error_response(500, "internal error")] * len(members)
    for (index, _), response in zip(members, responses, strict=True):
        deliver(index, response)


async def answer(route: Route, request: Request) -> Response:
    """The route's response; to HEAD without its body (as the app sends it)."""
    response = await call_route(route, request)
    if request.method == "HEAD" and response.body:
        return Response(response.status, b"", response.content_type, response.headers)
    return response


async def _run_one(index: int, item: Resolved, deliver: Deliver, gate: Gate | None) -> None:
    deliver(index, await answer(*item) if gate is None else await gate.run(item))


class _Running:
    """The pipelined commands of one ordered run that have not finished yet."""

    def __init__(self) -> None:
        self.count = 0
        self.idle = trio.Event()
        self.idle.set()

    async def pipelined(
        self, index: int, item: Resolved, deliver: Deliver, *, task_status: trio.TaskStatus[None]
    ) -> None:
        if self.count == 0:
            self.idle = trio.Event()
        self.count += 1
        # Let the runner go on once this task next waits: by then the handler has submitted its command
        # (no wait comes before that in a pipelined route), so the next command is submitted after it.
        task_status.started()
        try:
            deliver(index, await answer(*item))
        finally:
            self.count -= 1
            if self.count == 0:
                self.idle.set()

    async def batch(
        self, apply: Any, members: list[tuple[int, Any]], deliver: Deliver, *, task_status: trio.TaskStatus[None]
    ) -> None:
        """Batched commands: as ``pipelined`` (the batch's items are all submitted before its first wait)."""
        if self.count == 0:
            self.idle = trio.Event()
        self.count += 1
        task_status.started()
        try:
            await _run_batch(apply, members, deliver)
        finally:
            self.count -= 1
            if self.count == 0:
                self.idle.set()

    async def all_done(self) -> None:
        await self.idle.wait()


def render(response: Response) -> bytes:
    """``{"status": ..., "body": ...}`` (and ``"headers"`` where the route sent some), as JSON bytes."""
    body = response.body
    if not body:
        shown = b"null"
    elif response.content_type == JSON:
        shown = body
    else:
        shown = orjson.dumps(body.decode("utf-8", "replace"))
    if response.headers:
        headers = orjson.dumps({name.decode("latin-1"): value.decode("latin-1") for name, value in response.headers})
        return b'{"status":%d,"body":%s,"headers":%s}' % (response.status, shown, headers)
    return b'{"status":%d,"body":%s}' % (response.status, shown)


def batch_route(
    runner: CommandRunner, budgets: AnswerBudgets = DEFAULT_BUDGETS, metrics: AnswerMetrics | None = None
) -> Route:
    """``POST /batch``: a JSON array of commands, applied in order (see the module doc); answers 200 with
    an array of results, one per command, in the same order. More than MAX_BATCH_COMMANDS: 413. Its answer
    is bounded by ``budgets.batch_answer_bytes`` (``api/streams/answer_budget.py``: past it, commands answer 413)."""
    metrics = metrics if metrics is not None else AnswerMetrics(None)

    async def batch(request: Request) -> Response:
        ordered = _ordered(request)
        commands = request.json()
        if type(commands) is not list:
            raise HttpError(400, NOT_A_BATCH)
        if len(commands) > MAX_BATCH_COMMANDS:
            raise HttpError(413, too_many(len(commands)))
        repeated = find_repeated(request.body, commands)  # None nearly always
        if repeated is None:
            resolved = [runner.resolve(command) for command in commands]
        else:
            resolved = [runner.resolve(command, repeated.under((i,))) for i, command in enumerate(commands)]
        writes = [_writes(item) for item in resolved]
        results: list[bytes] = [b""] * len(resolved)
        cap = budgets.batch_answer_bytes
        if FORWARDED_BATCH.get():  # many clients' commands a replica forwarded: bounded by what it takes back
            cap = max(cap, FORWARDED_ANSWER_BYTES)
        answer = BatchAnswer(cap, metrics, ordered)

        def deliver(index: int, response: Response) -> None:
            result = answer.admit(render(response), writes[index])
            results[index] = result if result is not None else render(answer.refusal())

        await runner.run(resolved, deliver, ordered=ordered, gate=BatchGate(answer))
        return Response(200, b"[" + b",".join(results) + b"]")

    return route("batch", batch)


def _ordered(request: Request) -> bool:
    """``?ordered=``: ``true`` (the default) or ``false``; anything else is a 400 (nothing runs)."""
    value = request.query((ORDERED_QUERY,)).get(ORDERED_QUERY, "true")
    if value not in ("true", "false"):
        raise HttpError(400, f"`{ORDERED_QUERY}` must be true or false, not {value!r}")
    return value == "true"


def _writes(item: Resolved | Response) -> bool:
    """Whether the command may change state (an operation the table marks as writing): its answer is kept."""
    if isinstance(item, Response):
        return False
    route, _ = item
    if route.operation is None:
        return route.method not in ("GET", "HEAD")
    return route.operation.writes
