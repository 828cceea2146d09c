"""The operation table drives every surface: each service serves exactly its operations (and refuses to start
otherwise), the OpenAPI document describes each by its table entry, the command stream's compact codes are the
table's, the client library has an entry for every operation, and the embedded router's faces have every one the
table gives an embedded name."""

from __future__ import annotations

import inspect
from typing import Any

import attrs
import pytest

from kvrouter.actors.peers.peer_service import PeerService
from kvrouter.api import embedded_thread
from kvrouter.api.embedded import Router
from kvrouter.api.frontend.service import frontend_service_routes
from kvrouter.api.process.main import ServiceObjects, select_service_routes_of, slot_tracker_routes_of
from kvrouter.api.routes.metrics import FrontMetrics
from kvrouter.api.routes.openapi import body_class, openapi_document
from kvrouter.api.routes.operations import IncompleteService, check_served
from kvrouter.client import live
from kvrouter.client.operations import Operations
from kvrouter.client.stream import StreamClient
from kvrouter.client.table import (
    BY_NAME,
    COMPACT,
    FRONTEND,
    OPENAI,
    OPERATIONS,
    SELECT_SERVICE,
    SLOT_TRACKER,
    Kind,
    served_by,
)

# Operations the client offers otherwise than as a method of ``Operations``, and why.
CLIENT_ELSEWHERE = {
    "batch": "the command stream the client speaks batches already; a batch inside it is refused",
    "command_stream": "the client is the command stream (StreamClient and its thread flavours)",
    "watch_loads": "kvrouter.client.live.watch(url, 'watch_loads')",
    "watch_decisions": "kvrouter.client.live.watch(url, 'watch_decisions')",
    "completions": "any OpenAI client, pointed at the frontend",
    "chat_completions": "any OpenAI client, pointed at the frontend",
    "models": "any OpenAI client, pointed at the frontend",
    "frontend_stats": "a plain GET: a counters document for operators, not an API call",
}


class Unused:
    """A service object whose methods the routes only bind, never call, while the routes are built."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def served(routes_of: Any) -> list[str]:
    routes = routes_of(ServiceObjects(Unused(), PeerService(None)))
    return [route.operation.name for route in routes]


@pytest.mark.parametrize(
    ("service", "routes_of"), [(SLOT_TRACKER, slot_tracker_routes_of), (SELECT_SERVICE, select_service_routes_of)]
)
def test_each_service_serves_exactly_its_operations(service: str, routes_of: Any) -> None:
    names = served(routes_of)
    assert sorted(names) == sorted(op.name for op in served_by(service))
    assert len(names) == len(set(names))


def test_the_frontend_serves_its_operations_of_the_selection_service() -> None:
    routes = frontend_service_routes(Unused(), FrontMetrics())  # type: ignore[arg-type]
    assert sorted(r.operation.name for r in routes if r.operation) == sorted(op.name for op in served_by(FRONTEND))


def test_the_frontend_answers_its_openai_operations_itself_and_the_mock_worker_the_same_paths() -> None:
    from kvrouter.api.frontend.app import OWN_ROUTES
    from kvrouter.api.mock_worker.openai_app import MockWorkerApp

    assert {op.path: op.method for op in served_by(OPENAI)} == OWN_ROUTES
    worker = MockWorkerApp.__new__(MockWorkerApp)
    MockWorkerApp.__init__(worker, None, None, "m")  # type: ignore[arg-type]
    for op in served_by(OPENAI):
        if op.name != "frontend_stats":  # the frontend's own counters
            assert op.method in worker.routes[op.path], op.name


def test_a_service_that_leaves_an_operation_unserved_does_not_start() -> None:
    routes = slot_tracker_routes_of(ServiceObjects(Unused(), PeerService(None)))
    without_free = [r for r in routes if r.operation is None or r.operation.name != "free"]
    with pytest.raises(IncompleteService, match=r"missing \['free'\]"):
        check_served(SLOT_TRACKER, without_free)
    with pytest.raises(IncompleteService, match="served twice"):
        check_served(SLOT_TRACKER, [*routes, routes[0]])


def test_each_route_takes_method_path_and_body_rules_from_its_operation() -> None:
    for routes_of in (slot_tracker_routes_of, select_service_routes_of):
        for route in routes_of(ServiceObjects(Unused(), PeerService(None))):
            op = route.operation
            assert (route.method, route.path) == (op.method, op.path)
            assert route.json_body == (op.body.value == "json")
            assert route.json_body_if_typed == (op.body.value == "if_typed")
            assert (route.websocket is not None) == (op.kind is Kind.WEBSOCKET)


def test_the_openapi_document_describes_each_operation_by_its_table_entry() -> None:
    routes = select_service_routes_of(ServiceObjects(Unused(), PeerService(None)))
    document = openapi_document(routes, "t", "0")
    described = {item["operationId"]: (method.upper(), path, item) for path, methods in document["paths"].items()
                 for method, item in methods.items()}  # fmt: skip
    assert set(described) == {op.name for op in served_by(SELECT_SERVICE)}
    for name, (method, path, item) in described.items():
        op = BY_NAME[name]
        assert (method, path, item["summary"]) == (op.method, op.path, op.summary)
        assert item.get("x-kvrouter-writes", False) == op.writes
        assert (item.get("security") == []) == op.public


def test_every_body_class_the_table_names_exists() -> None:
    for op in OPERATIONS:
        if op.request is not None:
            assert attrs.has(body_class(op.request)), op.name


def test_the_compact_codes_are_the_table_s_and_name_the_body_fields() -> None:
    from kvrouter.client import compact

    assert {code: op.path for code, op in COMPACT.items()} == compact.PATHS
    for code, op in COMPACT.items():
        assert op.compact is not None and op.request is not None
        fields = {field.name for field in attrs.fields(body_class(op.request))}
        assert set(op.compact.fields) <= fields | {"tenant_id"}, op.name
        assert compact.FIELDS[code] == op.compact.fields


def test_the_client_has_a_method_for_every_operation() -> None:
    for op in OPERATIONS:
        if op.name in CLIENT_ELSEWHERE:
            continue
        method = getattr(Operations, op.name, None)
        assert method is not None, f"client.operations.Operations has no {op.name}() for {op.method} {op.path}"
        doc = inspect.getdoc(method) or ""
        assert doc.startswith(f"``{op.method} {op.path.split('/{')[0]}"), (op.name, doc)
    assert set(CLIENT_ELSEWHERE) <= set(BY_NAME)
    assert issubclass(StreamClient, Operations)
    assert inspect.isasyncgenfunction(live.watch)


def test_the_embedded_router_and_its_faces_have_every_embedded_operation() -> None:
    embedded = {op.embedded for op in OPERATIONS if op.embedded is not None}
    assert embedded <= set(embedded_thread.ROUTER_METHODS)
    for name in embedded_thread.ROUTER_METHODS:
        method = getattr(Router, name)
        for face in (embedded_thread.BlockingRouter, embedded_thread.AsyncioRouter):
            generated = face.__dict__[name]
            assert inspect.signature(generated) == inspect.signature(method), (face.__name__, name)
            assert generated.__doc__ == method.__doc__
        assert inspect.iscoroutinefunction(embedded_thread.AsyncioRouter.__dict__[name])
