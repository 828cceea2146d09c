"""The slot tracker's routes: each handler parses its body, calls ``SlotService``, renders the result.

Writes are durable before the service returns; reads have passed a read barrier (see
``actors/slot_service.py``). Failures are answered by ``api/route_support.bound``.
"""

from __future__ import annotations

from typing import Any

from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.queries import RankLoad
from kvrouter.actors.slot_service import SlotService
from kvrouter.api.http import CREATED, OK, Request, Response, Route, json_response
from kvrouter.api.route_support import bound, scope_fields, scope_filter
from kvrouter.api.schemas import AddBody, PotentialLoadsBody, RegisterBody, RequestRefBody, UnregisterBody, parse


def done(created: bool) -> Response:
    return CREATED if created else OK


async def register(service: SlotService, request: Request) -> Response:
    body = parse(RegisterBody, request.json())
    return done(await service.register(body.scope(), body.worker_id, body.block_size, body.dp_start, body.dp_size))


async def unregister(service: SlotService, request: Request) -> Response:
    body = parse(UnregisterBody, request.json())
    return done(await service.unregister(body.scope(), body.worker_id))


async def add(service: SlotService, request: Request) -> Response:
    body = parse(AddBody, request.json())
    created = await service.add(
        body.scope(), body.request_id, body.worker_id, body.dp_rank, body.sequence_hashes, body.new_isl_tokens
    )
    return done(created)


async def prefill_complete(service: SlotService, request: Request) -> Response:
    body = parse(RequestRefBody, request.json())
    return done(await service.prefill_complete(body.scope(), body.request_id))


async def free(service: SlotService, request: Request) -> Response:
    body = parse(RequestRefBody, request.json())
    return done(await service.free(body.scope(), body.request_id))


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


async def health(service: SlotService, request: Request) -> Response:
    return Response(200, b"", None)


def slot_tracker_routes(service: SlotService) -> list[Route]:
    return [
        Route("POST", "/register", bound(service, register), json_body=True, pipelined=True),
        Route("POST", "/unregister", bound(service, unregister), json_body=True, pipelined=True),
        Route("GET", "/workers", bound(service, workers)),
        Route("POST", "/add", bound(service, add), json_body=True, pipelined=True),
        Route("POST", "/prefill_complete", bound(service, prefill_complete), json_body=True, pipelined=True),
        Route("POST", "/free", bound(service, free), json_body=True, pipelined=True),
        Route("GET", "/loads", bound(service, loads)),
        Route("POST", "/potential_loads", bound(service, potential_loads), json_body=True),
        Route("GET", "/health", bound(service, health)),
    ]
