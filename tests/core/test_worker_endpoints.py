"""A worker's HTTP endpoint, as the catalog checks it (``actors/core/worker_endpoints.py``): a base URL the route is
joined to, nothing that could redirect the frontend's POST of a client's prompt elsewhere; and the operator's
allow-list of worker hosts (``--worker-endpoint-allow``).

Before these checks the catalog took any string: ``http://127.0.0.1:19000/secret/internal#`` made the frontend
POST prompts to ``/secret/internal`` (the ``#`` dropped ``/v1/completions``), ``?x=`` swallowed the route as a
parameter, and ``user:pw@`` and any scheme were accepted."""

from __future__ import annotations

import ipaddress
import re

import pytest

from kvrouter.actors.core.catalog import WorkerRecord, allow_list_refusal, record_problem
from kvrouter.actors.core.commands import UpsertWorker
from kvrouter.actors.core.decide import decide
from kvrouter.actors.core.decisions import Accepted, Reason, Rejected
from kvrouter.actors.core.endpoints import InvalidEndpoint
from kvrouter.actors.core.events import WorkerUpserted
from kvrouter.actors.core.evolve import fold
from kvrouter.actors.core.ids import ScopeKey
from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.core.worker_endpoints import (
    MAX_ENDPOINT_CHARS,
    HttpEndpoint,
    http_endpoint_problem,
    parse_allow_list,
    parse_http_endpoint,
)

SCOPE = ScopeKey("m", "default")

# Each of these was accepted before, and the attacks among them reached hosts or paths the operator never chose.
REFUSED = {
    "http://127.0.0.1:19000/secret/internal#": "a fragment",
    "http://127.0.0.1:19000/secret/internal#x": "a fragment",
    "http://127.0.0.1:19000/secret?x=": "a query",
    "http://w?": "a query",
    "http://user:pw@127.0.0.1:19000": "user information",
    "http://user@w": "user information",
    "http://w@evil.example": "user information",
    "ftp://w/file": "not an http:// or https:// URL",
    "file:///etc/passwd": "not an http:// or https:// URL",
    "javascript:alert(1)": "not an http:// or https:// URL",
    "gopher://w:70/": "not an http:// or https:// URL",
    "w:8000": "not an http:// or https:// URL",
    "//w:8000": "not an http:// or https:// URL",
    "http:/w": "not an http:// or https:// URL",
    "http://": "has no host",
    "http:///v1": "has no host",
    "http://:8000": "has no host",
    "https://é.example": "non-ASCII",
    "http://ex\u0430mple.com": "non-ASCII",  # a Cyrillic a
    "http://w/ä": "non-ASCII",
    "http://w /x": "spaces or control characters",
    "http://w\t/x": "spaces or control characters",
    "http://w\r\nHost: evil/": "spaces or control characters",
    "http://w\x00": "spaces or control characters",
    "http://w\\@evil.example/": "a backslash",
    "http://2130706433:8000": "not a dotted-quad IPv4 address",
    "http://127.1": "not a dotted-quad IPv4 address",
    "http://0x7f.0.0.1": "not a dotted-quad IPv4 address",
    "http://0177.0.0.1": "not a dotted-quad IPv4 address",
    "http://010.0.0.1": "not a dotted-quad IPv4 address",
    "http://[::1%25eth0]:8000": "an IPv6 zone",
    "http://[::1": "unclosed",
    "http://[zz]:1": "invalid IPv6 host",
    "http://[::1]x": "after its [IPv6] host",
    "http://w:0": "invalid port",
    "http://w:65536": "invalid port",
    "http://w:²": "non-ASCII",
    "http://w:": "invalid port",
    "http://w:80:80": "invalid port",
    "http://-w-": "invalid host",
    "http://w..x": "invalid host",
    "http://" + "a" * 64 + ".example": "invalid host",
    "http://w/%2e%2e/admin": "percent escapes",
    "http://w/a/../admin": ". or .. path segment",
    "http://w/./a": ". or .. path segment",
    "http://w//evil.example": "empty path segment",
    "http://w/" + "a" * MAX_ENDPOINT_CHARS: "longer than",
}


