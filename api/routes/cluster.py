"""A service's routes on a cluster replica: the same routes, each scope's commands sent where it is served.

``clustered(routes, service, routing)`` takes a service kind's routes bound to its ``ClusterService`` and changes
only the handlers its ``ClusterRouting`` names (the slot tracker's: ``SLOT_ROUTING``; the selection service's:
``api/routes/cluster_select.py``):

* a command naming a scope (the writes, ``POST /potential_loads``) asks ``service.where``: served here, the
  route's own handler answers; owned by another live member, the request goes to it as the client sent it, once
  (``FORWARDED_HEADER``), and its answer comes back as it is (504 if the owner gave none: the outcome is
  unknown); otherwise 503 ``{"error": ...}``: not applied, safe to retry. A slot-tracker write owned elsewhere
  goes to its owner with the other writes bound there at that moment, in one ``POST /batch``
  (``actors/cluster/forward_batches.py``), and its own result comes back as its route's answer; a selection
  service's request goes the same way, in a ``POST /batch?ordered=false`` (the requests of a batch owe each other
  no order), unless its body is too large for a batch. Commands of
  ``POST /batch`` and the command stream go through ``ClusterSlotService.apply_writes``, which does the same per
  scope; a ``POST /batch`` another replica forwarded runs with ``FORWARDED_BATCH`` set (``api/routes/forwarded.py``,
  which also checks that the sender is a member), so none of its writes is forwarded again
  (``ClusterService.where`` says when a move makes an exception);
* a read of many scopes (``GET /workers``, ``GET /loads``) gathers the rows of every live member: this replica's
  own (the scopes it serves) and, through each other member, theirs (asked with ``FORWARDED_HEADER``, so each
  answers for itself alone). A member that does not answer, or a known scope that no live member owns right now
  (its owner died and it is not claimed yet), makes the read a 503 rather than a partial answer. A slot
  tracker's replica answers it itself instead when it holds a follower copy, ready for the read, of each scope it
  covers that it does not serve (``follower_reads``; writes answer ``kvrouter-written``, reads name ``read_after``);
* a command naming no scope (a reservation id, a worker id) is answered here if a scope served here holds what it
  names, else by the first other live member that does not answer 404 (each asked with ``FORWARDED_HEADER``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import quote

import attrs
import orjson
import trio

from kvrouter.actors.cluster.follower_reads import READ_AFTER, WRITTEN_HEADER, parse_read_after, reading
from kvrouter.actors.cluster.forward_batches import command
from kvrouter.actors.cluster.forwarder import OwnerUnreachable, Relayed
from kvrouter.actors.cluster.marks import FORWARDED_BATCH
from kvrouter.actors.cluster.service import ClusterService, ClusterSlotService
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.ownership.forwarding import Forward, Serve
from kvrouter.api.bodies.schemas import PotentialLoadsBody, parse
from kvrouter.api.http import UNPARSED, Request, Response, Route, error_response, json_response
from kvrouter.api.routes.support import scope_filter

ScopeOf = Callable[[Request], ScopeKey]
Merge = Callable[[list[Any]], Response]  # every member's answer (JSON), this replica's first: the client's answer


@attrs.frozen
class Gather:
    """A read of many scopes: how the members' answers make one, and which statuses a member may answer with."""

    merge: Merge
    statuses: tuple[int, ...] = (200,)


@attrs.frozen
class ClusterRouting:
    """How one service kind's routes reach their scopes in a cluster (``clustered``):

    * ``scoped``: the commands naming a scope, each with how its request names it (None: as the route's
      ``Batched.prepare`` reads it, ``[method, model, tenant, ...]``);
    * ``gathered``: the reads of many scopes, each with how the members' answers are put together;
    * ``located``: commands naming something else (a reservation, a worker id): whichever member holds it answers
      (for a reservation booked through this replica, its scope's owner: ``books``, ``releases``).
    """

    scoped: Mapping[str, ScopeOf | None]
    gathered: Mapping[str, Gather]
    located: frozenset[str] = frozenset()
    books: frozenset[str] = frozenset()  # scoped commands whose success names reservations (``BookedScopes``)
    releases: frozenset[str] = frozenset()  # located commands whose success ends the reservation they name


