"""api/select_body_reader against orjson, and the routes' body (``request_select_body``) against ``select_body``
of orjson's value: whatever the reader answers is what orjson reads (token ids packed as u32s), and a route
reads every body, of the common shape or not, exactly as before: the same ``SelectBody`` or the same 4xx."""

from __future__ import annotations

import random
from array import array
from typing import Any

import attrs
import orjson
import pytest
from hypothesis import HealthCheck, given, settings

from kvrouter.actors.core.ids import U32_MAX
from kvrouter.api.bodies import select_body_reader
from kvrouter.api.bodies.select_schemas import SelectBody, request_select_body, select_body
from kvrouter.api.http import HttpError, Request
from kvrouter.compiled import load_pure
from tests.support.select_body_bytes import body_bytes

PURE = load_pure("kvrouter.api.bodies.select_body_reader", "kvrouter_pure_reader.select_body_reader")
READERS = [pytest.param(select_body_reader, id="running"), pytest.param(PURE, id="pure")]


def as_orjson(fields: dict[str, Any]) -> dict[str, Any]:
    """The reader's fields as orjson gives them (token ids as a list)."""
    assert type(fields) is dict
    tokens = fields.get("token_ids")
    if type(tokens) is array:
        assert tokens.typecode == "I"
        return {**fields, "token_ids": tokens.tolist()}
    return fields


def loaded(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return "invalid JSON"


@pytest.mark.parametrize("reader", READERS)
@settings(max_examples=700, deadline=None)
@given(data=body_bytes())
def test_the_reader_reads_what_orjson_reads(reader: Any, data: bytes) -> None:
    fields = reader.read_select_body(data)
    if fields is not None:
        assert as_orjson(fields) == loaded(data)
        assert type(fields.get("token_ids")) is not list  # token ids are never Python ints here


def route_answer(data: bytes) -> tuple[str, Any]:
    try:
        body = request_select_body(Request("POST", "/select", b"", data))
    except HttpError as exc:
        return "error", (exc.status, exc.message)
    tokens = body.token_ids
    return "ok", attrs.evolve(body, token_ids=None if tokens is None else tuple(tokens))  # type: ignore[arg-type]


def answer_before(data: bytes) -> tuple[str, Any]:
    """What the routes answered before the reader: ``select_body`` of the request's JSON (or its 400)."""
    try:
        return "ok", select_body(Request("POST", "/select", b"", data).json())
    except HttpError as exc:
        return "error", (exc.status, exc.message)


@pytest.mark.parametrize("compiled", [True, False], ids=["reader", "no reader"])
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=body_bytes())
def test_routes_read_every_body_as_before(monkeypatch: pytest.MonkeyPatch, compiled: bool, data: bytes) -> None:
    # (The pure reader stands in where nothing is compiled: the same source, the same answers. The patches are
    # the same for every example, so the fixture's lifetime does not matter.)
    module = select_body_reader if select_body_reader.COMPILED else PURE
    monkeypatch.setattr("kvrouter.api.bodies.select_schemas.body_reader", module)
    monkeypatch.setattr(module, "COMPILED", compiled)
    assert route_answer(data) == answer_before(data)


def test_a_typical_prompt_is_read_into_packed_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = [*range(512), *range(2**31, 2**31 + 512), 0, 4294967295]
    data = orjson.dumps({"model_name": "bench", "token_ids": tokens, "selection_id": "s", "explain": False})
    module = select_body_reader if select_body_reader.COMPILED else PURE
    monkeypatch.setattr("kvrouter.api.bodies.select_schemas.body_reader", module)
    monkeypatch.setattr(module, "COMPILED", True)
    body = request_select_body(Request("POST", "/select", b"", data))
    assert type(body.token_ids) is array and body.token_ids.tolist() == tokens
    assert attrs.evolve(body, token_ids=tuple(tokens)) == SelectBody(  # type: ignore[arg-type]
        model_name="bench",
        token_ids=tuple(tokens),
        selection_id="s",  # type: ignore[arg-type]
    )
    assert body.prompt().token_ids is body.token_ids  # hashed as it is: no conversion on the way


@pytest.mark.parametrize(
    "data",
    [
        b'{"model_name":"m","token_ids":[1,4294967296]}',  # beyond u32: the converter's 422 names it
        b'{"model_name":"m","token_ids":[1,-1]}',
        b'{"model_name":"m","token_ids":[1,2.0]}',
        b'{"model_name":"m","token_ids":[01]}',  # invalid JSON: orjson's 400
        b'{"model_name":"m","token_ids":[1,]}',
        b'{"model_name":"m\\u00e9","token_ids":[1]}',  # an escape: orjson decodes it
        b'{"model_name":"m","token_ids":[1],"pinned_worker":{"worker_id":1,"dp_rank":0}}',
        b'{"model_name":"m","token_ids":[1]} x',
    ],
)
@pytest.mark.parametrize("reader", READERS)
def test_other_shapes_are_left_to_orjson(reader: Any, data: bytes) -> None:
    assert reader.read_select_body(data) is None


@pytest.mark.parametrize("reader", READERS)
def test_token_ids_of_every_length_anywhere_in_the_body(reader: Any) -> None:
    """Token ids of 1 to 11 digits (eight read at a time where eight bytes follow, one at a time near the end of
    the body), after every spacing and at every offset: read as orjson reads them, refused past u32."""
    rng = random.Random(5)
    for _ in range(3000):
        tokens = [
            rng.choice([rng.randint(0, 9), rng.randint(0, 10 ** rng.randint(1, 11)), U32_MAX, 10**8, 99_999_999])
            for _ in range(rng.randint(0, 9))
        ]
        spaced = rng.choice([",", ", ", " ,", "\n,\t"]).join(map(str, tokens))
        first = rng.choice(["", '"model_name":"m",', '"model_name":"' + "x" * rng.randint(0, 9) + '",'])
        data = ("{" + first + '"token_ids":[' + spaced + "]}").encode()
        fields = reader.read_select_body(data)
        if all(token <= U32_MAX for token in tokens):
            assert fields is not None and fields["token_ids"].tolist() == tokens
        else:
            assert fields is None
