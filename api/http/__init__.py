"""Minimal request/response types for the raw ASGI app: no framework, one body send per response."""

from __future__ import annotations

import traceback
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

import attrs
import orjson

from kvrouter.api.http.json_keys import RepeatedKeys, find_repeated, repeated_field

if TYPE_CHECKING:
    from kvrouter.client.table import Operation

JSON = b"application/json"
UNPARSED: Any = object()  # Request.parsed when the body is only bytes


@attrs.frozen
class Response:
    status: int
    body: bytes = b""
    content_type: bytes | None = JSON
    headers: tuple[tuple[bytes, bytes], ...] = ()


class HttpError(Exception):
    """Raised anywhere below a handler; the app turns it into ``{"error": message}``."""

    def __init__(
        self, status: int, message: str, headers: tuple[tuple[bytes, bytes], ...] = (), *, plain: bool = False
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers
        self.plain = plain  # a text/plain body instead of {"error": ...} (axum's query rejection)


@attrs.frozen
class Request:
    method: str
    path: str
    query_string: bytes
    body: bytes
    path_params: dict[str, str] = attrs.Factory(dict)
    # A body already parsed as JSON (a command of a batch): ``json()`` returns it as it is.
    parsed: Any = attrs.field(default=UNPARSED, repr=False)
    # The route's body class (``Route.body_type``): a repeated field of it is refused, as 1.6.1's serde does.
    body_type: Any = attrs.field(default=None, repr=False)
    # With ``parsed``: the keys its document repeated (found where the batch or message was read), if any.
    repeated: RepeatedKeys | None = attrs.field(default=None, repr=False)
    # Sent on by another replica of a cluster to this scope's owner (``FORWARDED_HEADER``, checked by
    # ``api/routes/forwarded.py``, which sets it): never forwarded again.
    forwarded: bool = False
    # ``FORWARDED_HEADER`` as the request carried it (the sender's advertise URL), unchecked; None without it.
    forwarded_by: str | None = None

    def query(self, known: tuple[str, ...]) -> dict[str, str]:
        """The ``known`` query parameters; others are ignored, a repeated known one is a 400."""
        found: dict[str, str] = {}
        for name, value in parse_qsl(self.query_string.decode("latin-1"), keep_blank_values=True):
            if name in known:
                if name in found:
                    raise HttpError(400, f"Failed to deserialize query string: duplicate field `{name}`", plain=True)
                found[name] = value
        return found

    def json(self) -> Any:
        """The body as JSON; 400 if it is not JSON, 422 if it repeats a field of the route's body class."""
        if self.parsed is not UNPARSED:
            if self.repeated is not None and self.body_type is not None:
                refuse_repeated(self.body_type, self.repeated)
            return self.parsed
        if not self.body.strip():
            raise HttpError(400, "Failed to parse the request body as JSON: EOF while parsing a value")
        try:
            value = orjson.loads(self.body)
        except orjson.JSONDecodeError as exc:
            raise HttpError(400, f"Failed to parse the request body as JSON: {exc}") from None
        if self.body_type is not None:
            repeated = find_repeated(self.body, value)
            if repeated is not None:
                refuse_repeated(self.body_type, repeated)
        return value


def refuse_repeated(body_type: type, repeated: RepeatedKeys) -> None:
    """Raise 422 with serde's words if ``repeated`` holds a field of ``body_type`` (or of a struct within it)."""
    problem = repeated_field(body_type, repeated)
    if problem is not None:
        raise HttpError(422, f"Failed to deserialize the JSON body into the target type: {problem}")


def release(exc: BaseException) -> None:
    """Free at once what a handled exception keeps alive: the locals of the frames it passed through.

    A rejected body's bytes and parsed JSON sit in the frames of the code that rejected it, and an
    exception caught and re-raised there refers to itself through them (exception -> traceback -> frame
    -> exception): a cycle only the cyclic GC frees, which runs seldom here (``gc.freeze``, high
    thresholds), so rejected 8 MiB bodies piled up to gigabytes. Clearing the frames along the whole
    cause/context chain breaks every such cycle. Call it where ``exc`` was caught: the frames it passed
    through have finished (the catching frame is still running and is left alone).
    """
    pending = [exc]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if current.__traceback__ is not None:
            traceback.clear_frames(current.__traceback__)
            current.__traceback__ = None
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)


def json_response(status: int, value: Any) -> Response:
    return Response(status, orjson.dumps(value))


def error_response(status: int, message: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> Response:
    return Response(status, orjson.dumps({"error": message}), JSON, headers)


OK_BODY = orjson.dumps({"status": "ok"})
OK = Response(200, OK_BODY)
CREATED = Response(201, OK_BODY)

Handler = Callable[[Request], Awaitable[Response]]
# (ASGI scope, receive, send, stopping): ``stopping`` is a ``trio.Event`` set when the service starts to
# stop (or None), so a long-lived connection can finish what is in flight and close rather than hold
# the shutdown for its whole grace period.
WebSocketHandler = Callable[[dict[str, Any], Any, Any, Any], Awaitable[None]]


@attrs.frozen
class Route:
    method: str
    path: str  # literal segments, or "{name}" for a path parameter
    handler: Handler
    json_body: bool = False  # requires a JSON content type and a body within the limit
    optional_body: bool = False  # reads a body if one is sent (JSON content type then required)
    # Reads a body only if it is typed as JSON; any other body is left unread, as routes without one do (a
    # kvrouter extension on a reference route that ignores bodies: the reference's behaviour stays).
    json_body_if_typed: bool = False
    # Its handler puts its one command into its scope's mailbox before its first wait and reads no state
    # before that: a batch may start the next command as soon as this one waits (``api/streams/command_runner.py``).
    pipelined: bool = False
    # A WebSocket endpoint: the app hands an authorised upgrade of this path to this handler.
    websocket: WebSocketHandler | None = None
    # A pipelined route whose commands a batch may run many at a time (``api/streams/command_runner.py``).
    batched: Batched | None = None
    # The operation it serves (``client/table.py``): its documentation, whether it writes, its name.
    operation: Operation | None = None
    # The attrs class its JSON body is read as: a repeated field of it (or of a struct within it) is refused.
    body_type: Any = None


@attrs.frozen
class Batched:
    """How many commands of a pipelined route run as one service call, each answered as its own request.

    ``prepare(request)`` parses and validates the request exactly as the route's handler does (raising the
    same ``HttpError``) and returns it as plain data; ``apply(prepared)`` runs a list of them in order (as if
    each were submitted after the one before it) and returns each one's response. Consecutive commands of
    routes with the same ``apply`` share one call."""

    prepare: Callable[[Request], Any]
    apply: Callable[[list[Any]], Awaitable[list[Response]]]