def _body_scope(request: Request) -> ScopeKey:
    return parse(PotentialLoadsBody, request.json()).scope()


def _rows(answers: list[Any]) -> Response:
    return json_response(200, sorted((row for rows in answers for row in rows), key=_row_order))


SCOPED_WRITES = ("register", "unregister", "add", "prefill_complete", "free")
SLOT_ROUTING = ClusterRouting(
    scoped={**dict.fromkeys(SCOPED_WRITES), "potential_loads": _body_scope},
    gathered={"workers": Gather(_rows), "loads": Gather(_rows)},
)


def clustered(routes: list[Route], service: ClusterService[Any], routing: ClusterRouting = SLOT_ROUTING) -> list[Route]:
    changed = []
    # One tokened ``apply`` per original: the runner puts consecutive commands in one call only when their routes
    # share ``apply``, which keeps a batch's writes of a scope in order (add, then prefill_complete, ...).
    tokened: dict[int, Any] = {}
    for route in routes:
        name = route.operation.name if route.operation is not None else None
        if name is None:
            pass
        elif name in routing.scoped:
            scope_of = routing.scoped[name]
            if scope_of is None:
                assert route.batched is not None, f"{name} reads its scope from its Batched.prepare"
                # pipelined=False: the scope's owner is found before the command is posted
                forward = _batched_forward(service, route.batched.prepare) if name in SCOPED_WRITES else None
                scoped = _scoped(route, service, _item_scope(route.batched.prepare), forward)
                batched = route.batched
                if name in SCOPED_WRITES:  # the slot tracker's writes answer their token (``follower_reads``)
                    apply = tokened.setdefault(id(batched.apply), _tokened(batched.apply, service))
                    batched = attrs.evolve(batched, apply=apply)
                route = attrs.evolve(route, handler=scoped, pipelined=False, batched=batched)
            else:
                forward = None if service.batches.ordered else _forward_in_batches(service)
                books = name in routing.books
                route = attrs.evolve(route, handler=_scoped(route, service, scope_of, forward, books))
        elif name in routing.gathered:
            route = attrs.evolve(route, handler=_gathered(route, service, routing.gathered[name]))
        elif name in routing.located:
            route = attrs.evolve(route, handler=_located(route, service, name in routing.releases))
        changed.append(route)
    return changed


def _item_scope(prepare: Callable[[Request], Any]) -> Callable[[Request], ScopeKey]:
    """The scope of a write request, read as its route reads it (``Batched.prepare``: ``[method, model, tenant,
    ...]``)."""

    def scope_of(request: Request) -> ScopeKey:
        item = prepare(request)
        return ScopeKey(item[1], item[2])

    return scope_of


def _relayed(relayed: Relayed) -> Response:
    written = ((WRITTEN_HEADER.encode(), relayed.written.encode("latin-1")),) if relayed.written else ()
    return Response(relayed.status, relayed.body, relayed.content_type, (*relayed.headers, *written))


Relaying = Callable[[str, Request], Awaitable[Relayed]]


def _batched_forward(service: ClusterService[Any], prepare: Callable[[Request], Any]) -> Relaying | None:
    """A slot-tracker write sent on to ``owner`` with the writes going there at the same time (one batch)."""
    if not isinstance(service, ClusterSlotService):
        return None
    slots = service

    async def forward(owner: str, request: Request) -> Relayed:
        [outcome] = await slots.forward_writes(owner, [prepare(request)])
        if isinstance(outcome, OwnerUnreachable):
            raise outcome
        return outcome

    return forward


