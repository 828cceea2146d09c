"""What the core refuses before anything is journaled: endpoints and ports that could never work, ranks
and workers beyond the caps of ``actors/core/limits.py``, and a replayed selection in a scope that has none."""

from __future__ import annotations

import pytest

from kvrouter.actors.core.catalog import WorkerRecord, record_problem
from kvrouter.actors.core.commands import Prompt, RegisterWorker, ReserveSelection, SelectWorker, UpsertWorker
from kvrouter.actors.core.decide import decide
from kvrouter.actors.core.decisions import Accepted, Reason, Rejected
from kvrouter.actors.core.endpoints import InvalidEndpoint, parse_decimal, parse_port, parse_zmq_endpoint
from kvrouter.actors.core.events import WorkerUpserted
from kvrouter.actors.core.evolve import fold
from kvrouter.actors.core.ids import U64_MASK, ScopeKey
from kvrouter.actors.core.limits import (
    MAX_PROMPT_BLOCKS,
    MAX_RANKS_PER_SCOPE,
    MAX_RANKS_PER_WORKER,
    MAX_TEXT_BYTES,
    MAX_WORKERS_PER_SCOPE,
    text_too_long,
)
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.core.state import ScopeState

SCOPE = ScopeKey("m", "default")


def apply(state: ScopeState, command: object) -> Accepted | Rejected:
    decision = decide(state, command)  # type: ignore[arg-type]
    if isinstance(decision, Accepted):
        fold(state, decision.events)
    return decision


def record(worker_id: int, **fields: object) -> WorkerRecord:
    defaults: dict[str, object] = {"endpoint": f"http://w{worker_id}", "block_size": 4}
    return WorkerRecord(worker_id, SCOPE.model_name, SCOPE.tenant_id, **{**defaults, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "maximum", "expected"),
    [
        ("0", 10, 0),
        ("0012", 100, 12),
        ("18446744073709551615", U64_MASK, U64_MASK),
        ("18446744073709551616", U64_MASK, None),
        ("²", 10, None),  # str.isdigit() is true, int() raises
        ("٣", 10, None),  # an Arabic-Indic digit: int() accepts it, the wire must not
        ("+1", 10, None),
        ("-1", 10, None),
        (" 1", 10, None),
        ("", 10, None),
        ("9" * 5000, 1 << 64, None),  # int() of 4,301+ digits raises ValueError
    ],
)
def test_decimal_text_is_ascii_digits_only(text: str, maximum: int, expected: int | None) -> None:
    assert parse_decimal(text, maximum) == expected


@pytest.mark.parametrize(("text", "expected"), [("1", 1), ("65535", 65535), ("0", None), ("65536", None), ("5²", None)])
def test_ports_are_1_to_65535(text: str, expected: int | None) -> None:
    assert parse_port(text) == expected


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [
        ("tcp://worker-1.example:5557", "worker-1.example", 5557),
        ("tcp://10.0.0.9:1", "10.0.0.9", 1),
        ("tcp://[::1]:5557", "::1", 5557),
        ("tcp://eth0;10.0.0.9:5557", "10.0.0.9", 5557),  # zmq's source;destination
        ("ipc:///tmp/kv.sock", None, None),
        ("inproc://kv", None, None),
    ],
)
def test_endpoints_zmq_can_connect_to_are_accepted(text: str, host: str | None, port: int | None) -> None:
    parsed = parse_zmq_endpoint(text)
    assert (parsed.text, parsed.host, parsed.port) == (text, host, port)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("tcp://h:²", "invalid port `²`"),
        ("tcp://h:0", "invalid port `0`"),
        ("tcp://h:65536", "invalid port `65536`"),
        ("tcp://h:", "invalid port ``"),
        ("tcp://h", "no host:port"),
        ("tcp://:5557", "no host:port"),
        ("tcp://a b:5557", "invalid host `a b`"),
        ("tcp://h:1:2", "invalid host `h:1`"),
        ("tcp://[zz]:5557", "invalid IPv6 host"),
        ("udp://h:5557", "unsupported transport `udp`"),
        ("worker:5557", "is not a ZMQ endpoint"),
        ("ipc://", "no address"),
        ("ipc://a\x00b", "NUL"),
    ],
)
def test_endpoints_zmq_could_never_connect_to_are_refused(text: str, problem: str) -> None:
    with pytest.raises(InvalidEndpoint, match=problem):
        parse_zmq_endpoint(text)


