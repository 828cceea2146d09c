"""The slot tracker's routes on a cluster replica: the same routes, each scope's commands sent where it is served.

``clustered(routes, service)`` takes the slot tracker's routes bound to a ``ClusterSlotService`` and changes only
their handlers:

* a command naming a scope (the writes, ``POST /potential_loads``) asks ``service.where``: served here, the
  route's own handler answers; owned by another live member, the request goes to it as the client sent it, once
  (``FORWARDED_HEADER``), and its answer comes back as it is; otherwise 503 ``{"error": ...}``: not applied,
  safe to retry. Commands of ``POST /batch`` and the command stream go through ``ClusterSlotService.apply_writes``,
  which does the same per scope;
* a read of many scopes (``GET /workers``, ``GET /loads``) gathers the rows of every live member: this replica's
  own (the scopes it serves) and, through each other member, theirs (asked with ``FORWARDED_HEADER``, so each
  answers for itself alone). A member that does not answer, or a known scope that no live member owns right now
  (its owner died and it is not claimed yet), makes the read a 503 rather than a partial answer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import orjson
import trio

from kvrouter.actors.cluster.follower_reads import READ_AFTER, WRITTEN_HEADER, parse_read_after, reading
from kvrouter.actors.cluster.forwarder import OwnerUnreachable, Relayed
from kvrouter.actors.cluster.service import ClusterSlotService
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.ownership.forwarding import Forward, Serve
from kvrouter.api.bodies.schemas import PotentialLoadsBody, parse
from kvrouter.api.http import UNPARSED, Request, Response, Route, error_response, json_response
from kvrouter.api.routes.support import scope_filter

SCOPED_WRITES = ("register", "unregister", "add", "prefill_complete", "free")
GATHERED_READS = ("workers", "loads")


def clustered(routes: list[Route], service: ClusterSlotService) -> list[Route]:
    changed = []
    for route in routes:
        name = route.operation.name if route.operation is not None else None
        if name in SCOPED_WRITES and route.batched is not None:
            scope_of = _item_scope(route.batched.prepare)
            batched = attrs.evolve(route.batched, apply=_tokened(route.batched.apply, service))
            # pipelined=False: the scope's owner is found before the command is posted
            route = attrs.evolve(route, handler=_scoped(route, service, scope_of), pipelined=False, batched=batched)
        elif name == "potential_loads":
            route = attrs.evolve(route, handler=_scoped(route, service, _body_scope))
        elif name in GATHERED_READS:
            route = attrs.evolve(route, handler=_gathered(route, service))
        changed.append(route)
    return changed


def _item_scope(prepare: Callable[[Request], Any]) -> Callable[[Request], ScopeKey]:
    """The scope of a write request, read as its route reads it (``Batched.prepare``: ``[method, model, tenant,
    ...]``)."""

    def scope_of(request: Request) -> ScopeKey:
        item = prepare(request)
        return ScopeKey(item[1], item[2])

    return scope_of


def _body_scope(request: Request) -> ScopeKey:
    return parse(PotentialLoadsBody, request.json()).scope()


def _body_bytes(request: Request) -> bytes:
    """The body to forward: as the client sent it, or (a command of a batch or of the command stream, whose body
    comes parsed) encoded again."""
    return request.body if request.parsed is UNPARSED else orjson.dumps(request.parsed)


def _relayed(relayed: Relayed) -> Response:
    headers = ((WRITTEN_HEADER.encode(), relayed.written.encode("latin-1")),) if relayed.written else ()
    return Response(relayed.status, relayed.body, relayed.content_type, headers)


def _with_written(response: Response, token: str | None) -> Response:
    """A write's success, with the ``kvrouter-written`` token of its scope (``follower_reads``)."""
    if token is None or response.status not in (200, 201):
        return response
    return attrs.evolve(response, headers=(*response.headers, (WRITTEN_HEADER.encode(), token.encode("latin-1"))))


