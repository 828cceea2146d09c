"""GET /openapi.json: an OpenAPI 3.1 document that a maintained validator accepts, describing exactly the
routes each service serves (its route table), with the request schemas of the bodies the routes parse."""

from __future__ import annotations

from typing import Any

import httpx
from openapi_spec_validator import validate

from kvrouter.actors.peers.peer_service import PeerService
from kvrouter.api.process.main import ServiceObjects, select_service_routes_of, slot_tracker_routes_of

METHODS = {"get", "post", "put", "patch", "delete"}


def operations(document: dict[str, Any]) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, item in document["paths"].items() for method in item if method in METHODS}


class Unused:
    """A service object whose methods the routes only bind, never call, while the table is built."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def table(routes_of: Any) -> set[tuple[str, str]]:
    """The route table a service serves."""
    return {(route.method, route.path) for route in routes_of(ServiceObjects(Unused(), PeerService(None)))}


async def test_the_slot_trackers_document_is_valid_and_is_its_route_table(client: httpx.AsyncClient) -> None:
    document = (await client.get("/openapi.json")).json()
    validate(document)
    assert operations(document) == table(slot_tracker_routes_of)
    assert {"/add", "/metrics", "/openapi.json", "/batch", "/ws/commands"} <= set(document["paths"])
    assert "/select" not in document["paths"]  # the selection service's, not this one's


async def test_the_selection_services_document_is_valid_and_is_its_route_table(selector: httpx.AsyncClient) -> None:
    document = (await selector.get("/openapi.json")).json()
    validate(document)
    assert operations(document) == table(select_service_routes_of)
    schemas = document["components"]["schemas"]
    prefill = document["paths"]["/reservations/{reservation_id}/prefill_complete"]["post"]
    assert prefill["requestBody"]["required"] is False  # optional: 1.6.1 sends none
    assert prefill["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/PrefillCompleteBody"
    }
    assert schemas["PrefillCompleteBody"]["properties"]["cached_tokens"] == {
        "anyOf": [{"type": "integer"}, {"type": "null"}]
    }
    select = schemas["SelectBody"]
    assert select["properties"]["token_ids"]["anyOf"][0]["items"] == {
        "type": "integer",
        "minimum": 0,
        "maximum": 4294967295,
    }
    assert schemas["WorkerBody"]["required"] == ["worker_id"]
    assert document["paths"]["/health"]["get"]["security"] == []
