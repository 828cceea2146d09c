"""The front/actor wire (api/process/wire.py, api/process/proxy.py): every service method's arguments and
results round-trip as plain data, failures come back as the same exception with the same message, and a
front's calls in flight are bounded (one more is refused at once, 503 in the API) and never wait forever."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import trio
import trio.testing
import zmq

from kvrouter.actors.core.catalog import WorkerPatch, WorkerRecord
from kvrouter.actors.core.commands import Prompt, SelectionOptions
from kvrouter.actors.core.decisions import Reason
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.queries import RankLoad
from kvrouter.actors.core.router_config import RouterConfigOverride
from kvrouter.actors.load_feed import LoadChange, LoadChanges
from kvrouter.actors.mailbox import JournalUnavailable, Overloaded, ReplyTimeout
from kvrouter.actors.metric_families import counter, histogram
from kvrouter.actors.peers.peer_service import PeerService
from kvrouter.actors.select_service import SelectionRequest, SelectService
from kvrouter.actors.service_support import Refused, ScopeFilter
from kvrouter.actors.slot_service import SlotService
from kvrouter.actors.transport.zmq_socket import open_socket
from kvrouter.api.process.proxy import RemoteService, ServiceLink
from kvrouter.api.process.wire import (
    decode_args,
    decode_failure,
    decode_result,
    encode_args,
    encode_failure,
    encode_result,
    method_table,
    pack,
    pack_message,
    unpack,
)
from kvrouter.journal.latency import BucketCounts


def round_trip(service_class: type, method: str, *args: object) -> list[object]:
    spec = method_table(service_class)[method]
    return decode_args(spec, unpack(pack(encode_args(spec, args, {}))))


def test_every_public_async_method_of_the_service_objects_is_callable_remotely() -> None:
    assert set(method_table(SlotService)) == {
        "register",
        "unregister",
        "add",
        "prefill_complete",
        "free",
        "workers",
        "loads",
        "potential_loads",
        "load_changes",
        "metrics",
        "apply_writes",
        "cluster",
    }
    assert {"put_worker", "patch_worker", "select", "select_and_reserve", "dump", "load_changes", "metrics"} <= set(
        method_table(SelectService)
    )
    assert set(method_table(PeerService)) == {"register_peer", "deregister_peer", "peers", "metrics"}


def test_metric_families_round_trip_as_results() -> None:
    spec = method_table(SelectService)["metrics"]
    buckets = BucketCounts((0.5, 1.0))
    buckets.observe(0.7)
    families = [
        counter("kvrouter_x", "help", ("model_name",), {("m",): 3.0}),
        histogram("kvrouter_y_seconds", "help", (), {(): buckets}),
    ]
    assert decode_result(spec, unpack(pack(encode_result(spec, families)))) == families


def test_a_batch_of_writes_crosses_as_it_is() -> None:
    writes = [["add", "m", "t", "r1", 1, 0, (1, 2**64 - 1), 16], ["free", "m", "t", "r1"]]
    [got] = round_trip(SlotService, "apply_writes", writes)
    assert got == [["add", "m", "t", "r1", 1, 0, [1, 2**64 - 1], 16], ["free", "m", "t", "r1"]]


def test_arguments_round_trip_as_the_annotated_types() -> None:
    scope = ScopeKey("m", "t")
    assert round_trip(SlotService, "add", scope, "r", 1, 0, (1, 2**64 - 1), 9) == [scope, "r", 1, 0, (1, 2**64 - 1), 9]
    assert round_trip(SlotService, "workers", ScopeFilter("m")) == [ScopeFilter("m")]
    patch = WorkerPatch(tenant_id="u", taints=("a", "b"), kv_events_endpoints=((0, "tcp://h:1"),))
    assert round_trip(SelectService, "patch_worker", 7, patch) == [7, patch]
    record = WorkerRecord(3, "m", "t", topology_domains=(("zone", "a"),), taints=("x",))
    assert round_trip(SelectService, "put_worker", record) == [record]
    request = SelectionRequest(
        scope,
        Prompt(token_ids=(1, 2, 3), lora_name="l"),
        SelectionOptions(
            allowed_worker_ids=frozenset({1, 2}), required_taints=frozenset({"gpu"}), pinned_worker=(1, 0)
        ),
        RouterConfigOverride(router_temperature=0.5),
        selection_id="s",
    )
    assert round_trip(SelectService, "select", request) == [request]


@pytest.mark.parametrize(
    "failure",
    [
        Refused(Reason.NOT_FOUND, "worker 9 not found"),
        Refused(Reason.OVERLOADED, "all 1 eligible workers are overloaded"),
        Overloaded("mailbox of m/t is full"),
        ReplyTimeout("req-1", 10.0),
        JournalUnavailable(OSError(28, "No space left on device")),
    ],
)
def test_a_failure_comes_back_as_the_same_exception_and_message(failure: Exception) -> None:
    again = decode_failure(unpack(pack(encode_failure(failure))))
    assert type(again) is type(failure) and str(again) == str(failure)
    if isinstance(failure, Refused):
        assert isinstance(again, Refused) and (again.reason, again.message) == (failure.reason, failure.message)
    if isinstance(failure, ReplyTimeout):
        assert isinstance(again, ReplyTimeout) and again.request_id == failure.request_id


def test_a_batch_of_separately_packed_items_is_one_msgpack_message() -> None:
    for count in (0, 1, 15, 16, 70_000):
        items = [pack([i, True, None]) for i in range(count)]
        assert unpack(pack_message(3, 4, items=items)) == [3, 4, [[i, True, None] for i in range(count)]]


async def test_calls_in_flight_are_bounded_and_an_unanswered_call_ends() -> None:
    """No actor process answers here: two calls wait, a third is refused at once, and the sweep ends the two."""
    with tempfile.TemporaryDirectory(prefix="kvr-") as directory:
        push = open_socket(zmq.PUSH)
        pull = open_socket(zmq.PULL)
        pull.socket.bind(f"ipc://{directory}/front-0")
        push.socket.connect(f"ipc://{Path(directory)}/nobody")
        link = ServiceLink(push, pull, front=0, incarnation=1, give_up_after=0.2, max_in_flight=2)
        service = RemoteService(link, "peers", PeerService)
        outcomes: list[BaseException] = []
        both_ended = trio.Event()

        async def waiting_call() -> None:
            try:
                await service.peers()
            except ReplyTimeout as late:
                outcomes.append(late)
                if len(outcomes) == 2:
                    both_ended.set()

        async with trio.open_nursery() as nursery:
            await nursery.start(link.run)
            nursery.start_soon(waiting_call)
            nursery.start_soon(waiting_call)
            await trio.testing.wait_all_tasks_blocked()
            assert link.in_flight == 2
            with pytest.raises(Overloaded, match="already has 2 requests waiting for the actor process"):
                await service.peers()
            await both_ended.wait()
            nursery.cancel_scope.cancel()
        assert link.in_flight == 0
        assert all("no reply within 0.2 s" in str(late) for late in outcomes)


def test_load_changes_round_trip_with_gone_scopes() -> None:
    """GET /ws/loads reaches the actor side through load_changes: its result crosses the wire intact."""
    spec = method_table(SlotService)["load_changes"]
    changes = LoadChanges(
        "e1",
        9,
        False,
        [
            LoadChange(ScopeKey("m", "t"), 3, [RankLoad(WorkerRank(1, 0), 5, 2, 1)]),
            LoadChange(ScopeKey("m", "gone"), 4, None, 2, 30),
        ],
    )
    assert decode_result(spec, unpack(pack(encode_result(spec, changes)))) == changes
    assert round_trip(SlotService, "load_changes", "e1", 9, 1.5) == ["e1", 9, 1.5]
