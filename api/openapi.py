"""``GET /openapi.json``: an OpenAPI 3.1 description of every route the answering service serves.

Generated, never written by hand: the paths and methods are the service's route table (the same ``Route``
objects the app serves), request bodies are JSON Schemas derived from the body classes the routes parse
(attrs, ``api/schemas.py`` and ``api/select_schemas.py``), and what each route answers comes from its row in
``ROUTE_DOCS`` (one per (method, path), like the fuzz suite's rows). A served route without a row is still
described, with a summary saying so, and a test fails until it has one.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Iterable
from typing import Any

import attrs
import orjson

from kvrouter.actors.core.ids import I64_MAX, I64_MIN, U32_MAX, U64_MASK
from kvrouter.api.http import JSON, Request, Response, Route
from kvrouter.api.replica_routes import PeerBody
from kvrouter.api.schemas import (
    AddBody,
    PotentialLoadsBody,
    RegisterBody,
    RequestRefBody,
    SequenceHashes,
    UnregisterBody,
)
from kvrouter.api.select_schemas import (
    OutputBlockBody,
    PrefillCompleteBody,
    ReservationBody,
    SelectBody,
    TokenIds,
    WorkerBody,
)
from kvrouter.api.wire import I64, U32, U64, USize

OPENAPI_PATH = "/openapi.json"
UNDOCUMENTED = "undocumented route (add its row to api/openapi.py ROUTE_DOCS)"

# -- JSON Schemas of the body classes -----------------------------------------------------------------------

_INTEGERS: dict[Any, dict[str, Any]] = {
    U64: {"type": "integer", "minimum": 0, "maximum": U64_MASK},
    U32: {"type": "integer", "minimum": 0, "maximum": U32_MAX},
    USize: {"type": "integer", "minimum": 0, "maximum": U64_MASK},
    I64: {"type": "integer", "minimum": I64_MIN, "maximum": I64_MAX},
    SequenceHashes: {"type": "array", "items": {"type": "integer", "minimum": I64_MIN, "maximum": I64_MAX}},
    TokenIds: {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": U32_MAX}},
}
_PLAIN = {str: {"type": "string"}, int: {"type": "integer"}, float: {"type": "number"}, bool: {"type": "boolean"}}


def type_schema(kind: Any, components: dict[str, Any]) -> dict[str, Any]:
    """The JSON Schema of an annotation (attrs classes become components and are referenced)."""
    if kind in _INTEGERS:
        return dict(_INTEGERS[kind])
    if kind in _PLAIN:
        return dict(_PLAIN[kind])
    if kind is Any or kind is object:
        return {}
    if attrs.has(kind):
        return {"$ref": f"#/components/schemas/{class_schema(kind, components)}"}
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (types.UnionType, typing.Union):
        options = [type_schema(arg, components) for arg in args if arg is not type(None)]
        nullable = type(None) in args
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        if nullable:
            return {"anyOf": [schema, {"type": "null"}]}
        return schema
    if origin in (list, tuple, frozenset, set):
        return {"type": "array", "items": type_schema(args[0], components) if args else {}}
    if origin is dict:
        return {"type": "object", "additionalProperties": type_schema(args[1], components) if args else {}}
    if origin is typing.Literal:
        return {"enum": list(args)}
    raise TypeError(f"no JSON Schema for {kind!r}")


def class_schema(cls: type, components: dict[str, Any]) -> str:
    """Add ``cls``'s schema to ``components`` (once) and return its name. Fields without a default are
    required; a field whose type admits None may be sent as null. Unknown fields are ignored by the service."""
    name = cls.__name__
    if name in components:
        return name
    components[name] = {}  # reserved first: a class may refer to itself
    hints = typing.get_type_hints(cls)
    properties: dict[str, Any] = {}
    required = []
    for field in attrs.fields(cls):
        if field.name.startswith("_"):
            continue
        properties[field.name] = type_schema(hints[field.name], components)
        if field.default is attrs.NOTHING:
            required.append(field.name)
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    if cls.__doc__:
        schema["description"] = " ".join(cls.__doc__.split())
    components[name] = schema
    return name


# -- what each route answers ---------------------------------------------------------------------------------


def ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def array_of(item: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": item}


INT = {"type": "integer"}
STR = {"type": "string"}
SCOPE_FIELDS = {"model_name": STR, "tenant_id": STR, "routing_group": STR}
# Response components: what the handlers render (``api/routes.py``, ``api/select_routes.py``, ...).
RESPONSES: dict[str, Any] = {
    "Error": {"type": "object", "properties": {"error": STR}, "required": ["error"]},
    "Status": {"type": "object", "properties": {"status": {"const": "ok"}}, "required": ["status"]},
    "RegisteredRange": {
        "type": "object",
        "properties": {
            "worker_id": INT,
            **SCOPE_FIELDS,
            "block_size": {"type": ["integer", "null"]},
            "dp_start": INT,
            "dp_size": INT,
        },
    },
    "RankLoad": {
        "type": "object",
        "properties": {
            **SCOPE_FIELDS,
            "worker_id": INT,
            "dp_rank": INT,
            "active_prefill_tokens": INT,
            "active_decode_blocks": INT,
        },
    },
    "PotentialLoad": {
        "type": "object",
        "properties": {
            "worker_id": INT,
            "dp_rank": INT,
            "potential_prefill_tokens": INT,
            "potential_decode_blocks": INT,
            "active_requests": INT,
        },
    },
    "Worker": {
        "type": "object",
        "description": "A catalog record as sent, with its lifecycle (schedulable or incomplete) and why not "
        "schedulable; kv_listeners, kv_modes and kv_index when they apply.",
        "properties": {
            "worker_id": INT,
            **SCOPE_FIELDS,
            "lifecycle": {"enum": ["schedulable", "incomplete", "unschedulable"]},
            "not_schedulable_reasons": array_of(STR),
            "kv_listeners": {"type": "object"},
            "kv_modes": {"type": "object"},
            "kv_index": {"type": "object"},
        },
        "additionalProperties": True,
    },
    "Ready": {
        "type": "object",
        "properties": {"ready": {"type": "boolean"}, "schedulable_workers": INT, "workers": array_of(ref("Worker"))},
    },
    "Overlap": {
        "type": "object",
        "description": "Cached prompt tokens on the chosen worker per tier, cumulative (gpu <= cpu <= disk), "
        "and the gpu tokens per dp rank.",
        "properties": {
            "longest_matched": INT,
            "gpu": INT,
            "cpu": INT,
            "disk": INT,
            "dp": {"type": "object", "additionalProperties": INT},
        },
    },
    "Selection": {
        "type": "object",
        "properties": {
            "selection_id": STR,
            "reservation_id": STR,
            "sequence_hashes": array_of(INT),
            "isl_tokens": INT,
            "track_prefill_tokens": {"type": "boolean"},
            **SCOPE_FIELDS,
            "worker_id": INT,
            "dp_rank": INT,
            "endpoint": {"type": ["string", "null"]},
            "block_size": INT,
            "overlap": ref("Overlap"),
            "effective_prefill_tokens": INT,
            "potential_decode_blocks": INT,
        },
        "required": ["worker_id", "dp_rank", "block_size", "overlap", "effective_prefill_tokens"],
    },
    "DisaggregatedSelection": {
        "type": "object",
        "properties": {
            "reservation_id": STR,
            **SCOPE_FIELDS,
            "mode": {"enum": ["disaggregated", "decode_only"]},
            "block_size": INT,
            "isl_tokens": INT,
            "sequence_hashes": array_of(INT),
            "prefill": {"anyOf": [{"type": "object"}, {"type": "null"}]},
            "decode": {"type": "object"},
            "decode_constraints": {"type": "object"},
            "fallback_reason": STR,
        },
    },
    "Booking": {
        "type": "object",
        "properties": {
            "selection_id": STR,
            "reservation_id": STR,
            **SCOPE_FIELDS,
            "worker_id": {"type": ["integer", "null"]},
            "dp_rank": {"type": ["integer", "null"]},
            "endpoint": {"type": ["string", "null"]},
        },
    },
    "PartitionLoads": {
        "type": "object",
        "properties": {
            **SCOPE_FIELDS,
            "loads": array_of(ref("PotentialLoad")),
            "pending_count": INT,
            "pending_isl_tokens": INT,
        },
    },
    "OverlapScores": {
        "type": "object",
        "properties": {
            "block_size": INT,
            "num_blocks": INT,
            "workers": array_of({"type": "object"}),
            "shared_cache": {},
        },
    },
    "Command": {
        "type": "object",
        "description": "One request of a batch: a route's method and path (with its query), and its JSON body.",
        "properties": {"method": STR, "path": STR, "body": {}},
        "required": ["method", "path"],
    },
    "CommandResult": {
        "type": "object",
        "description": "A command's answer, exactly as the same request on its own route.",
        "properties": {"status": INT, "body": {}},
    },
}


@attrs.frozen
class RouteDoc:
    summary: str
    request: type | None = None  # the body class it parses
    request_schema: dict[str, Any] | None = None  # a body that is no class (a batch is an array)
    responses: dict[int, Any] = attrs.Factory(dict)  # status -> schema (None: no body)
    query: tuple[str, ...] = ()
    content: bytes = JSON  # the success response's media type


SCOPE_QUERY = ("model_name", "tenant_id", "routing_group")
STATUS = {200: ref("Status"), 201: ref("Status")}
TEXT = b"text/plain"

ROUTE_DOCS: dict[tuple[str, str], RouteDoc] = {
    # -- the slot tracker
    ("POST", "/register"): RouteDoc("Register a worker's dp ranks in a scope", RegisterBody, responses=STATUS),
    ("POST", "/unregister"): RouteDoc("Unregister a worker", UnregisterBody, responses=STATUS),
    ("GET", "/workers"): RouteDoc(
        "The registered workers (slot tracker: dp ranges; selection service: catalog records)",
        responses={200: {"oneOf": [array_of(ref("RegisteredRange")), array_of(ref("Worker"))]}},
        query=SCOPE_QUERY,
    ),
    ("POST", "/add"): RouteDoc("Track a request on a rank", AddBody, responses=STATUS),
    ("POST", "/prefill_complete"): RouteDoc("A tracked request's prefill is done", RequestRefBody, responses=STATUS),
    ("POST", "/free"): RouteDoc("A tracked request is finished", RequestRefBody, responses=STATUS),
    ("GET", "/loads"): RouteDoc(
        "Current load of every rank (slot tracker: rows; selection service: per partition)",
        responses={200: {"oneOf": [array_of(ref("RankLoad")), array_of(ref("PartitionLoads"))]}},
        query=SCOPE_QUERY,
    ),
    ("POST", "/potential_loads"): RouteDoc(
        "What each rank would carry with this prompt",
        request_schema={"oneOf": [{"$ref": "#/components/schemas/PotentialLoadsBody"}, ref("SelectBody")]},
        responses={200: array_of(ref("PotentialLoad"))},
    ),
    ("GET", "/health"): RouteDoc("Liveness (answers without the bearer token)", responses={200: None}),
    # -- the selection service
    ("POST", "/workers"): RouteDoc(
        "Create or replace a worker's catalog record", WorkerBody, responses={201: ref("Worker")}
    ),
    ("PATCH", "/workers/{worker_id}"): RouteDoc(
        "Change some fields of a worker's record (null leaves a field as it is)",
        request_schema={"type": "object", "description": "Any fields of WorkerBody"},
        responses={200: ref("Worker")},
    ),
    ("DELETE", "/workers/{worker_id}"): RouteDoc("Remove a worker", responses={200: ref("Worker")}),
    ("GET", "/ready"): RouteDoc("Whether any worker is schedulable (503 if none)", responses={200: ref("Ready")}),
    ("POST", "/select"): RouteDoc(
        "Choose a worker for a prompt, book nothing", SelectBody, responses={200: ref("Selection")}
    ),
    ("POST", "/select_and_reserve"): RouteDoc(
        "Choose a worker and book the prompt on it", SelectBody, responses={200: ref("Selection")}
    ),
    ("POST", "/select_disaggregated"): RouteDoc(
        "Choose and book a prefill and a decode worker", SelectBody, responses={200: ref("DisaggregatedSelection")}
    ),
    ("POST", "/reservations"): RouteDoc(
        "Book an earlier selection (selection_id) or an explicit rank", ReservationBody, responses={201: ref("Booking")}
    ),
    ("POST", "/reservations/{reservation_id}/prefill_complete"): RouteDoc(
        "The reservation's prefill is done; optionally with the engine's cached_tokens (a JSON body of another "
        "content type is ignored), compared with the router's prediction in GET /metrics",
        PrefillCompleteBody,
        responses={200: ref("Status")},
    ),
    ("POST", "/reservations/{reservation_id}/output_block"): RouteDoc(
        "One more output block, or every block weighted by decay_fraction",
        OutputBlockBody,
        responses={200: ref("Status")},
    ),
    ("DELETE", "/reservations/{reservation_id}"): RouteDoc("Release a reservation", responses={200: ref("Status")}),
    ("POST", "/overlap_scores"): RouteDoc(
        "Each worker's cached prefix of a prompt", SelectBody, responses={200: ref("OverlapScores")}
    ),
    ("GET", "/dump"): RouteDoc(
        "Every scope's KV index in the standalone indexer's recovery format", responses={200: {"type": "object"}}
    ),
    # -- replica sync (both services)
    ("POST", "/replica_sync/register_peer"): RouteDoc("Add a replica peer", PeerBody, responses=STATUS),
    ("POST", "/replica_sync/deregister_peer"): RouteDoc(
        "Remove a replica peer", PeerBody, responses={200: ref("Status")}
    ),
    ("GET", "/replica_sync/peers"): RouteDoc("The replica peers' endpoints", responses={200: array_of(STR)}),
    # -- commands (both services)
    ("POST", "/batch"): RouteDoc(
        "Several requests in one: each answered as on its own route, in order",
        request_schema=array_of(ref("Command")),
        responses={200: array_of(ref("CommandResult"))},
    ),
    ("GET", "/ws/commands"): RouteDoc(
        "The command stream (WebSocket): batches of commands in, their answers out", responses={101: None}
    ),
    ("GET", "/ws/loads"): RouteDoc(
        "Live loads (WebSocket): a snapshot of every matching rank's load, then one message per change per scope",
        responses={101: None},
        query=SCOPE_QUERY,
    ),
    ("GET", "/ws/decisions"): RouteDoc(
        "Live decisions (WebSocket, selection service): one message per selection with its explanation",
        responses={101: None},
        query=SCOPE_QUERY,
    ),
    # -- about the service itself
    ("GET", "/metrics"): RouteDoc(
        "The service's figures in Prometheus's text format", responses={200: {"type": "string"}}, content=TEXT
    ),
    ("GET", OPENAPI_PATH): RouteDoc("This document", responses={200: {"type": "object"}}),
}

_PARAM = re.compile(r"\{([^}]+)\}")
_PATH_PARAMS = {
    "worker_id": {"type": "string", "pattern": "^[0-9]+$", "description": "decimal u64"},
    "reservation_id": {"type": "string"},
}


def _operation_id(method: str, path: str) -> str:
    words = re.sub(r"[^A-Za-z0-9]+", "_", path).strip("_") or "root"
    return f"{method.lower()}_{words}"


def _operation(route: Route, doc: RouteDoc | None, components: dict[str, Any]) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "operationId": _operation_id(route.method, route.path),
        "summary": doc.summary if doc is not None else UNDOCUMENTED,
    }
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": _PATH_PARAMS.get(name, STR)}
        for name in _PARAM.findall(route.path)
    ]
    parameters += [
        {"name": name, "in": "query", "required": False, "schema": STR} for name in (doc.query if doc else ())
    ]
    if parameters:
        operation["parameters"] = parameters
    takes_body = route.json_body or route.optional_body or route.json_body_if_typed
    if takes_body:
        schema: dict[str, Any] = {}
        if doc is not None and doc.request is not None:
            schema = ref(class_schema(doc.request, components))
        elif doc is not None and doc.request_schema is not None:
            schema = doc.request_schema
        operation["requestBody"] = {"required": route.json_body, "content": {"application/json": {"schema": schema}}}
    responses: dict[str, Any] = {}
    for status, body in (doc.responses if doc is not None else {200: {}}).items():
        answer: dict[str, Any] = {"description": _STATUS_TEXT.get(status, "answer")}
        if body is not None:
            media = (doc.content if doc is not None else JSON).decode()
            answer["content"] = {media: {"schema": body}}
        responses[str(status)] = answer
    error = {"content": {"application/json": {"schema": ref("Error")}}}
    for status, text in _ERRORS.items():
        if takes_body or status not in (413, 415, 422):
            responses.setdefault(str(status), {"description": text, **error})
    operation["responses"] = responses
    if route.websocket is not None:
        operation["description"] = "A WebSocket endpoint: open it with an upgrade request (GET)."
    if route.path == "/health":
        operation["security"] = []
    return operation


_STATUS_TEXT = {200: "OK", 201: "Created", 101: "Switching Protocols (WebSocket)"}
_ERRORS = {
    400: "Bad request",
    401: "Bearer token missing or wrong (when the service has one)",
    404: "Not found",
    409: "Conflict",
    413: "Body too large",
    415: "Body not JSON",
    422: "Body does not match the schema",
    429: "Every eligible worker busy, or the queue full (Retry-After)",
    503: "Overloaded or unavailable",
    504: "No durable decision within the reply deadline",
}


def openapi_document(routes: Iterable[Route], title: str, version: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``routes`` (a service's whole table)."""
    components: dict[str, Any] = dict(RESPONSES)
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        doc = ROUTE_DOCS.get((route.method, route.path))
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route, doc, components)
    for body in (PotentialLoadsBody, SelectBody):  # referenced by hand above
        class_schema(body, components)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": title,
            "version": version,
            "description": "Generated from the service's route table; see the README.",
        },
        "paths": dict(sorted(paths.items())),
        "components": {
            "schemas": dict(sorted(components.items())),
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "Required by every route but GET /health when the service runs with "
                    "--auth-token-file",
                }
            },
        },
        "security": [{"bearer": []}, {}],
    }


def openapi_route(routes: list[Route], title: str, version: str) -> Route:
    """``GET /openapi.json`` describing ``routes`` and itself (rendered once: the table does not change)."""
    rendered: list[bytes] = []

    async def document(request: Request) -> Response:
        if not rendered:
            rendered.append(orjson.dumps(openapi_document([*routes, route], title, version)))
        return Response(200, rendered[0])

    route = Route("GET", OPENAPI_PATH, document)
    return route
