"""What both services' route modules share: binding a handler to its service object, mapping the
service's failures to statuses, the scope query filter and the scope fields of responses."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from kvrouter.actors.core.decisions import Reason
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.mailbox import JournalUnavailable, OutcomeUnknown, Overloaded, ReplyTimeout
from kvrouter.actors.service_support import Refused, ScopeFilter
from kvrouter.api.http import Handler, Request, Response, error_response, json_response

log = logging.getLogger("kvrouter.api")

REASON_STATUS = {
    Reason.INVALID: 400,
    Reason.NOT_FOUND: 404,
    Reason.CONFLICT: 409,
    Reason.UNAVAILABLE: 503,
    Reason.OVERLOADED: 429,
}
# Overloaded (every eligible worker busy, or the queue full): the client should retry shortly.
RETRY_AFTER = {Reason.OVERLOADED: ((b"retry-after", b"1"),)}

Service = TypeVar("Service")


def bound(service: Service, handler: Callable[[Service, Request], Awaitable[Response]]) -> Handler:
    """``handler`` with its service object, answering the service's failures in the API's shape
    (``Overloaded`` is the app's: 503 with Retry-After)."""

    async def respond(request: Request) -> Response:
        try:
            return await handler(service, request)
        except (Refused, OutcomeUnknown, JournalUnavailable) as failure:
            return failure_response(failure)

    return respond


def failure_response(failure: Exception) -> Response:
    """What a route answers when its service call fails with ``failure`` (as ``bound`` and the app's
    ``call_route`` answer it), for a command of a batch whose failure came back as data."""
    if isinstance(failure, Refused):
        return error_response(REASON_STATUS[failure.reason], failure.message, RETRY_AFTER.get(failure.reason, ()))
    if isinstance(failure, ReplyTimeout):
        return json_response(504, {"error": str(failure), "request_id": failure.request_id})
    if isinstance(failure, OutcomeUnknown):
        return error_response(504, str(failure))
    if isinstance(failure, JournalUnavailable):
        return error_response(504 if failure.maybe_written else 503, str(failure))
    if isinstance(failure, Overloaded):
        return error_response(503, str(failure), ((b"retry-after", b"1"),))
    log.error("a batched service call failed: %s", failure, exc_info=failure)
    return error_response(500, "internal error")


def scope_filter(request: Request) -> ScopeFilter:
    """``model_name`` and ``tenant_id`` (alias ``routing_group``) query filters, combined with AND."""
    query = request.query(("model_name", "tenant_id", "routing_group"))
    return ScopeFilter(query.get("model_name"), query.get("tenant_id", query.get("routing_group")))


def scope_fields(scope: ScopeKey) -> dict[str, str]:
    # Both names, so clients of the seed (tenant_id) and of 1.6.1 (routing_group) read them.
    return {"model_name": scope.model_name, "tenant_id": scope.tenant_id, "routing_group": scope.tenant_id}
