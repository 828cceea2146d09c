"""The slot tracker's routes: each handler parses its body, calls ``SlotService``, renders the result.

Writes are durable before the service returns; reads have passed a read barrier (see
``actors/slot_service.py``). Failures are answered by ``api/route_support.bound``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.queries import RankLoad
from kvrouter.actors.service_support import decode_failure
from kvrouter.actors.slot_service import SlotService
from kvrouter.api.bodies import write_bodies
from kvrouter.api.bodies.schemas import AddBody, PotentialLoadsBody, RegisterBody, RequestRefBody, UnregisterBody, parse
from kvrouter.api.http import CREATED, OK, Batched, Request, Response, Route, json_response
from kvrouter.api.routes.operations import route
from kvrouter.api.routes.support import bound, failure_response, scope_fields, scope_filter


def done(created: bool) -> Response:
    return CREATED if created else OK


# Each write is parsed into the plain item ``SlotService.apply_writes`` takes (``[method, model, tenant,
# *arguments]``); its own route then calls that method with the same arguments, so a write answers the
# same whether it comes alone or in a batch of commands. The hot bodies are read by ``write_bodies`` when
# they are well-formed, by the strict converter otherwise (same result, same errors).


def _write(method: str, scope: ScopeKey, *arguments: Any) -> list[Any]:
    return [method, scope.model_name, scope.tenant_id, *arguments]


def prepare_register(request: Request) -> list[Any]:
    body = parse(RegisterBody, request.json())
    return _write("register", body.scope(), body.worker_id, body.block_size, body.dp_start, body.dp_size)


def prepare_unregister(request: Request) -> list[Any]:
    body = parse(UnregisterBody, request.json())
    return _write("unregister", body.scope(), body.worker_id)


def prepare_add(request: Request) -> list[Any]:
    value = request.json()
    plain = write_bodies.add_request(value)
    if plain is not None:
        return ["add", *plain]
    body = parse(AddBody, value)
    return _write(
        "add", body.scope(), body.request_id, body.worker_id, body.dp_rank, body.sequence_hashes, body.new_isl_tokens
    )


def prepare_prefill_complete(request: Request) -> list[Any]:
    value = request.json()
    plain = write_bodies.request_ref(value)
    if plain is not None:
        return ["prefill_complete", *plain]
    body = parse(RequestRefBody, value)
    return _write("prefill_complete", body.scope(), body.request_id)


def prepare_free(request: Request) -> list[Any]:
    value = request.json()
    plain = write_bodies.request_ref(value)
    if plain is not None:
        return ["free", *plain]
    body = parse(RequestRefBody, value)
    return _write("free", body.scope(), body.request_id)


def write_route(service: SlotService, name: str, prepare: Callable[[Request], list[Any]], batches: Batched) -> Route:
    """A slot tracker write: alone, its handler calls the ``SlotService`` method its prepared item names; in
    a batch of commands, consecutive writes go to ``SlotService.apply_writes`` together."""

    async def write(service: SlotService, request: Request) -> Response:
        item = prepare(request)
        method = getattr(service, item[0])
        return done(await method(ScopeKey(item[1], item[2]), *item[3:]))

    batched = attrs.evolve(batches, prepare=prepare)
    return route(name, bound(service, write), pipelined=True, batched=batched)


def write_batches(service: SlotService) -> Batched:
    """``apply`` for the write routes: one ``apply_writes`` call, each outcome answered as its route would."""

    async def apply(writes: list[Any]) -> list[Response]:
        try:
            outcomes = await service.apply_writes(writes)
        except Exception as exc:  # the call as a whole failed (a front's link: overloaded, no reply in time)
            failed = failure_response(exc)
            return [failed] * len(writes)
        return [
            CREATED if outcome is True else OK if outcome is False else failure_response(decode_failure(outcome))
            for outcome in outcomes
        ]

    return Batched(prepare_add, apply)


async def workers(service: SlotService, request: Request) -> Response:
    rows = [
        {
            "worker_id": row.worker_id,
            **scope_fields(row.scope),
            "block_size": row.block_size,
            "dp_start": row.dp_start,
            "dp_size": row.dp_size,
        }
        for row in await service.workers(scope_filter(request))
    ]
    return json_response(200, rows)


def load_row(scope: ScopeKey, load: RankLoad) -> dict[str, Any]:
    """One ``GET /loads`` row (also what ``GET /ws/loads`` sends)."""
    return {
        **scope_fields(scope),
        "worker_id": load.rank.worker_id,
        "dp_rank": load.rank.dp_rank,
        "active_prefill_tokens": load.active_prefill_tokens,
        "active_decode_blocks": load.active_decode_blocks,
    }


async def loads(service: SlotService, request: Request) -> Response:
    rows = [
        load_row(scope_loads.scope, load)
        for scope_loads in await service.loads(scope_filter(request))
        for load in scope_loads.loads
    ]
    return json_response(200, rows)


async def potential_loads(service: SlotService, request: Request) -> Response:
    body = parse(PotentialLoadsBody, request.json())
    rows = [
        {
            "worker_id": p.rank.worker_id,
            "dp_rank": p.rank.dp_rank,
            "potential_prefill_tokens": p.potential_prefill_tokens,
            "potential_decode_blocks": p.potential_decode_blocks,
            "active_requests": p.active_requests,
        }
        for p in await service.potential_loads(body.scope(), body.sequence_hashes, body.new_isl_tokens)
    ]
    return json_response(200, rows)


async def cluster(service: SlotService, request: Request) -> Response:
    return json_response(200, await service.cluster())


async def health(service: SlotService, request: Request) -> Response:
    return Response(200, b"", None)


def slot_tracker_routes(service: SlotService) -> list[Route]:
    batches = write_batches(service)
    return [
        write_route(service, "register", prepare_register, batches),
        write_route(service, "unregister", prepare_unregister, batches),
        route("workers", bound(service, workers)),
        write_route(service, "add", prepare_add, batches),
        write_route(service, "prefill_complete", prepare_prefill_complete, batches),
        write_route(service, "free", prepare_free, batches),
        route("loads", bound(service, loads)),
        route("potential_loads", bound(service, potential_loads), body_type=PotentialLoadsBody),
        route("cluster", bound(service, cluster)),
        route("health", bound(service, health)),
    ]