def _forward_in_batches(service: ClusterService[Any]) -> Relaying:
    """A request sent on to ``owner`` as one command of a batch going there (``ForwardBatches``, unordered: the
    selection service's), with the other requests bound there at that moment; a body too large for a batch goes
    alone, as sent."""
    alone = _relay_as_sent(service)

    async def forward(owner: str, request: Request) -> Relayed:
        body = body_of(request)
        if len(body) > service.batches.max_bytes or (body and not _fits_in_a_batch(body)):
            return await alone(owner, request)  # too large for a batch, or unreadable in one: its route answers it
        target = quote(request.path) + (f"?{request.query_string.decode('latin-1')}" if request.query_string else "")
        [outcome] = await service.batches.send(owner, [command(request.method, target, body)])
        if isinstance(outcome, OwnerUnreachable):
            raise outcome
        return outcome

    return forward


def _relay_as_sent(service: ClusterService[Any]) -> Relaying:
    """A request sent on to ``owner`` as the client sent it, alone."""

    async def forward(owner: str, request: Request) -> Relayed:
        return await service.relay(owner, request.method, request.path, request.query_string, body_of(request))

    return forward


def _with_written(response: Response, token: str | None) -> Response:
    """A write's success, with the ``kvrouter-written`` token of its scope (``follower_reads``)."""
    if token is None or response.status not in (200, 201):
        return response
    return attrs.evolve(response, headers=(*response.headers, (WRITTEN_HEADER.encode(), token.encode("latin-1"))))


def _tokened(apply: Callable[[list[Any]], Awaitable[list[Response]]], service: ClusterService[Any]) -> Any:
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


def _scoped(
    route: Route, service: ClusterService[Any], scope_of: ScopeOf, forward: Relaying | None = None, books: bool = False
) -> Any:
    own = route.handler
    relay = forward if forward is not None else _relay_as_sent(service)
    write = route.operation is not None and route.operation.name in SCOPED_WRITES

    async def handler(request: Request) -> Response:
        scope = scope_of(request)  # bad input is refused here, as the route's own handler refuses it
        where = await service.where(scope, forwarded(request))
        if isinstance(where, Serve):
            answer = await own(request)
            return _with_written(answer, service.written.of(scope)) if write else answer
        if isinstance(where, Forward):
            try:
                relayed = await relay(where.owner, request)
            except OwnerUnreachable as exc:
                if exc.unknown:
                    return error_response(504, f"the owner of {scope.describe()}: {exc}; the outcome is unknown")
                return error_response(503, f"the owner of {scope.describe()}: {exc}; not applied, safe to retry")
            service.written.note(relayed.written)
            if books and relayed.status in (200, 201):  # a selection that booked (200), a reservation (201)
                service.booked.note_answer(_json_or_none(relayed.body), scope)
            return _relayed(relayed)
        return error_response(where.status, f"{where.message}; not applied, safe to retry")

    return handler


def _gathered(route: Route, service: ClusterService[Any], gather: Gather) -> Any:
    own = route.handler

    async def handler(request: Request) -> Response:
        if not forwarded(request) and service.follower_reads is not None:
            try:
                after = read_after_of(request)
            except ValueError as exc:
                return error_response(400, str(exc))
            states = await service.follower_reads.states_for(scope_filter(request), after)
            if states is not None:  # every scope of the read served here or by a copy ready for it
                with reading(states):
                    return await own(request)
        mine = await own(request)
        if forwarded(request) or mine.status not in gather.statuses:
            return mine
        others = sorted(service.live_members() - {service.membership.me})
        answers = await _ask_all(service, others, request)
        missing = service.unowned(scope_filter(request))
        if missing:
            names = ", ".join(scope.describe() for scope in missing[:3])
            return error_response(
                503, f"no live replica owns {len(missing)} scope(s) right now ({names}); retry shortly"
            )
        found: list[Any] = [orjson.loads(mine.body)]
        for member in others:
            answer = answers[member]
            if isinstance(answer, OwnerUnreachable) or answer.status not in gather.statuses:
                why = answer if isinstance(answer, OwnerUnreachable) else f"HTTP {answer.status}"
                return error_response(503, f"member {member} did not answer ({why}): its scopes' rows are missing")
            found.append(orjson.loads(answer.body))
        return gather.merge(found)

    return handler


