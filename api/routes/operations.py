"""Routes from the operation table: a service binds a handler to each of its operations by name."""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from kvrouter.api.http import Batched, Handler, Route, WebSocketHandler
from kvrouter.client.table import BY_NAME, Body, served_by


def route(
    name: str,
    handler: Handler,
    *,
    websocket: WebSocketHandler | None = None,
    pipelined: bool = False,
    batched: Batched | None = None,
    body_type: type | None = None,
) -> Route:
    """The route serving operation ``name`` with ``handler``: method, path and body rules from the table.

    ``body_type``: the class the handler reads the body as, where the table names none (``Operation.request``:
    a body that is no single class, e.g. ``/potential_loads``, whose class differs per service)."""
    op = BY_NAME[name]
    if body_type is None and op.request is not None:
        body_type = body_class(op.request)
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
        body_type=body_type,
    )


def body_class(name: str) -> type:
    """The body class an operation names (``Operation.request``), from the modules that define them."""
    # Imported here: the schema modules import the HTTP types this module's callers build routes with.
    from kvrouter.api.bodies import schemas, select_schemas

    for module in (schemas, select_schemas):
        found = getattr(module, name, None)
        if isinstance(found, type) and attrs.has(found):
            return found
    raise LookupError(f"no body class {name!r} in api/bodies/schemas.py or api/bodies/select_schemas.py")


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
