"""The selection service's routes on a cluster replica: how each reaches its scope (``SELECT_ROUTING``).

* a scope named in the body: a worker's record (``POST /workers``), a selection, a booking, a prompt's loads or
  overlap: sent to the scope's owner;
* a reservation or a worker id in the path (``/reservations/{id}/...``, ``PATCH``/``DELETE /workers/{id}``):
  answered by whichever member serves the scope holding it (a reservation booked through this replica: its
  scope's owner first, ``actors/cluster/booked_scopes.py``);
* ``GET /workers``, ``/loads``, ``/ready``, ``/dump``: gathered from every live member.

``GET /ws/loads`` follows the scopes served by the replica it is asked of; ``/ws/decisions`` is refused on a
replica (``not_in_a_cluster``).
"""

from __future__ import annotations

from typing import Any

from kvrouter.actors.core.ids import ScopeKey
from kvrouter.api.bodies.schemas import parse
from kvrouter.api.bodies.select_schemas import ReservationBody, WorkerBody, request_select_body
from kvrouter.api.http import Request, Response, Route, error_response, json_response
from kvrouter.api.routes.cluster import ClusterRouting, Gather
from kvrouter.api.routes.operations import route
from kvrouter.client.table import BY_NAME

NOT_IN_A_CLUSTER = "is not served by a replica of a cluster (select-service --cluster) yet: watch a single node"


def _worker_scope(request: Request) -> ScopeKey:
    return parse(WorkerBody, request.json()).to_record().scope


def _select_scope(request: Request) -> ScopeKey:
    return request_select_body(request).scope()


def _reservation_scope(request: Request) -> ScopeKey:
    return parse(ReservationBody, request.json()).scope()


def _scope_order(row: dict[str, Any]) -> tuple[Any, ...]:
    return row.get("model_name", ""), row.get("tenant_id", ""), row.get("worker_id", 0)


def _rows(answers: list[Any]) -> Response:
    return json_response(200, sorted((row for rows in answers for row in rows), key=_scope_order))


def _ready(answers: list[Any]) -> Response:
    workers = sorted((row for answer in answers for row in answer["workers"]), key=_scope_order)
    count = sum(int(answer["schedulable_workers"]) for answer in answers)
    body = {**answers[0], "ready": count > 0, "schedulable_workers": count, "workers": workers}
    return json_response(200 if count else 503, body)


def _dump(answers: list[Any]) -> Response:
    document: dict[str, Any] = {}
    for answer in answers:
        document.update(answer)
    return json_response(200, dict(sorted(document.items())))


SELECT_ROUTING = ClusterRouting(
    scoped={
        "put_worker": _worker_scope,
        "select": _select_scope,
        "select_and_reserve": _select_scope,
        "select_disaggregated": _select_scope,
        "potential_loads": _select_scope,
        "overlap_scores": _select_scope,
        "reserve": _reservation_scope,
    },
    gathered={
        "workers": Gather(_rows),
        "loads": Gather(_rows),
        "ready": Gather(_ready, (200, 503)),
        "dump": Gather(_dump),
    },
    located=frozenset({"patch_worker", "remove_worker", "reservation_prefill_complete", "output_block", "release"}),
    books=frozenset({"select_and_reserve", "select_disaggregated", "reserve"}),
    releases=frozenset({"release"}),
)


def not_in_a_cluster(name: str) -> Route:
    """Operation ``name``'s route, answering 501 ``{"error"}`` (and refusing its WebSocket upgrade alike)."""
    refusal = error_response(501, f"{BY_NAME[name].path} {NOT_IN_A_CLUSTER}")

    async def handler(request: Request) -> Response:
        return refusal

    async def websocket(scope: Any, receive: Any, send: Any, stopping: Any) -> None:
        if "websocket.http.response" not in scope.get("extensions", {}):
            await send({"type": "websocket.close"})
            return
        headers = [(b"content-length", str(len(refusal.body)).encode()), (b"content-type", b"application/json")]
        await send({"type": "websocket.http.response.start", "status": refusal.status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": refusal.body})

    return route(name, handler, websocket=websocket)