def _tokened(apply: Callable[[list[Any]], Awaitable[list[Response]]], service: ClusterSlotService) -> Any:
    """``Batched.apply`` of a write route (``POST /batch``, the command stream), each success with its scope's
    token (one response per scope and answer: most answers of a group are the same few responses)."""

    async def tokened(prepared: list[Any]) -> list[Response]:
        responses = await apply(prepared)
        made: dict[tuple[ScopeKey, int], Response] = {}
        answers = []
        for item, response in zip(prepared, responses, strict=True):
            scope = ScopeKey(item[1], item[2])
            key = (scope, id(response))
            if key not in made:
                made[key] = _with_written(response, service.written.of(scope))
            answers.append(made[key])
        return answers

    return tokened


def _scoped(route: Route, service: ClusterSlotService, scope_of: Callable[[Request], ScopeKey]) -> Any:
    own = route.handler
    write = route.operation is not None and route.operation.name in SCOPED_WRITES

    async def handler(request: Request) -> Response:
        scope = scope_of(request)  # bad input is refused here, as the route's own handler refuses it
        where = await service.where(scope, request.forwarded)
        if isinstance(where, Serve):
            answer = await own(request)
            return _with_written(answer, service.written.of(scope)) if write else answer
        if isinstance(where, Forward):
            try:
                relayed = await service.relay(
                    where.owner, request.method, request.path, request.query_string, _body_bytes(request)
                )
            except OwnerUnreachable as exc:
                if exc.unknown:
                    return error_response(503, f"the owner of {scope.describe()}: {exc}; the outcome is unknown")
                return error_response(503, f"the owner of {scope.describe()}: {exc}; not applied, safe to retry")
            service.written.note(relayed.written)
            return _relayed(relayed)
        return error_response(where.status, f"{where.message}; not applied, safe to retry")

    return handler


def _gathered(route: Route, service: ClusterSlotService) -> Any:
    own = route.handler

    async def handler(request: Request) -> Response:
        if not request.forwarded and service.follower_reads is not None:
            try:
                after = read_after_of(request)
            except ValueError as exc:
                return error_response(400, str(exc))
            states = await service.follower_reads.states_for(scope_filter(request), after)
            if states is not None:  # every scope of the read served here or by a copy ready for it
                with reading(states):
                    return await own(request)
        mine = await own(request)
        if request.forwarded or mine.status != 200:
            return mine
        others = sorted(service.live_members() - {service.membership.me})
        answers: dict[str, Relayed | OwnerUnreachable] = {}

        async def ask(member: str) -> None:
            try:
                answers[member] = await service.relay(member, request.method, request.path, request.query_string, b"")
            except OwnerUnreachable as exc:
                answers[member] = exc

        async with trio.open_nursery() as nursery:
            for member in others:
                nursery.start_soon(ask, member)
        missing = service.unowned(scope_filter(request))
        if missing:
            names = ", ".join(scope.describe() for scope in missing[:3])
            return error_response(
                503, f"no live replica owns {len(missing)} scope(s) right now ({names}); retry shortly"
            )
        rows: list[Any] = orjson.loads(mine.body)
        for member in others:
            answer = answers[member]
            if isinstance(answer, OwnerUnreachable) or answer.status != 200:
                why = answer if isinstance(answer, OwnerUnreachable) else f"HTTP {answer.status}"
                return error_response(503, f"member {member} did not answer ({why}): its scopes' rows are missing")
            rows.extend(orjson.loads(answer.body))
        rows.sort(key=_row_order)
        return json_response(200, rows)

    return handler


def read_after_of(request: Request) -> dict[str, int]:
    """The read's tokens (``read_after``): the scopes whose copies must hold the caller's writes."""
    value = request.query((READ_AFTER,)).get(READ_AFTER)
    return parse_read_after(value) if value is not None else {}


def _row_order(row: dict[str, Any]) -> tuple[Any, ...]:
    """The order a single replica answers in: by scope, worker, then rank (loads) or range start (workers)."""
    fields = ("model_name", "tenant_id", "worker_id", "dp_rank", "dp_start")
    return tuple(row.get(field, "" if field in ("model_name", "tenant_id") else 0) for field in fields)
