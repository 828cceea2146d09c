"""In-process HTTP for tests that must force interleavings: ASGI calls on the app, no sockets, any clock.

``service_app`` composes a service exactly as ``api.main.run_service`` does (an ActorSystem, the service's
route builder, the raw ASGI app), but on a journal and clock the test controls; ``call`` sends one request
and returns (status, JSON body or None).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import orjson
import trio

from kvrouter.actors.ports import TrioClock
from kvrouter.actors.system import ActorSystem
from kvrouter.api.http.app import make_app
from kvrouter.api.process.main import ServiceOptions
from kvrouter.journal.memory import MemoryJournal

ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


@attrs.frozen
class Reply:
    status: int
    body: Any
    headers: dict[bytes, bytes]


async def call(
    app: ASGIApp,
    method: str,
    path: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
    content_type: bytes | None = None,
    query: bytes = b"",
) -> Reply:
    """One request through the ASGI app; ``body`` is sent as JSON, ``raw`` as is."""
    payload = raw if raw is not None else (orjson.dumps(body) if body is not None else b"")
    headers = []
    if content_type is not None:
        headers.append((b"content-type", content_type))
    elif body is not None:
        headers.append((b"content-type", b"application/json"))
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "headers": headers,
    }
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await trio.sleep_forever()
        sent = True
        return {"type": "http.request", "body": payload, "more_body": False}

    messages: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    await app(scope, receive, send)
    start, end = messages[0], messages[-1]
    content = end.get("body", b"")
    return Reply(start["status"], orjson.loads(content) if content else None, dict(start["headers"]))


async def service_app(
    nursery: trio.Nursery,
    build_routes: Any,
    journal: Any = None,
    *,
    options: ServiceOptions | None = None,
    reply_deadline: float | None = None,
) -> tuple[ASGIApp, ActorSystem]:
    """The service's ASGI app on ``journal`` (a MemoryJournal by default) under trio's clock."""
    journal = journal if journal is not None else MemoryJournal()
    await nursery.start(journal.run)
    extra = {} if reply_deadline is None else {"reply_deadline": reply_deadline}
    system = ActorSystem(journal, TrioClock(), encode_snapshots_in_thread=False, seed=7, **extra)
    await nursery.start(system.run)
    routes = await build_routes(options or ServiceOptions(), system, nursery)
    return make_app(routes, body_limit=8 * 1024 * 1024), system