def forwarded(request: Request) -> bool:
    """Whether another replica sent this request here: marked itself, or a command of a batch it forwarded."""
    return request.forwarded or FORWARDED_BATCH.get()


def read_after_of(request: Request) -> dict[str, int]:
    """The read's tokens (``read_after``): the scopes whose copies must hold the caller's writes."""
    value = request.query((READ_AFTER,)).get(READ_AFTER)
    return parse_read_after(value) if value is not None else {}


def _located(route: Route, service: ClusterService[Any], releases: bool = False) -> Any:
    """A command naming no scope: this replica answers if a scope it serves holds what it names; otherwise the
    owner of the scope a reservation was booked in through this replica (``BookedScopes``), unless it answers 404;
    otherwise the first other live member that does not answer 404; 404 if none holds it, 503 if a scope has no
    live owner. ``releases``: a success ends the reservation (forgotten)."""
    own = route.handler
    to_owner = _forward_in_batches(service)

    def answered(request: Request, relayed: Relayed) -> Response:
        reservation = request.path_params.get("reservation_id")
        if releases and reservation is not None and relayed.status == 200:
            service.booked.forget(reservation)
        return _relayed(relayed)

    async def handler(request: Request) -> Response:
        mine = await own(request)
        if forwarded(request) or mine.status != 404:
            return mine
        reservation = request.path_params.get("reservation_id")
        scope = service.booked.scope_of(reservation) if reservation is not None else None
        if scope is not None:
            where = await service.where(scope)
            if isinstance(where, Forward):
                try:
                    relayed = await to_owner(where.owner, request)
                except OwnerUnreachable as exc:
                    if exc.unknown:
                        return error_response(504, f"the owner of {scope.describe()}: {exc}; the outcome is unknown")
                else:
                    if relayed.status != 404:
                        return answered(request, relayed)
        others = sorted(service.live_members() - {service.membership.me})
        answers = await _ask_all(service, others, request)
        for member in others:
            answer = answers[member]
            if isinstance(answer, Relayed) and answer.status != 404:
                return answered(request, answer)
        silent = [member for member in others if isinstance(answers[member], OwnerUnreachable)]
        missing = service.unowned()
        if silent or missing:
            why = f"member {silent[0]} did not answer" if silent else f"{len(missing)} scope(s) have no live owner"
            return error_response(503, f"not found on the replicas that answered, and {why}; not applied, retry")
        return mine

    return handler


async def _ask_all(
    service: ClusterService[Any], members: list[str], request: Request
) -> dict[str, Relayed | OwnerUnreachable]:
    """``request`` sent to each of ``members`` at once (marked forwarded: each answers for itself alone)."""
    answers: dict[str, Relayed | OwnerUnreachable] = {}
    body = body_of(request)

    async def ask(member: str) -> None:
        try:
            answers[member] = await service.relay(member, request.method, request.path, request.query_string, body)
        except OwnerUnreachable as exc:
            answers[member] = exc

    async with trio.open_nursery() as nursery:
        for member in members:
            nursery.start_soon(ask, member)
    return answers


def _fits_in_a_batch(body: bytes) -> bool:
    """Whether ``body`` is JSON the owner reads inside a batch, two levels deeper (``[{"body": ...}]``): a body
    nested near the parser's depth limit is read alone but not there, and would get the whole batch refused."""
    try:
        orjson.loads(b"[[" + body + b"]]")
    except orjson.JSONDecodeError:
        return False
    return True


def _json_or_none(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


def body_of(request: Request) -> bytes:
    """The request's body as sent: a command of a batch arrives parsed, and is sent on as its JSON."""
    if not request.body and request.parsed is not UNPARSED and request.parsed is not None:
        return orjson.dumps(request.parsed)
    return request.body


def _row_order(row: dict[str, Any]) -> tuple[Any, ...]:
    """The order a single replica answers in: by scope, worker, then rank (loads) or range start (workers)."""
    fields = ("model_name", "tenant_id", "worker_id", "dp_rank", "dp_start")
    return tuple(row.get(field, "" if field in ("model_name", "tenant_id") else 0) for field in fields)
