"""``GET /openapi.json``: an OpenAPI 3.1 description of every route the answering service serves.

Generated, never written by hand: the paths and methods are the service's routes (the same ``Route`` objects
the app serves), and everything said of each comes from the operation it serves (``client/table.py``): its
summary, query parameters, whether it writes or answers without the token, the JSON Schema of its body
(derived from the body class it parses: attrs, ``api/bodies/schemas.py`` and ``api/bodies/select_schemas.py``)
and what it answers.
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
from kvrouter.api.bodies.schemas import PotentialLoadsBody, SequenceHashes
from kvrouter.api.bodies.select_schemas import SelectBody, TokenIds
from kvrouter.api.bodies.wire import I64, U32, U64, USize
from kvrouter.api.http import Request, Response, Route
from kvrouter.api.routes.operations import body_class
from kvrouter.api.routes.operations import route as operation_route
from kvrouter.client.table import Body, Kind, array_of, ref

OPENAPI_PATH = "/openapi.json"

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


INT = {"type": "integer"}
STR = {"type": "string"}
SCOPE_FIELDS = {"model_name": STR, "tenant_id": STR, "routing_group": STR}
# Response components: what the handlers render (``api/routes/slot_tracker.py``, ``api/routes/selection.py``, ...).
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
    "ClusterView": {
        "type": "object",
        "description": "A cluster replica's view (--cluster); outside a cluster every field is null or empty.",
        "properties": {
            "cluster": {"type": ["string", "null"]},
            "member": {"type": ["string", "null"], "description": "this replica's advertise URL"},
            "lease": {
                "type": ["object", "null"],
                "properties": {
                    "id": STR,
                    "live": {"type": "boolean"},
                    "remaining_seconds": {"type": "number"},
                    "ttl_seconds": INT,
                },
            },
            "members": {"type": "array", "items": STR},
            "scopes": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "model_name": {"type": ["string", "null"]},
                        "tenant_id": {"type": ["string", "null"]},
                        "token": STR,
                        "owner": {"type": ["string", "null"]},
                        "owner_lease": {"type": ["string", "null"]},
                        "served_here": {"type": "boolean"},
                    },
                },
            },
            "revision": INT,
            "followers": {
                "type": "array",
                "description": "this replica's follower copies of scopes it does not own",
                "items": {
                    "type": "object",
                    "properties": {
                        "model_name": STR,
                        "tenant_id": STR,
                        "sequence": INT,
                        "lsn": INT,
                        "lag_seconds": {"type": ["number", "null"]},
                    },
                },
            },
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
        "schedulable; kv_listeners, kv_modes, kv_index, out_of_selection and tokenizer when they apply.",
        "properties": {
            "worker_id": INT,
            **SCOPE_FIELDS,
            "lifecycle": {"enum": ["schedulable", "incomplete", "unschedulable"]},
            "not_schedulable_reasons": array_of(STR),
            "kv_listeners": {"type": "object"},
            "kv_modes": {"type": "object"},
            "kv_index": {"type": "object"},
            "out_of_selection": {"type": "object"},
            "tokenizer": {"type": "object"},
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


_PARAM = re.compile(r"\{([^}]+)\}")
_PATH_PARAMS = {
    "worker_id": {"type": "string", "pattern": "^[0-9]+$", "description": "decimal u64"},
    "reservation_id": {"type": "string"},
}


def _operation(route: Route, components: dict[str, Any]) -> dict[str, Any]:
    op = route.operation
    if op is None:
        raise ValueError(f"{route.method} {route.path} serves no operation of the table (client/table.py)")
    operation: dict[str, Any] = {"operationId": op.name, "summary": op.summary}
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": _PATH_PARAMS.get(name, STR)}
        for name in _PARAM.findall(route.path)
    ]
    parameters += [{"name": name, "in": "query", "required": False, "schema": STR} for name in op.query]
    if parameters:
        operation["parameters"] = parameters
    takes_body = op.body is not Body.NONE
    if takes_body:
        schema: dict[str, Any] = {}
        if op.request is not None:
            schema = ref(class_schema(body_class(op.request), components))
        elif op.request_schema is not None:
            schema = op.request_schema
        operation["requestBody"] = {
            "required": op.body is Body.JSON,
            "content": {"application/json": {"schema": schema}},
        }
    responses: dict[str, Any] = {}
    for status, body in op.responses.items():
        answer: dict[str, Any] = {"description": _STATUS_TEXT.get(status, "answer")}
        if body is not None:
            answer["content"] = {op.content.decode(): {"schema": body}}
        responses[str(status)] = answer
    error = {"content": {"application/json": {"schema": ref("Error")}}}
    for status, text in _ERRORS.items():
        if takes_body or status not in (413, 415, 422):
            responses.setdefault(str(status), {"description": text, **error})
    operation["responses"] = responses
    if op.kind is Kind.WEBSOCKET:
        operation["description"] = "A WebSocket endpoint: open it with an upgrade request (GET)."
    if op.writes:
        operation["x-kvrouter-writes"] = True  # durable under --durability before it is answered
    if op.public:
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
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route, components)
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

    route = operation_route("openapi", document)
    return route
