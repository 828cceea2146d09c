"""THE tables of routes the fuzz suite drives: one row per route of each service.

A new route is one more row: its method and path (as in the service's route table; a test fails while a
served route has no row), a strategy for plausible bodies and path parameters, and whether 1.6.1's
contract lets it answer 503 (no eligible worker: ``unavailable_ok``). Everything hostile is derived
from these rows by ``tests/fuzz/requests.py``.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

import attrs
from hypothesis import strategies as st

from tests.fuzz.strategies import (
    ANY_MODEL,
    BAD_HTTP_ENDPOINTS,
    BLOCK_SIZES,
    HTTP_ENDPOINTS,
    MODELS,
    REQUEST_IDS,
    SMALL_HASHES,
    TENANTS,
    TOKEN_COUNTS,
    WORKER_IDS,
    ZMQ_ENDPOINTS,
    JsonBody,
    optional,
    path_with,
    scoped,
)


@attrs.frozen
class FuzzRoute:
    method: str
    path: str  # the service's template: "{name}" for a path parameter
    body: st.SearchStrategy[JsonBody] | None = None  # plausible bodies; None: the route reads no body
    params: dict[str, st.SearchStrategy[str]] = attrs.Factory(dict)
    query: st.SearchStrategy[dict[str, str]] | None = None
    unavailable_ok: bool = False  # 503 by design when no worker is eligible (1.6.1), never Retry-After
    weight: int = 1  # how often it is drawn: routes that build state more, so the others meet some


def command_of(row: FuzzRoute) -> st.SearchStrategy[JsonBody]:
    """A command of ``POST /batch`` or the command stream naming ``row`` with a plausible request."""
    params = st.fixed_dictionaries(row.params)
    query = row.query if row.query is not None else st.just({})
    body = row.body if row.body is not None else st.none()

    def build(parts: tuple[dict[str, str], dict[str, str], Any]) -> JsonBody:
        path = path_with(row.path, parts[0]) + (f"?{urlencode(parts[1])}" if parts[1] else "")
        command: dict[str, Any] = {"method": row.method, "path": path}
        if parts[2] is not None:
            command["body"] = parts[2]
        return command

    return st.tuples(params, query, body).map(build)


def batch_of(rows: list[FuzzRoute]) -> st.SearchStrategy[JsonBody]:
    """``POST /batch`` bodies: commands naming the other rows (a few junk paths too)."""
    commands = st.one_of(*[command_of(row) for row in rows], st.just({"method": "GET", "path": "/nope"}))
    return st.lists(commands, max_size=6)


SCOPE_QUERY = optional({"model_name": ANY_MODEL, "tenant_id": TENANTS, "routing_group": TENANTS})
# Served by both services next to their own: the command stream and the live load stream.
COMMAND_ROUTES = [FuzzRoute("GET", "/ws/commands"), FuzzRoute("GET", "/ws/loads", query=SCOPE_QUERY)]
# What every service serves about itself: its figures (api/routes/metrics.py) and its API description
# (api/routes/openapi.py).
SELF_DESCRIPTION_ROUTES = [FuzzRoute("GET", "/metrics"), FuzzRoute("GET", "/openapi.json")]
PEER = st.fixed_dictionaries({"endpoint": st.sampled_from(["tcp://127.0.0.1:9", "tcp://127.0.0.1:11"])})
WORKER_ID_PARAM = {"worker_id": WORKER_IDS.map(str)}
RESERVATION_PARAM = {"reservation_id": REQUEST_IDS}

REPLICA_ROUTES = [
    FuzzRoute("POST", "/replica_sync/register_peer", PEER),
    FuzzRoute("POST", "/replica_sync/deregister_peer", PEER),
    FuzzRoute("GET", "/replica_sync/peers"),
]

# -- the slot tracker ----------------------------------------------------------------------------------------

REGISTER = scoped(
    {
        "model_name": MODELS,
        "worker_id": WORKER_IDS,
        "block_size": BLOCK_SIZES,
        "dp_start": st.integers(0, 2),
        "dp_size": st.integers(1, 3),
    }
)
REQUEST_REF = scoped({"request_id": REQUEST_IDS})
ADD = scoped(
    {"request_id": REQUEST_IDS, "worker_id": WORKER_IDS, "dp_rank": st.integers(0, 4), "sequence_hashes": SMALL_HASHES},
    {"new_isl_tokens": TOKEN_COUNTS},
)
POTENTIAL = scoped({"sequence_hashes": SMALL_HASHES}, {"new_isl_tokens": TOKEN_COUNTS})

SLOT_TRACKER_ROUTES = [
    FuzzRoute("POST", "/register", REGISTER, weight=3),
    FuzzRoute("POST", "/unregister", scoped({"worker_id": WORKER_IDS})),
    FuzzRoute("GET", "/workers", query=SCOPE_QUERY),
    FuzzRoute("POST", "/add", ADD, weight=3),
    FuzzRoute("POST", "/prefill_complete", REQUEST_REF),
    FuzzRoute("POST", "/free", REQUEST_REF),
    FuzzRoute("GET", "/loads", query=SCOPE_QUERY),
    FuzzRoute("POST", "/potential_loads", POTENTIAL),
    FuzzRoute("GET", "/cluster"),
    FuzzRoute("GET", "/health"),
    *REPLICA_ROUTES,
    *SELF_DESCRIPTION_ROUTES,
]
SLOT_TRACKER_ROUTES += [FuzzRoute("POST", "/batch", batch_of(SLOT_TRACKER_ROUTES), weight=2), *COMMAND_ROUTES]

# -- the selection service -----------------------------------------------------------------------------------

WORKER_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "tenant_id": TENANTS,
    "kv_events_endpoints": st.dictionaries(st.sampled_from(["0", "1", "2"]), ZMQ_ENDPOINTS, max_size=3),
    "replay_endpoint": ZMQ_ENDPOINTS,
    "data_parallel_start_rank": st.integers(0, 2),
    "data_parallel_size": st.sampled_from([1, 1, 1, 2, 3, 0]),
    "max_num_batched_tokens": st.integers(1, 8192),
    "total_kv_blocks": st.integers(1, 10_000),
    "stable_routing_id": st.sampled_from(["s1", "s2"]),
    "is_eagle": st.booleans(),
    "taints": st.lists(st.sampled_from(["gpu", "spot"]), max_size=2),
    "topology_domains": st.dictionaries(st.sampled_from(["rack", "zone"]), st.sampled_from(["a", "b"]), max_size=2),
    "kv_transfer_domain": st.sampled_from(["a", "b"]),
    "kv_transfer_enforcement": st.sampled_from(["required", "preferred"]),
    "kv_transfer_preferred_weight": st.floats(0, 1),
    "worker_role": st.sampled_from(["both", "both", "prefill", "decode"]),
}
WORKER = st.fixed_dictionaries(
    {
        "worker_id": WORKER_IDS,
        "model_name": MODELS,
        "endpoint": HTTP_ENDPOINTS,
        "block_size": BLOCK_SIZES,
        "kv_events_endpoint": ZMQ_ENDPOINTS,
    },
    optional=WORKER_FIELDS,
)
PATCH = optional(
    {
        "model_name": MODELS,
        "endpoint": HTTP_ENDPOINTS,
        "block_size": BLOCK_SIZES,
        "kv_events_endpoint": ZMQ_ENDPOINTS,
        **WORKER_FIELDS,
    }
)
TOKENS = st.lists(st.integers(0, 40), max_size=40)
PROMPT = st.one_of(
    scoped({"token_ids": TOKENS}, {"lora_name": st.sampled_from(["l1", "l2"])}),
    # Precomputed hashes: as many block hashes as sequence hashes, as a client computes them.
    st.tuples(SMALL_HASHES, TOKEN_COUNTS.filter(bool), scoped({})).map(
        lambda parts: {**parts[2], "block_hashes": parts[0], "sequence_hashes": parts[0], "isl_tokens": parts[1]}
    ),
)
SELECT_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "selection_id": REQUEST_IDS,
    "reservation_id": REQUEST_IDS,
    "router_config_override": optional(
        {
            "overlap_score_credit": st.floats(0, 2),
            "prefill_load_scale": st.floats(0, 2),
            "router_temperature": st.floats(0, 2),
            "track_prefill_tokens": st.booleans(),
            "assume_kv_reuse": st.booleans(),
        }
    ),
    "expected_output_tokens": st.integers(0, 1000),
    "pinned_worker": st.fixed_dictionaries({"worker_id": WORKER_IDS, "dp_rank": st.integers(0, 3)}),
    "allowed_worker_ids": st.lists(WORKER_IDS, max_size=3),
    "routing_constraints": optional(
        {
            "required_taints": st.lists(st.sampled_from(["gpu", "spot"]), max_size=2),
            "preferred_taints": st.dictionaries(st.sampled_from(["gpu", "spot"]), st.floats(-2, 2), max_size=2),
        }
    ),
    "session_id": st.sampled_from(["s1", "s2"]),
    "session_context": st.fixed_dictionaries(
        {"session_id": st.sampled_from(["s1", "s2"])},
        optional={"parent_session_id": st.just("s1"), "session_final": st.booleans()},
    ),
    "affinity_target": st.fixed_dictionaries({"worker_id": WORKER_IDS}, optional={"dp_rank": st.integers(0, 3)}),
    "priority_jump": st.floats(-10, 10),
    "router_mode": st.sampled_from(["kv", "round_robin", "random", "direct", "least_loaded", "kv_ttft", "kv-ttft"]),
    "explain": st.booleans(),
}
SELECT = st.tuples(PROMPT, optional(SELECT_FIELDS)).map(lambda parts: {**parts[0], **parts[1]})
RESERVATION = st.one_of(
    scoped({"selection_id": REQUEST_IDS}),
    scoped(
        {
            "reservation_id": REQUEST_IDS,
            "worker_id": WORKER_IDS,
            "sequence_hashes": SMALL_HASHES,
            "isl_tokens": TOKEN_COUNTS,
        },
        {
            "dp_rank": st.integers(0, 3),
            "effective_prefill_tokens": TOKEN_COUNTS,
            "track_prefill_tokens": st.booleans(),
            "expected_output_tokens": st.integers(0, 1000),
        },
    ),
)
OUTPUT_BLOCK = optional({"decay_fraction": st.floats(0, 1)})
# No body (as 1.6.1), or the engine's cached tokens (negative ones are refused with 400).
PREFILL_COMPLETE = st.one_of(st.none(), optional({"cached_tokens": st.integers(-2, 5000)}))

SELECTION_ROUTES = [
    FuzzRoute("POST", "/workers", WORKER, weight=3),
    FuzzRoute("GET", "/workers", query=SCOPE_QUERY),
    FuzzRoute("PATCH", "/workers/{worker_id}", PATCH, WORKER_ID_PARAM),
    FuzzRoute("DELETE", "/workers/{worker_id}", params=WORKER_ID_PARAM),
    FuzzRoute("GET", "/ready", unavailable_ok=True),
    FuzzRoute("GET", "/health"),
    FuzzRoute("POST", "/select", SELECT, unavailable_ok=True),
    FuzzRoute("POST", "/select_and_reserve", SELECT, unavailable_ok=True, weight=3),
    FuzzRoute("POST", "/select_disaggregated", SELECT, unavailable_ok=True),
    FuzzRoute("POST", "/reservations", RESERVATION, weight=3),
    FuzzRoute("POST", "/reservations/{reservation_id}/prefill_complete", PREFILL_COMPLETE, RESERVATION_PARAM),
    FuzzRoute("POST", "/reservations/{reservation_id}/output_block", OUTPUT_BLOCK, RESERVATION_PARAM),
    FuzzRoute("DELETE", "/reservations/{reservation_id}", params=RESERVATION_PARAM),
    FuzzRoute("GET", "/loads", query=SCOPE_QUERY),
    FuzzRoute("POST", "/potential_loads", SELECT, unavailable_ok=True),
    FuzzRoute("POST", "/overlap_scores", SELECT, unavailable_ok=True),
    FuzzRoute("GET", "/dump"),
    FuzzRoute("GET", "/cluster"),
    FuzzRoute("GET", "/ws/decisions", query=SCOPE_QUERY),
    *REPLICA_ROUTES,
    *SELF_DESCRIPTION_ROUTES,
]
SELECTION_ROUTES += [FuzzRoute("POST", "/batch", batch_of(SELECTION_ROUTES), weight=2), *COMMAND_ROUTES]

# Requests that once answered 500, hung the service or crashed it at every restart: sent first, every run.
# (method, target, JSON body or None)
KNOWN = list[tuple[str, str, Any]]
SLOT_TRACKER_KNOWN: KNOWN = [
    ("POST", "/register", {"worker_id": 9, "model_name": "m", "block_size": 4, "dp_start": 0, "dp_size": 4097}),
    ("POST", "/register", {"worker_id": 9, "model_name": "m", "block_size": 4, "dp_start": 2**32 - 1, "dp_size": 2}),
    ("POST", "/add", {"model_name": "m", "request_id": "r", "worker_id": 0, "dp_rank": 0, "sequence_hashes": [2**64]}),
]
SELECTION_KNOWN: KNOWN = [
    ("POST", "/workers", {"worker_id": 9, "data_parallel_size": 2, "replay_endpoint": "tcp://h:²"}),
    ("POST", "/workers", {"worker_id": 9, "kv_events_endpoints": {"²": "tcp://127.0.0.1:9"}}),
    ("POST", "/workers", {"worker_id": 9, "kv_events_endpoints": {"9" * 5000: "tcp://127.0.0.1:9"}}),
    ("POST", "/workers", {"worker_id": 9, "data_parallel_size": 4_000_000_000}),
    ("POST", "/workers", {"worker_id": 9, "data_parallel_size": 1_000_000}),
    # Endpoints the frontend would have forwarded prompts through to any path of any host.
    *[("POST", "/workers", {"worker_id": 9, "endpoint": endpoint}) for endpoint in BAD_HTTP_ENDPOINTS],
    ("POST", "/workers", {"worker_id": 9, "endpoint": "http://w/" + "a" * 3000}),
    ("POST", "/reservations", {"model_name": "ghost", "selection_id": "q"}),
    ("PATCH", "/workers/%C2%B2", {}),
    ("DELETE", "/workers/%C2%B2", None),
    ("DELETE", "/workers/" + "9" * 5000, None),
    # Prefill loads summing past u64 (the wire type): /potential_loads and /loads answered 500.
    (
        "POST",
        "/workers",
        {
            "worker_id": 0,
            "model_name": "m",
            "endpoint": "http://w",
            "block_size": 4,
            "kv_events_endpoint": "tcp://127.0.0.1:9",
        },
    ),
    (
        "POST",
        "/reservations",
        {"model_name": "m", "reservation_id": "top", "worker_id": 0, "sequence_hashes": [1], "isl_tokens": 2**64 - 1},
    ),
    ("POST", "/potential_loads", {"model_name": "m", "block_hashes": [2], "sequence_hashes": [2], "isl_tokens": 5}),
    (
        "POST",
        "/reservations",
        {"model_name": "m", "reservation_id": "top2", "worker_id": 0, "sequence_hashes": [1], "isl_tokens": 1},
    ),
    ("GET", "/loads", None),
    ("DELETE", "/reservations/top", None),
]

# -- the mock worker (kvrouter mock-worker) ------------------------------------------------------------------

WORDS = st.lists(st.sampled_from(["hello", "world", ",", "the", "cat", "sat", "é", "\n"]), min_size=1, max_size=30)
GENERATION_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["mock", "mock", "mock", "other"]),
    "max_tokens": st.integers(1, 6),
    "stream": st.booleans(),
    "stream_options": optional({"include_usage": st.booleans()}),
    "n": st.just(1),
    "temperature": st.floats(0, 2),
}
COMPLETION = st.fixed_dictionaries(
    {"prompt": st.one_of(st.lists(st.integers(0, 60), min_size=1, max_size=48), WORDS.map(" ".join))},
    optional=GENERATION_FIELDS,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": WORDS.map(" ".join)}
)
CHAT = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, min_size=1, max_size=3)},
    optional={**GENERATION_FIELDS, "max_completion_tokens": st.integers(1, 6)},
)
MOCK_WORKER_ROUTES = [
    FuzzRoute("POST", "/v1/completions", COMPLETION, weight=3),
    FuzzRoute("POST", "/v1/chat/completions", CHAT, weight=2),
    FuzzRoute("GET", "/v1/models"),
    FuzzRoute("GET", "/health"),
    FuzzRoute("GET", "/stats"),
]
MOCK_WORKER_KNOWN: KNOWN = [
    ("POST", "/v1/completions", {"prompt": [1, 2**32]}),
    ("POST", "/v1/completions", {"prompt": [1], "max_tokens": 2**70}),
    ("POST", "/v1/completions", {"prompt": list(range(2000))}),  # more than the KV cache holds
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}),
]

# -- the frontend (kvrouter frontend): its own routes; the selection service's it serves are rows above -------

FRONTEND_ROUTES = [
    FuzzRoute("POST", "/v1/completions", COMPLETION, weight=3),
    FuzzRoute("POST", "/v1/chat/completions", CHAT, weight=2),
    FuzzRoute("GET", "/v1/models"),
    FuzzRoute("GET", "/frontend/stats"),
]
# ``kvrouter frontend --selection-url``: the same, and what its port answers besides (no service routes of its own).
REMOTE_FRONTEND_ROUTES = [*FRONTEND_ROUTES, FuzzRoute("GET", "/health"), FuzzRoute("GET", "/metrics")]
FRONTEND_KNOWN: KNOWN = [
    ("POST", "/v1/completions", {"prompt": [1, 2**32]}),
    ("POST", "/v1/completions", {"prompt": [1], "max_tokens": 2**70}),
    ("POST", "/v1/completions", {"prompt": list(range(2000))}),  # more than the worker's KV cache holds
    ("POST", "/v1/completions", {"prompt": "hi", "model": ["mock"]}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": None}], "stream": True}),
]
