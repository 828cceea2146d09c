"""Routes from the operation table: a service binds a handler to each of its operations by name."""

from __future__ import annotations

from collections.abc import Iterable

from kvrouter.api.http import Batched, Handler, Route, WebSocketHandler
from kvrouter.client.table import BY_NAME, Body, served_by


def route(
    name: str,
    handler: Handler,
    *,
    websocket: WebSocketHandler | None = None,
    pipelined: bool = False,
    batched: Batched | None = None,
) -> Route:
    """The route serving operation ``name`` with ``handler``: method, path and body rules from the table."""
    op = BY_NAME[name]
    return Route(
        op.method,
        op.path,
        handler,
        json_body=op.body is Body.JSON,
        optional_body=op.body is Body.OPTIONAL,
        json_body_if_typed=op.body is Body.IF_TYPED,
        pipelined=pipelined,
        websocket=websocket,
        batched=batched,
        operation=op,
    )


class IncompleteService(Exception):
    """A service's routes do not serve exactly the operations the table says it serves (a bug: found at start-up
    and by the tests, never by a client)."""


def check_served(service: str, routes: Iterable[Route]) -> None:
    """Raise ``IncompleteService`` unless ``routes`` serve each of ``service``'s operations exactly once, and no
    route lacks its operation."""
    names = [r.operation.name if r.operation is not None else f"{r.method} {r.path}" for r in routes]
    wanted = {op.name for op in served_by(service)}
    missing = sorted(wanted - set(names))
    extra = sorted(set(names) - wanted)
    repeated = sorted({name for name in names if names.count(name) > 1})
    if missing or extra or repeated:
        raise IncompleteService(f"{service}: missing {missing}, not in the table {extra}, served twice {repeated}")
