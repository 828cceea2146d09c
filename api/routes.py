"""THE route table of the slot tracker: each route turns a body into a command or a read.

Writes go through ``ActorSystem.ask`` (journaled, durable before the reply); reads look at actor
state between awaits and then pass a read barrier, so they never show a write the journal could
still lose.
"""

from __future__ import annotations

from collections.abc import Callable

from kvrouter.actors.core.commands import AddRequest, CompletePrefill, FreeRequest, RegisterWorker, UnregisterWorker
from kvrouter.actors.core.decide import no_tracker
from kvrouter.actors.core.decisions import Accepted, Decision, Reason
from kvrouter.actors.core.queries import loads, potential_loads
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.system import ActorSystem
from kvrouter.api.http import CREATED, OK, HttpError, Request, Response, Route, error_response, json_response
from kvrouter.api.schemas import (
    AddBody,
    PotentialLoadsBody,
    RegisterBody,
    RequestRefBody,
    UnregisterBody,
    parse,
)

REASON_STATUS = {Reason.INVALID: 400, Reason.NOT_FOUND: 404, Reason.CONFLICT: 409, Reason.UNAVAILABLE: 503}


def reply(decision: Decision) -> Response:
    if isinstance(decision, Accepted):
        return CREATED if decision.created else OK
    return error_response(REASON_STATUS[decision.reason], decision.message)


def scope_filter(request: Request) -> Callable[[ScopeState], bool]:
    """``model_name`` and ``tenant_id`` (alias ``routing_group``) filters, combined with AND."""
    query = request.query(("model_name", "tenant_id", "routing_group"))
    model = query.get("model_name")
    tenant = query.get("tenant_id", query.get("routing_group"))
    return lambda s: (model is None or s.scope.model_name == model) and (tenant is None or s.scope.tenant_id == tenant)


def scope_fields(state: ScopeState) -> dict[str, str]:
    # Both names, so clients of the seed (tenant_id) and of 1.6.1 (routing_group) read them.
    return {
        "model_name": state.scope.model_name,
        "tenant_id": state.scope.tenant_id,
        "routing_group": state.scope.tenant_id,
    }


def slot_tracker_routes(system: ActorSystem) -> list[Route]:
    now = system.clock.now_ns

    async def register(request: Request) -> Response:
        body = parse(RegisterBody, request.json())
        command = RegisterWorker(body.worker_id, body.block_size, body.dp_start, body.dp_size, at=now())
        return reply(await system.ask(body.scope(), command))

    async def unregister(request: Request) -> Response:
        body = parse(UnregisterBody, request.json())
        return reply(await system.ask(body.scope(), UnregisterWorker(body.worker_id, at=now())))

    async def add(request: Request) -> Response:
        body = parse(AddBody, request.json())
        command = AddRequest(
            body.request_id, body.worker_id, body.dp_rank, body.sequence_hashes, body.new_isl_tokens, at=now()
        )
        return reply(await system.ask(body.scope(), command))

    async def prefill_complete(request: Request) -> Response:
        body = parse(RequestRefBody, request.json())
        return reply(await system.ask(body.scope(), CompletePrefill(body.request_id, at=now())))

    async def free(request: Request) -> Response:
        body = parse(RequestRefBody, request.json())
        return reply(await system.ask(body.scope(), FreeRequest(body.request_id, at=now())))

    async def workers(request: Request) -> Response:
        wanted = scope_filter(request)
        rows = []
        for state in system.states():
            if wanted(state):
                fields = scope_fields(state)
                for worker_id, (start, size) in sorted(state.slots.workers.items()):
                    rows.append(
                        {
                            "worker_id": worker_id,
                            **fields,
                            "block_size": state.slots.block_size,
                            "dp_start": start,
                            "dp_size": size,
                        }
                    )
        await system.read_barrier()
        return json_response(200, rows)

    async def get_loads(request: Request) -> Response:
        wanted = scope_filter(request)
        rows = []
        for state in system.states():
            if wanted(state):
                fields = scope_fields(state)
                for load in loads(state):
                    rows.append(
                        {
                            **fields,
                            "worker_id": load.rank.worker_id,
                            "dp_rank": load.rank.dp_rank,
                            "active_prefill_tokens": load.active_prefill_tokens,
                            "active_decode_blocks": load.active_decode_blocks,
                        }
                    )
        await system.read_barrier()
        return json_response(200, rows)

    async def get_potential_loads(request: Request) -> Response:
        body = parse(PotentialLoadsBody, request.json())
        scope = body.scope()
        state = system.state(scope)
        if state is None:
            raise HttpError(404, no_tracker(ScopeState(scope)).message)
        rows = [
            {
                "worker_id": p.rank.worker_id,
                "dp_rank": p.rank.dp_rank,
                "potential_prefill_tokens": p.potential_prefill_tokens,
                "potential_decode_blocks": p.potential_decode_blocks,
                "active_requests": p.active_requests,
            }
            for p in potential_loads(state, body.sequence_hashes, body.new_isl_tokens)
        ]
        await system.read_barrier()
        return json_response(200, rows)

    async def health(request: Request) -> Response:
        return Response(200, b"", None)

    return [
        Route("POST", "/register", register, json_body=True),
        Route("POST", "/unregister", unregister, json_body=True),
        Route("GET", "/workers", workers),
        Route("POST", "/add", add, json_body=True),
        Route("POST", "/prefill_complete", prefill_complete, json_body=True),
        Route("POST", "/free", free, json_body=True),
        Route("GET", "/loads", get_loads),
        Route("POST", "/potential_loads", get_potential_loads, json_body=True),
        Route("GET", "/health", health),
    ]