def test_port_offsets_stay_within_the_port_range() -> None:
    endpoint = parse_zmq_endpoint("tcp://h:65534")
    assert endpoint.with_port_offset(1) == "tcp://h:65535"
    assert endpoint.with_port_offset(2) is None
    assert parse_zmq_endpoint("ipc:///tmp/r").with_port_offset(1) is None


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"replay_endpoint": "tcp://h:²", "data_parallel_size": 2}, "replay_endpoint: `tcp://h:²` has an invalid port"),
        ({"kv_events_endpoint": "tcp://h:99999"}, "kv_events_endpoint: `tcp://h:99999` has an invalid port"),
        ({"kv_events_endpoints": ((0, "tcp://h:1"), (1, "h:2"))}, "kv_events_endpoints[1]: `h:2` is not a ZMQ"),
        ({"replay_endpoint": "tcp://h:65535", "data_parallel_size": 2}, "port 65535 + 1 is beyond 65535"),
        ({"data_parallel_size": MAX_RANKS_PER_WORKER + 1}, "exceeds the maximum of 4096 ranks per worker"),
        ({"data_parallel_size": 4_000_000_000}, "exceeds the maximum of 4096 ranks per worker"),
        ({"data_parallel_start_rank": 2**32 - 1, "data_parallel_size": 2}, "data parallel range overflows u32"),
    ],
)
def test_a_record_that_could_never_work_is_refused_before_it_is_journaled(
    fields: dict[str, object], problem: str
) -> None:
    bad = record(1, **fields)
    assert problem in (record_problem(bad) or "")
    state = ScopeState(SCOPE)
    decision = apply(state, UpsertWorker(bad))
    assert isinstance(decision, Rejected) and decision.reason is Reason.INVALID and problem in decision.message
    assert state.selection.catalog == {} and state.slots.ranks == {}


def test_empty_endpoints_mean_none_and_are_not_refused() -> None:
    assert record_problem(record(1, kv_events_endpoint="", replay_endpoint="", kv_events_endpoints=((0, ""),))) is None


def test_a_record_journaled_before_endpoints_were_checked_does_not_stop_the_listeners() -> None:
    """Such a record made every restart exit 1 (reconcile computed int("²") for rank 1's replay port)."""
    old = record(1, data_parallel_size=2, replay_endpoint="tcp://h:²")
    assert old.replay_endpoint_for(0) == "tcp://h:²"  # the listener reports it, once, as unusable
    assert old.replay_endpoint_for(1) is None
    assert record(1, data_parallel_size=3, replay_endpoint="tcp://h:5560").replay_endpoint_for(2) == "tcp://h:5562"


def test_slot_tracker_ranks_per_scope_are_capped() -> None:
    state = ScopeState(SCOPE)
    full = MAX_RANKS_PER_SCOPE // MAX_RANKS_PER_WORKER
    for worker_id in range(full):
        assert isinstance(apply(state, RegisterWorker(worker_id, 4, 0, MAX_RANKS_PER_WORKER)), Accepted)
    decision = apply(state, RegisterWorker(99, 4, 0, 1))
    assert isinstance(decision, Rejected) and decision.reason is Reason.CONFLICT
    assert decision.message == (
        f"model=m tenant_id=default has {MAX_RANKS_PER_SCOPE} ranks; 1 more would exceed the limit of "
        f"{MAX_RANKS_PER_SCOPE} ranks per scope"
    )
    assert len(state.slots.ranks) == MAX_RANKS_PER_SCOPE and 99 not in state.slots.workers