@pytest.mark.parametrize(("text", "why"), sorted(REFUSED.items()))
def test_an_endpoint_that_could_redirect_the_prompts_is_refused(text: str, why: str) -> None:
    with pytest.raises(InvalidEndpoint, match=re.escape(why)):
        parse_http_endpoint(text)
    problem = record_problem(WorkerRecord(1, "m", endpoint=text))
    assert problem is not None and problem.startswith("endpoint: ") and why in problem
    assert len(problem) < 400  # a huge endpoint is quoted in part only


@pytest.mark.parametrize(
    ("text", "parts"),
    [
        ("http://w", HttpEndpoint("http", "w", None, "")),
        ("https://worker-1.example:8443", HttpEndpoint("https", "worker-1.example", 8443, "")),
        ("HTTP://W.Example.COM./", HttpEndpoint("http", "w.example.com", None, "")),
        ("http://my_worker:8000/", HttpEndpoint("http", "my_worker", 8000, "")),
        (
            "http://10.0.0.9:8000/base/path/",
            HttpEndpoint("http", "10.0.0.9", 8000, "/base/path", ipaddress.IPv4Address("10.0.0.9")),
        ),
        ("http://[::1]:8000", HttpEndpoint("http", "::1", 8000, "", ipaddress.IPv6Address("::1"))),
        ("http://xn--bcher-kva.example/v2", HttpEndpoint("http", "xn--bcher-kva.example", None, "/v2")),
    ],
)
def test_a_base_url_is_accepted_and_the_route_is_joined_to_its_path(text: str, parts: HttpEndpoint) -> None:
    parsed = parse_http_endpoint(text)
    assert parsed == parts
    assert parsed.joined("/v1/completions") == parts.path + "/v1/completions"
    assert record_problem(WorkerRecord(1, "m", endpoint=text)) is None


@pytest.mark.parametrize("text", [None, ""])
def test_no_endpoint_is_not_an_error_but_an_incomplete_record(text: str | None) -> None:
    assert http_endpoint_problem(text) is None
    assert record_problem(WorkerRecord(1, "m", endpoint=text)) is None


def test_the_core_refuses_a_bad_endpoint_whatever_surface_sent_it() -> None:
    """``decide`` itself refuses: every surface (HTTP, /batch, the command stream, the embedded router, fronts)
    ends in it, and nothing is produced to journal."""
    state = ScopeState(SCOPE)
    for text in ("http://127.0.0.1:19000/secret/internal#", "http://u:p@w", "file:///etc/passwd"):
        decision = decide(state, UpsertWorker(WorkerRecord(1, "m", endpoint=text, block_size=4)))
        assert isinstance(decision, Rejected) and decision.reason is Reason.INVALID
    assert state.selection.catalog == {}


def test_a_record_journaled_before_the_check_is_still_recovered() -> None:
    """``evolve`` never validates: a journal written by an older build, holding such a record, still folds."""
    state = ScopeState(SCOPE)
    legacy = WorkerRecord(1, "m", endpoint="http://127.0.0.1:19000/secret/internal#", block_size=4)
    fold(state, (WorkerUpserted(legacy, 4),))
    assert state.selection.catalog[1] == legacy


# -- the allow-list -----------------------------------------------------------------------------------------------


def allowed(allow: str, endpoint: str) -> bool:
    return parse_http_endpoint(endpoint) and parse_allow_list([allow]).allows(parse_http_endpoint(endpoint))


