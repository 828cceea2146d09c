"""Hypothesis strategies for requests: plausible bodies that build state, and the hostile ways to spoil them.

Identifiers come from small pools (a few workers, models, request ids), so plausible requests meet each
other's state (a reservation on a registered worker, a free of an admitted request) and the state stays
small. Spoiled values come from ``NASTY``: the JSON a client can send that a type or range check must
refuse, including the inputs that once crashed the service ("²", 4e9 ranks, 5,000-digit numbers).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

from hypothesis import strategies as st

from kvrouter.actors.core.limits import MAX_TEXT_BYTES

JsonBody = dict[str, Any]

WORKER_IDS = st.integers(0, 5)
MODELS = st.sampled_from(["m", "m", "n"])  # where workers register
ANY_MODEL = st.sampled_from(["m", "m", "m", "n", "ghost"])  # what other requests name: "ghost" never has a worker
TENANTS = st.sampled_from(["default", "default", "t"])
REQUEST_IDS = st.sampled_from([f"r{i}" for i in range(8)])
SMALL_HASHES = st.lists(st.integers(-3, 12), max_size=8)
BLOCK_SIZES = st.sampled_from([4, 4, 4, 16])
# Token counts are u64 on the wire: mostly small, sometimes at the top of the range (sums must not overflow).
TOKEN_COUNTS = st.one_of(st.integers(0, 200), st.integers(0, 200), st.sampled_from([2**63, 2**64 - 2, 2**64 - 1]))
# A listener to a port nothing serves reconnects quietly; numeric hosts never ask DNS.
ZMQ_ENDPOINTS = st.sampled_from(["tcp://127.0.0.1:9"] * 4 + ["tcp://127.0.0.1:11", "", "ipc:///tmp/kvrouter-fuzz"])
# A worker's HTTP endpoint: mostly usable base URLs, sometimes one the catalog must refuse (each of these was
# accepted once, and the frontend forwarded prompts to wherever it pointed).
BAD_HTTP_ENDPOINTS = [
    "http://127.0.0.1:19000/secret/internal#",
    "http://w?x=",
    "http://user:pw@w",
    "ftp://w/x",
    "file:///etc/passwd",
    "javascript:alert(1)",
    "http://",
    "http://é.example",
    "http://2130706433",
    "http://w/../admin",
    "http://[::1%25eth0]",
    "http://w:0",
]
HTTP_ENDPOINTS = st.sampled_from(
    ["http://w"] * 6 + ["https://w:8443/base/", "http://10.0.0.9:8000", "http://[::1]:9", "", *BAD_HTTP_ENDPOINTS]
)

NASTY_STRINGS = st.sampled_from(
    [
        "",
        " ",
        "²",
        "٣",
        "0",
        "01",
        "+1",
        "-1",
        "1e3",
        "9" * 30,
        "9" * 5000,
        "x" * (MAX_TEXT_BYTES + 1),
        "é" * (MAX_TEXT_BYTES // 2 + 1),
        "\x00",
        "💥",
        "tcp://h:²",
        "tcp://127.0.0.1:0",
        "tcp://127.0.0.1:65536",
        "tcp://[zz]:1",
        "ipc://",
        "udp://h:1",
        "../../etc/passwd",
        "http://127.0.0.1:19000/secret/internal#",
        "http://user:pw@w",
        "javascript:alert(1)",
        "%C2%B2",
        "null",
    ]
)
# Keys a map of ranks must refuse: digits str.isdigit() accepts and int() does not, signs, leading zeros.
NASTY_KEYS = st.sampled_from(["²", "٣", "-1", "+1", "01", " 1", "9" * 30, "9" * 5000, "4294967296"])
NASTY_INTS = st.one_of(
    st.sampled_from(
        [0, -1, 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 4_000_000_000, 10**30]
    ),
    st.integers(-(2**70), 2**70),
)
NASTY_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    NASTY_INTS,
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.5, -0.0, 1e308, 5e-324, 1.5]),
    st.text(max_size=12),
    NASTY_STRINGS,
)
NASTY = st.recursive(
    NASTY_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.text(max_size=6), NASTY_STRINGS), inner, max_size=3)
    ),
    max_leaves=8,
)
# Raw bodies that are not the JSON object a route expects.
RAW_BODIES = st.one_of(
    st.sampled_from(
        [
            b"",
            b" ",
            b"{",
            b"null",
            b"[]",
            b"[1, 2]",
            b'"text"',
            b"1" + b"0" * 5000,
            b'{"worker_id": 1,}',
            b'{"worker_id": 1} trailing',
            b'{"worker_id": 1, "worker_id": "x"}',
            b"\xff\xfe\x00",
            b'{"a": "\\ud800"}',
            b"[" * 5000 + b"]" * 5000,
            b"NaN",
        ]
    ),
    st.binary(max_size=64),
)
CONTENT_TYPES = st.sampled_from(
    [
        "application/json; charset=utf-8",
        "application/problem+json",
        "text/plain",
        "application/x-www-form-urlencoded",
        " application/json",
        "application/json ;",
        "",
    ]
)
METHODS = st.sampled_from(["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "FROB"])
# Path parameters as a client could send them: percent-encoded text, encodings a server must refuse.
RAW_PARAMS = st.sampled_from(["%C2%B2", "%", "%zz", "%00", "%FF", "a%2Fb", "..", "%2E%2E", "9" * 5000, "-1", "+1"])
JUNK_PATHS = st.sampled_from(["/", "//workers", "/workers/", "/workers/1/2", "/%", "/%ff", "/.well-known/x", "/admin"])
UPGRADE_HEADERS = {
    "connection": "Upgrade",
    "upgrade": "websocket",
    "sec-websocket-version": "13",
    "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ==",
}


def optional(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[JsonBody]:
    """A dict holding any subset of ``fields``."""
    return st.fixed_dictionaries({}, optional=fields)


def scoped(required: dict[str, st.SearchStrategy[Any]], extra: dict[str, st.SearchStrategy[Any]] | None = None):
    """A body naming a scope (``model_name``, and ``tenant_id`` or its alias ``routing_group`` sometimes)."""
    return st.fixed_dictionaries(
        {"model_name": ANY_MODEL, **required},
        optional={"tenant_id": TENANTS, "routing_group": TENANTS, **(extra or {})},
    )


def spoiled(body: Any, data: st.DataObject) -> Any:
    """``body`` with one thing wrong, at any depth: a value of a wrong type or out of range, a field
    missing, an unexpected field or key, a list element spoiled, or not what was expected at all."""
    if isinstance(body, dict) and body and data.draw(st.integers(0, 2)):
        keys = sorted(body)
        how = data.draw(st.sampled_from(["value", "deeper", "drop", "extra", "key"]))
        key = data.draw(st.sampled_from(keys))
        spoilt = dict(body)
        if how == "value":
            spoilt[key] = data.draw(NASTY)
        elif how == "deeper":
            spoilt[key] = spoiled(body[key], data)
        elif how == "drop":
            del spoilt[key]
        elif how == "extra":
            spoilt[data.draw(st.one_of(st.text(max_size=8), NASTY_STRINGS))] = data.draw(NASTY)
        else:  # the same value under a spoiled key (map keys are data too: ranks, taints, domains)
            spoilt[data.draw(st.one_of(NASTY_KEYS, NASTY_STRINGS))] = spoilt.pop(key)
        return spoilt
    if isinstance(body, list) and body and data.draw(st.integers(0, 2)):
        items = list(body)
        index = data.draw(st.integers(0, len(items) - 1))
        items[index] = spoiled(items[index], data)
        return items
    return data.draw(NASTY)


def with_repeated_key(body: Any, data: st.DataObject) -> tuple[bytes, str | None] | None:
    """``body`` as JSON with one object (at any depth) holding one of its keys twice: first with another value
    (a nasty one, or the same), then with its own, so that a parser keeping the last value reads ``body`` as it
    was. Returns the bytes and the repeated key if the object is the body itself (else None); None if ``body``
    holds no object with a key."""
    objects = list(_objects(body, ()))
    if not objects:
        return None
    path, found = data.draw(st.sampled_from(objects), label="repeated in")
    key = data.draw(st.sampled_from(sorted(found)), label="repeated key")
    first = data.draw(st.one_of(NASTY, st.just(found[key])), label="first value")
    return _dump_repeating(body, path, key, first).encode(), key if path == () else None


def _objects(value: Any, path: tuple[Any, ...]) -> Any:
    if isinstance(value, dict):
        if value:
            yield path, value
        for key, child in value.items():
            yield from _objects(child, (*path, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield from _objects(child, (*path, index))


def _dump_repeating(value: Any, target: tuple[Any, ...], key: str, first: Any, here: tuple[Any, ...] = ()) -> str:
    if isinstance(value, dict):
        items = [f"{json.dumps(k)}: {_dump_repeating(v, target, key, first, (*here, k))}" for k, v in value.items()]
        if here == target:
            items.insert(0, f"{json.dumps(key)}: {json.dumps(first, ensure_ascii=False)}")
        return "{" + ", ".join(items) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_dump_repeating(v, target, key, first, (*here, i)) for i, v in enumerate(value)) + "]"
    return json.dumps(value, ensure_ascii=False)


def encode(body: Any) -> bytes:
    """JSON as a client may write it: integers of any size (orjson stops at 64 bits), UTF-8 text."""
    return json.dumps(body, ensure_ascii=False).encode()


def path_with(template: str, params: dict[str, str]) -> str:
    """``template`` with each ``{name}`` replaced by its value, percent-encoded as a client would."""
    path = template
    for name, value in params.items():
        path = path.replace("{" + name + "}", quote(value, safe=""))
    return path
