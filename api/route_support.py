"""What both services' route modules share: binding a handler to its service object, mapping the
service's failures to statuses, the scope query filter and the scope fields of responses."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from kvrouter.actors.core.decisions import Reason
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.mailbox import JournalUnavailable, ReplyTimeout
from kvrouter.actors.service_support import Refused, ScopeFilter
from kvrouter.api.http import Handler, Request, Response, error_response, json_response

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
        except Refused as refused:
            return error_response(REASON_STATUS[refused.reason], refused.message, RETRY_AFTER.get(refused.reason, ()))
        except ReplyTimeout as late:
            return json_response(504, {"error": str(late), "request_id": late.request_id})
        except JournalUnavailable as gone:
            return error_response(503, str(gone))

    return respond


def scope_filter(request: Request) -> ScopeFilter:
    """``model_name`` and ``tenant_id`` (alias ``routing_group``) query filters, combined with AND."""
    query = request.query(("model_name", "tenant_id", "routing_group"))
    return ScopeFilter(query.get("model_name"), query.get("tenant_id", query.get("routing_group")))


def scope_fields(scope: ScopeKey) -> dict[str, str]:
    # Both names, so clients of the seed (tenant_id) and of 1.6.1 (routing_group) read them.
    return {"model_name": scope.model_name, "tenant_id": scope.tenant_id, "routing_group": scope.tenant_id}