@pytest.mark.parametrize(
    ("allow", "endpoint", "expected"),
    [
        ("10.0.0.0/8", "http://10.1.2.3:8000", True),
        ("10.0.0.0/8", "http://11.1.2.3:8000", False),
        ("10.0.0.0/8", "http://[::ffff:10.1.2.3]:8000", True),  # the mapped form is the same host
        ("10.0.0.0/8", "http://[::ffff:127.0.0.1]:8000", False),
        ("10.0.0.0/8", "http://worker.internal", False),  # a name is allowed by being listed, never resolved
        ("10.0.0.0/8, 192.168.1.7", "http://192.168.1.7", True),
        ("fd00::/8", "http://[fd00::1]:8000", True),
        ("fd00::/8", "http://[::1]:8000", False),
        ("worker-1.internal", "http://WORKER-1.internal.:8000/base", True),
        ("worker-1.internal", "http://worker-2.internal", False),
        ("worker-1.internal", "http://worker-1.internal.evil.example", False),
        (".gpu.internal", "http://w7.gpu.internal", True),
        (".gpu.internal", "http://gpu.internal", False),
        (".gpu.internal", "http://w7.gpu.internal.evil.example", False),
        (".gpu.internal", "http://evilgpu.internal", False),
        ("127.0.0.1", "http://127.0.0.1:9000", True),
        ("127.0.0.1", "http://localhost:9000", False),
    ],
)
def test_the_allow_list_admits_listed_hosts_and_networks_only(allow: str, endpoint: str, expected: bool) -> None:
    assert bool(allowed(allow, endpoint)) is expected


@pytest.mark.parametrize(
    "values", [[""], [" , "], ["10.0.0.0/33"], ["10.0.0.1/8"], ["http://w"], ["w:80"], ["é.example"], ["a b"]]
)
def test_a_bad_allow_list_entry_is_refused(values: list[str]) -> None:
    with pytest.raises(ValueError):
        parse_allow_list(values)


def test_repeated_and_comma_separated_values_add_up() -> None:
    allow = parse_allow_list(["10.0.0.0/8,w1", "w2"])
    assert allow.names == frozenset({"w1", "w2"}) and allow.networks == (ipaddress.ip_network("10.0.0.0/8"),)
    assert allow.describe() == "10.0.0.0/8, w1, w2"


def test_the_allow_list_covers_every_endpoint_of_a_record_the_service_connects_to() -> None:
    allow = parse_allow_list(["10.0.0.0/8"])
    good = WorkerRecord(1, "m", endpoint="http://10.0.0.1:8000", kv_events_endpoint="tcp://10.0.0.1:5557")
    assert allow_list_refusal(good, allow) is None
    assert allow_list_refusal(good, None) is None
    local = WorkerRecord(1, "m", endpoint="http://10.0.0.1", kv_events_endpoints=((0, "ipc:///tmp/kv"),))
    assert allow_list_refusal(local, allow) is None  # ipc:// stays on this machine
    for record, field in (
        (WorkerRecord(1, "m", endpoint="http://192.168.0.1"), "endpoint"),
        (WorkerRecord(1, "m", endpoint="http://10.0.0.1", kv_events_endpoint="tcp://169.254.169.254:80"), "kv_"),
        (WorkerRecord(1, "m", replay_endpoint="tcp://db.internal:5432"), "replay_endpoint"),
        (WorkerRecord(1, "m", kv_events_endpoints=((0, "tcp://10.0.0.1:1"), (1, "tcp://8.8.8.8:1"))), "[1]"),
    ):
        problem = allow_list_refusal(record, allow)
        assert problem is not None and field in problem and "--worker-endpoint-allow 10.0.0.0/8" in problem


def test_decide_refuses_a_host_outside_the_allow_list() -> None:
    state = ScopeState(SCOPE)
    allow = parse_allow_list(["10.0.0.0/8"])
    outside = WorkerRecord(1, "m", endpoint="http://127.0.0.1:19000", block_size=4)
    decision = decide(state, UpsertWorker(outside, endpoint_allow=allow))
    assert isinstance(decision, Rejected) and decision.reason is Reason.INVALID
    assert "not in the operator's allow-list" in decision.message
    inside = WorkerRecord(1, "m", endpoint="http://10.0.0.7:8000", block_size=4)
    assert isinstance(decide(state, UpsertWorker(inside, endpoint_allow=allow)), Accepted)
