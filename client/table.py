"""The operation table: every operation of kvrouter's API, defined once.

Plain data with no dependency beyond attrs: it lives with the client library (which must import without the
service's modules) and the services read the same table.

Each ``Operation`` names its method and path, which services serve it, how its body is read, the body class it
parses, what it answers, whether it writes (a write is durable under the service's ``--durability`` before it
is answered), whether it answers without the bearer token, and its one-line documentation. Everything that
offers the API derives from this table:

- the HTTP routes: a service binds a handler to each of its operations by name (``bind``), and the route's
  method, path and body rules come from the operation; a service that leaves one of its operations unbound,
  or binds a name the table lacks, fails at start-up;
- ``GET /openapi.json`` (``api/routes/openapi.py``) and the docs' API reference, generated from the bound routes;
- ``POST /batch`` and the command stream, which dispatch through the same routes; the stream's compact codes
  (``Operation.compact``) are the table's;
- the fronts' wire (the service objects' methods the routes call, forwarded as they are);
- the client library (``client/operations.py``: one method per operation, named as the operation) and the
  embedded router (``api/embedded.py``: the operations ``Operation.embedded`` names, under Dynamo's Python
  names), both checked against this table by tests.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import attrs

JSON = b"application/json"
TEXT = b"text/plain"

SLOT_TRACKER = "slot_tracker"
SELECT_SERVICE = "select_service"
FRONTEND = "frontend"  # the selection service's routes it serves beside its OpenAI ones
OPENAI = "openai"  # the frontend's OpenAI-compatible routes, answered by its proxy (api/frontend/app.py)


class Body(Enum):
    """How a route reads its request body."""

    NONE = "none"  # ignores any body, of any content type (as 1.6.1's routes without one)
    JSON = "json"  # requires a JSON content type and a body within the limit
    OPTIONAL = "optional"  # reads a body if one is sent (a JSON content type then required)
    IF_TYPED = "if_typed"  # reads a body only if it is typed as JSON; any other is left unread


class Kind(Enum):
    HTTP = "http"
    WEBSOCKET = "websocket"  # opened with an upgrade request (GET)


def ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def array_of(item: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": item}


STATUS = {200: ref("Status"), 201: ref("Status")}
SCOPE_QUERY = ("model_name", "tenant_id", "routing_group")


@attrs.frozen
class Compact:
    """A hot write's positional form in the command stream's compact format (``client/compact.py``)."""

    code: int
    fields: tuple[str, ...]


@attrs.frozen
class Operation:
    name: str  # unique; the client's method and the handler's key
    method: str
    path: str  # literal segments, or "{name}" for a path parameter
    summary: str
    served_by: frozenset[str]
    body: Body = Body.NONE
    request: str | None = None  # the name of the body class it parses (api/routes/openapi.py derives its JSON Schema)
    request_schema: dict[str, Any] | None = None  # a body that is no single class
    responses: dict[int, Any] = attrs.Factory(lambda: {200: {}})  # status -> schema (None: no body)
    query: tuple[str, ...] = ()
    writes: bool = False
    public: bool = False  # answered without the bearer token
    kind: Kind = Kind.HTTP
    content: bytes = JSON  # the success answer's media type
    compact: Compact | None = None
    embedded: str | None = None  # the embedded router's method (Dynamo's Python name), if it has one


def _slot(name: str, method: str, path: str, summary: str, **rest: Any) -> Operation:
    return Operation(name, method, path, summary, frozenset({SLOT_TRACKER}), **rest)


def _select(name: str, method: str, path: str, summary: str, *, frontend: bool = True, **rest: Any) -> Operation:
    services = {SELECT_SERVICE, FRONTEND} if frontend else {SELECT_SERVICE}
    return Operation(name, method, path, summary, frozenset(services), **rest)


def _openai(name: str, method: str, path: str, summary: str, **rest: Any) -> Operation:
    return Operation(name, method, path, summary, frozenset({OPENAI}), **rest)


_OPENAI_BODY = {"type": "object", "description": "An OpenAI request body; its prompt is tokenized and routed"}
_OPENAI_ANSWER = {"type": "object", "description": "The chosen worker's answer, relayed (SSE when stream is true)"}


def _both(name: str, method: str, path: str, summary: str, *, frontend: bool = False, **rest: Any) -> Operation:
    services = {SLOT_TRACKER, SELECT_SERVICE, FRONTEND} if frontend else {SLOT_TRACKER, SELECT_SERVICE}
    return Operation(name, method, path, summary, frozenset(services), **rest)


_ADD_FIELDS = ("model_name", "tenant_id", "request_id", "worker_id", "dp_rank", "sequence_hashes", "new_isl_tokens")
_REF_FIELDS = ("model_name", "tenant_id", "request_id")

OPERATIONS: tuple[Operation, ...] = (
    # -- the slot tracker
    _slot("register", "POST", "/register", "Register a worker's dp ranks in a scope", body=Body.JSON,
          request="RegisterBody", responses=STATUS, writes=True),
    _slot("unregister", "POST", "/unregister", "Unregister a worker", body=Body.JSON, request="UnregisterBody",
          responses=STATUS, writes=True),
    _slot("add", "POST", "/add", "Track a request on a rank", body=Body.JSON, request="AddBody", responses=STATUS,
          writes=True, compact=Compact(1, _ADD_FIELDS)),
    _slot("prefill_complete", "POST", "/prefill_complete", "A tracked request's prefill is done", body=Body.JSON,
          request="RequestRefBody", responses=STATUS, writes=True, compact=Compact(2, _REF_FIELDS)),
    _slot("free", "POST", "/free", "A tracked request is finished", body=Body.JSON, request="RequestRefBody",
          responses=STATUS, writes=True, compact=Compact(3, _REF_FIELDS)),

    # -- both services (same path; each answers in its own shape)
    _both("workers", "GET", "/workers",
          "The registered workers (slot tracker: dp ranges; selection service: catalog records)",
          responses={200: {"oneOf": [array_of(ref("RegisteredRange")), array_of(ref("Worker"))]}},
          query=SCOPE_QUERY, embedded="workers", frontend=True),
    _both("loads", "GET", "/loads",
          "Current load of every rank (slot tracker: rows; selection service: per partition)",
          responses={200: {"oneOf": [array_of(ref("RankLoad")), array_of(ref("PartitionLoads"))]}},
          query=SCOPE_QUERY, frontend=True),
    _both("potential_loads", "POST", "/potential_loads", "What each rank would carry with this prompt",
          body=Body.JSON,
          request_schema={"oneOf": [ref("PotentialLoadsBody"), ref("SelectBody")]},
          responses={200: array_of(ref("PotentialLoad"))}, embedded="get_potential_loads", frontend=True),
    _both("cluster", "GET", "/cluster",
          "This replica's cluster: its lease, the live members and each scope's owner (null outside a cluster)",
          responses={200: ref("ClusterView")}, frontend=True),
    _both("health", "GET", "/health", "Liveness (answers without the bearer token)", responses={200: None},
          public=True, frontend=True),
    # -- the selection service
    _select("put_worker", "POST", "/workers", "Create or replace a worker's catalog record", body=Body.JSON,
            request="WorkerBody", responses={201: ref("Worker")}, writes=True, embedded="register_worker"),
    _select("patch_worker", "PATCH", "/workers/{worker_id}",
            "Change some fields of a worker's record (null leaves a field as it is)", body=Body.JSON,
            request_schema={"type": "object", "description": "Any fields of WorkerBody"},
            responses={200: ref("Worker")}, writes=True),
    _select("remove_worker", "DELETE", "/workers/{worker_id}", "Remove a worker", responses={200: ref("Worker")},
            writes=True, embedded="unregister_worker"),
    _select("ready", "GET", "/ready", "Whether any worker is schedulable (503 if none)",
            responses={200: ref("Ready")}),
    _select("select", "POST", "/select", "Choose a worker for a prompt, book nothing", body=Body.JSON,
            request="SelectBody", responses={200: ref("Selection")}, embedded="best_worker"),
    _select("select_and_reserve", "POST", "/select_and_reserve", "Choose a worker and book the prompt on it",
            body=Body.JSON, request="SelectBody", responses={200: ref("Selection")}, writes=True,
            embedded="best_worker"),
    _select("select_disaggregated", "POST", "/select_disaggregated", "Choose and book a prefill and a decode worker",
            body=Body.JSON, request="SelectBody", responses={200: ref("DisaggregatedSelection")}, writes=True,
            embedded="select_disaggregated"),
    _select("reserve", "POST", "/reservations",
            "Book an earlier selection (selection_id) or an explicit rank", body=Body.JSON, request="ReservationBody",
            responses={201: ref("Booking")}, writes=True),
    _select("reservation_prefill_complete", "POST", "/reservations/{reservation_id}/prefill_complete",
            "The reservation's prefill is done; optionally with the engine's cached_tokens (a JSON body of another "
            "content type is ignored), compared with the router's prediction in GET /metrics",
            body=Body.IF_TYPED, request="PrefillCompleteBody", responses={200: ref("Status")}, writes=True,
            embedded="mark_prefill_complete"),
    _select("output_block", "POST", "/reservations/{reservation_id}/output_block",
            "One more output block, or every block weighted by decay_fraction", body=Body.JSON,
            request="OutputBlockBody", responses={200: ref("Status")}, writes=True, embedded="add_output_block"),
    _select("release", "DELETE", "/reservations/{reservation_id}", "Release a reservation",
            responses={200: ref("Status")}, writes=True, embedded="free"),
    _select("overlap_scores", "POST", "/overlap_scores", "Each worker's cached prefix of a prompt", body=Body.JSON,
            request="SelectBody", responses={200: ref("OverlapScores")}),
    _select("dump", "GET", "/dump", "Every scope's KV index in the standalone indexer's recovery format",
            responses={200: {"type": "object"}}, embedded="dump_events"),
    # -- replica sync (both services)
    _both("register_peer", "POST", "/replica_sync/register_peer", "Add a replica peer", body=Body.JSON,
          request="PeerBody", responses=STATUS),
    _both("deregister_peer", "POST", "/replica_sync/deregister_peer", "Remove a replica peer", body=Body.JSON,
          request="PeerBody", responses={200: ref("Status")}),
    _both("peers", "GET", "/replica_sync/peers", "The replica peers' endpoints", responses={200: array_of({})}),
    # -- commands (both services)
    _both("batch", "POST", "/batch",
          "Several requests in one: each answered as on its own route, in order (ordered=false: all at once)",
          body=Body.JSON, request_schema=array_of(ref("Command")), query=("ordered",),
          responses={200: array_of(ref("CommandResult"))}, frontend=True),
    _both("command_stream", "GET", "/ws/commands",
          "The command stream (WebSocket): batches of commands in, their answers out", responses={101: None},
          kind=Kind.WEBSOCKET, frontend=True),
    # -- live streams
    _both("watch_loads", "GET", "/ws/loads",
          "Live loads (WebSocket): a snapshot of every matching rank's load, then one message per change per scope",
          responses={101: None}, query=SCOPE_QUERY, kind=Kind.WEBSOCKET),
    _select("watch_decisions", "GET", "/ws/decisions",
            "Live decisions (WebSocket): one message per selection with its explanation", responses={101: None},
            query=SCOPE_QUERY, kind=Kind.WEBSOCKET, frontend=False),
    # -- about the service itself
    _both("metrics", "GET", "/metrics", "The service's figures in Prometheus's text format",
          responses={200: {"type": "string"}}, content=TEXT, frontend=True),
    _both("openapi", "GET", "/openapi.json", "This document", responses={200: {"type": "object"}}),
    # -- the frontend's own (kvrouter frontend): OpenAI-compatible, routed to a worker and relayed
    _openai("completions", "POST", "/v1/completions", "A completion from the worker the router chooses",
            body=Body.JSON, request_schema=_OPENAI_BODY, responses={200: _OPENAI_ANSWER}),
    _openai("chat_completions", "POST", "/v1/chat/completions",
            "A chat completion from the worker the router chooses", body=Body.JSON, request_schema=_OPENAI_BODY,
            responses={200: _OPENAI_ANSWER}),
    _openai("models", "GET", "/v1/models", "The models the frontend routes (those of its registered workers)",
            responses={200: {"type": "object"}}),
    _openai("frontend_stats", "GET", "/frontend/stats",
            "The frontend's request counters and each worker's circuit breaker", responses={200: {"type": "object"}}),
)  # fmt: skip

BY_NAME: dict[str, Operation] = {op.name: op for op in OPERATIONS}
assert len(BY_NAME) == len(OPERATIONS), "operation names are unique"
COMPACT: dict[int, Operation] = {op.compact.code: op for op in OPERATIONS if op.compact is not None}


def served_by(service: str) -> tuple[Operation, ...]:
    """The operations ``service`` serves, in table order."""
    return tuple(op for op in OPERATIONS if service in op.served_by)


def compact_code(name: str) -> int:
    """The command stream's compact code of operation ``name`` (a hot write)."""
    compact = BY_NAME[name].compact
    if compact is None:
        raise LookupError(f"operation {name!r} has no compact form")
    return compact.code