def test_selection_ranks_per_scope_are_capped_counting_a_replaced_worker_once() -> None:
    state = ScopeState(SCOPE)
    full = MAX_RANKS_PER_SCOPE // MAX_RANKS_PER_WORKER
    for worker_id in range(full):
        assert isinstance(
            apply(state, UpsertWorker(record(worker_id, data_parallel_size=MAX_RANKS_PER_WORKER))), Accepted
        )
    # Re-registering a worker with the same ranks (a PATCH of its endpoint, say) still fits.
    assert isinstance(apply(state, UpsertWorker(record(0, data_parallel_size=MAX_RANKS_PER_WORKER))), Accepted)
    decision = apply(state, UpsertWorker(record(99)))
    assert isinstance(decision, Rejected) and decision.reason is Reason.CONFLICT
    assert "ranks per scope" in decision.message and 99 not in state.selection.catalog
    # A worker with no ranks still takes a catalog slot: bounded by the workers cap instead.
    assert isinstance(apply(state, UpsertWorker(record(99, data_parallel_size=0))), Accepted)


def test_selection_workers_per_scope_are_capped() -> None:
    """The scope is filled by folding the events an upsert's decision makes (deciding all 8,192, each counting the
    scope's catalog for the service's rank limit, took ~20 s); the decisions at the cap, the last worker in and
    the first one over, are the core's."""
    state = ScopeState(SCOPE)
    first = apply(state, UpsertWorker(record(0, data_parallel_size=0)))
    assert isinstance(first, Accepted) and len(first.events) == 1
    (upserted,) = first.events
    assert isinstance(upserted, WorkerUpserted)
    block_size = upserted.partition_block_size
    for worker_id in range(1, MAX_WORKERS_PER_SCOPE - 1):
        fold(state, (WorkerUpserted(record(worker_id, data_parallel_size=0), block_size),))
    last = UpsertWorker(record(MAX_WORKERS_PER_SCOPE - 1, data_parallel_size=0))
    assert isinstance(apply(state, last), Accepted)
    assert len(state.selection.catalog) == MAX_WORKERS_PER_SCOPE
    decision = apply(state, UpsertWorker(record(MAX_WORKERS_PER_SCOPE, data_parallel_size=0)))
    assert isinstance(decision, Rejected) and decision.reason is Reason.CONFLICT
    assert decision.message == (
        f"model=m tenant_id=default already has {MAX_WORKERS_PER_SCOPE} workers, the limit per scope; remove one first"
    )
    assert isinstance(apply(state, UpsertWorker(record(0, data_parallel_size=0, taints=("t",)))), Accepted)


def test_a_prompt_of_too_many_blocks_is_refused() -> None:
    state = ScopeState(SCOPE)
    apply(state, UpsertWorker(record(1, block_size=1, kv_events_endpoint="tcp://w:1")))
    command = SelectWorker(Prompt(token_ids=(1,) * (MAX_PROMPT_BLOCKS + 1)), RouterConfig())
    decision = decide(state, command)
    assert isinstance(decision, Rejected) and decision.reason is Reason.INVALID
    assert f"token_ids make {MAX_PROMPT_BLOCKS + 1} blocks of 1 tokens" in decision.message


def test_replaying_a_selection_where_no_worker_ever_was_is_not_found() -> None:
    """The actor-less path (no scope yet) answered 500: decide had no rule for ReserveSelection."""
    decision = decide(ScopeState(SCOPE), ReserveSelection("q"))
    assert isinstance(decision, Rejected) and decision.reason is Reason.NOT_FOUND
    assert decision.message == (
        "no pending selection q for model=m tenant_id=default (expired, already used, or never selected)"
    )


def test_text_length_counts_utf8_bytes() -> None:
    assert not text_too_long("x" * MAX_TEXT_BYTES)
    assert text_too_long("x" * (MAX_TEXT_BYTES + 1))
    assert text_too_long("é" * (MAX_TEXT_BYTES // 2 + 1))  # 2 bytes each
