"""A cluster replica's check of the ``kvrouter-forwarded`` marker (``FORWARDED_HEADER``) on every route it serves.

The marker changes what a replica answers: a forwarded read of many scopes answers for this replica's scopes alone,
a forwarded write or ``POST /batch`` (``FORWARDED_BATCH``) is never forwarded again. So it is honoured only when
its value names another member of this replica's view (the sender's advertise URL, as ``Forwarder`` sends it),
waiting up to ``SENDER_WAIT_SECONDS`` for a member that just joined to show in the view. Any other value, from a
client that sent the header by mistake or a stale replica, is answered 400 ``{"error": ...}`` naming the header,
with ``FORWARD_REFUSED_HEADER``, which a sending replica turns into 503 "not applied" for its own client.
The marker is a guard against accidents, not an authentication: the members are listed by ``GET /cluster``, and
``--auth-token-file`` is what keeps strangers out.
"""

from __future__ import annotations

from typing import Any, Final

import attrs

from kvrouter.actors.cluster.marks import FORWARDED_BATCH
from kvrouter.actors.cluster.membership import Membership
from kvrouter.actors.core.ownership.forwarding import FORWARD_REFUSED_HEADER, forwarded_sender_problem
from kvrouter.api.http import Request, Response, Route, error_response

SENDER_WAIT_SECONDS: Final = 1.0
_REFUSED: Final = ((FORWARD_REFUSED_HEADER.encode(), b"1"),)


def checking_forwarded(routes: list[Route], membership: Membership) -> list[Route]:
    """The routes a replica serves over HTTP, each honouring the forwarded marker only from a member (and
    ``POST /batch`` marking the batches another replica forwarded): applied after ``POST /batch`` was made."""
    return [
        route
        if route.websocket is not None
        else attrs.evolve(route, handler=_checked(route.handler, membership, _is_batch(route)))
        for route in routes
    ]


def _is_batch(route: Route) -> bool:
    return route.operation is not None and route.operation.name == "batch"


def _checked(own: Any, membership: Membership, batch: bool) -> Any:
    async def handler(request: Request) -> Response:
        sender = request.forwarded_by
        if sender is None:
            return await own(request)
        problem = forwarded_sender_problem(sender, membership.me, membership.view.members)
        joined = problem is not None and sender != membership.me
        if joined and await membership.sees_member(sender, SENDER_WAIT_SECONDS):
            problem = None
        if problem is not None:
            return error_response(400, problem, _REFUSED)
        request = attrs.evolve(request, forwarded=True)
        if not batch:
            return await own(request)
        token = FORWARDED_BATCH.set(True)  # the tasks its commands run in inherit it
        try:
            return await own(request)
        finally:
            FORWARDED_BATCH.reset(token)

    return handler
