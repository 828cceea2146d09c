"""Reads never show a write a crash could take back, and wait for nothing else: a read of one scope waits
for that scope's last write to be durable, not for every write in the service. In process, under trio's
MockClock, with a journal whose durability the test releases by hand."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from kvrouter.actors.actor import ScopeActor
from kvrouter.actors.core.commands import IngestKvBatch
from kvrouter.actors.core.decisions import Accepted
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.core.kv_wire import BlockStored, KvBatch, encode_batch
from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.actors.kv_ingest import IN_PROCESS_KV_EVENTS, KvIngest, ListenerKey
from kvrouter.actors.system import ActorSystem
from kvrouter.api.process.main import select_service_builder, slot_tracker_app
from tests.support.asgi import ASGIApp, Reply, call, service_app
from tests.support.journals import GatedJournal

A = {"model_name": "m", "tenant_id": "a"}
B = {"model_name": "m", "tenant_id": "b"}


async def durable_call(app: ASGIApp, journal: GatedJournal, method: str, path: str, body: Any) -> Reply:
    async with trio.open_nursery() as nursery:
        replies = []

        async def send() -> None:
            replies.append(await call(app, method, path, body))

        nursery.start_soon(send)
        await trio.testing.wait_all_tasks_blocked()
        journal.release()
    return replies[0]


async def pending(app: ASGIApp, nursery: trio.Nursery, method: str, path: str, body: Any = None) -> list[Reply]:
    """Start a request and run it until it blocks; its reply lands in the returned list."""
    replies: list[Reply] = []

    async def send() -> None:
        replies.append(await call(app, method, path, body))

    nursery.start_soon(send)
    await trio.testing.wait_all_tasks_blocked()
    return replies


async def test_a_slot_tracker_read_waits_only_for_its_own_scope(
    autojump_clock: trio.abc.Clock, nursery: trio.Nursery
) -> None:
    journal = GatedJournal()
    app, _ = await service_app(nursery, slot_tracker_app, journal)
    register = {"worker_id": 1, "block_size": 16, "dp_start": 0, "dp_size": 1}
    assert (await durable_call(app, journal, "POST", "/register", {**A, **register})).status == 201
    add_b = await pending(app, nursery, "POST", "/register", {**B, **register})  # journaled, not yet durable
    assert add_b == []
    with trio.fail_after(1):  # virtual time: it must answer without waiting for scope B
        read_a = await call(app, "POST", "/potential_loads", {**A, "sequence_hashes": [1, 2]})
    assert read_a.status == 200 and read_a.body[0]["potential_decode_blocks"] == 2
    read_all = await pending(app, nursery, "GET", "/loads")  # sees scope B: waits for its write
    assert read_all == []
    journal.release()
    await trio.testing.wait_all_tasks_blocked()
    assert add_b[0].status == 201 and [row["tenant_id"] for row in read_all[0].body] == ["a", "b"]


async def test_a_selection_waits_only_for_its_own_scope(autojump_clock: trio.abc.Clock, nursery: trio.Nursery) -> None:
    journal = GatedJournal()
    app, _ = await service_app(nursery, select_service_builder(RouterConfig(use_kv_events=False)), journal)
    for worker_id, scope in ((1, A), (2, B)):
        body = {"worker_id": worker_id, **scope, "endpoint": "http://w", "block_size": 4}
        assert (await durable_call(app, journal, "POST", "/workers", body)).status == 201
    prompt = {"token_ids": [1, 2, 3, 4, 5]}
    booking = await pending(app, nursery, "POST", "/select_and_reserve", {**B, **prompt, "reservation_id": "r"})
    assert booking == []
    with trio.fail_after(1):
        selected = await call(app, "POST", "/select", {**A, **prompt})
        scores = await call(app, "POST", "/overlap_scores", {**A, **prompt})
    assert (selected.status, selected.body["worker_id"], scores.status) == (200, 1, 200)
    in_b = await pending(app, nursery, "POST", "/select", {**B, **prompt})
    assert in_b == []  # scope B's booking is not durable yet
    journal.release()
    await trio.testing.wait_all_tasks_blocked()
    assert booking[0].status == 200 and in_b[0].status == 200


# -- a worker's KV events are not writes a read must wait for -----------------------------------------------

BLOCK = 4
PROMPT = list(range(1, 17))  # 4 blocks of 4


def kv_worker(worker_id: int, scope: dict[str, str]) -> dict[str, Any]:
    return {
        "worker_id": worker_id,
        **scope,
        "endpoint": f"http://w{worker_id}",
        "block_size": BLOCK,
        "kv_events_endpoint": IN_PROCESS_KV_EVENTS,  # nothing listens: the test hands the batches over
    }


async def kv_events(system: ActorSystem, worker_id: int, scope: dict[str, str], first_hash: int) -> None:
    """``worker_id`` reports ``PROMPT``'s blocks cached, as its listener would: applied and journaled, not durable."""
    hashes = tuple(range(first_hash, first_hash + len(PROMPT) // BLOCK))
    batch = KvBatch(0.0, (BlockStored(hashes, None, PROMPT, BLOCK),))
    command = IngestKvBatch(worker_id, 0, None, batch, max_index_blocks=system.max_index_blocks_per_scope)
    decision, lsn = await system.apply(ScopeKey(scope["model_name"], scope["tenant_id"]), command)
    assert isinstance(decision, Accepted) and lsn > system.journal.durable_lsn


async def kv_service(nursery: trio.Nursery, journal: GatedJournal) -> tuple[ASGIApp, ActorSystem]:
    app, system = await service_app(nursery, select_service_builder(RouterConfig()), journal)
    for worker_id in (1, 2):
        assert (await durable_call(app, journal, "POST", "/workers", kv_worker(worker_id, A))).status == 201
    return app, system


async def test_reads_during_kv_ingest_do_not_wait_for_the_kv_events_fsync(
    autojump_clock: trio.abc.Clock, nursery: trio.Nursery
) -> None:
    journal = GatedJournal()
    app, system = await kv_service(nursery, journal)
    await kv_events(system, 2, A, 100)  # the scope's last record, and the journal's, is a KV record not yet durable
    with trio.fail_after(1):  # virtual time: answered at once, no fsync awaited
        selected = await call(app, "POST", "/select", {**A, "token_ids": PROMPT})
        scores = await call(app, "POST", "/overlap_scores", {**A, "token_ids": PROMPT})
        loads = await call(app, "GET", "/loads")
        in_b = await call(app, "POST", "/select", {**B, "token_ids": PROMPT})  # no such scope: service-wide barrier
    assert (selected.status, selected.body["worker_id"], selected.body["overlap"]["gpu"]) == (200, 2, 16)
    assert scores.status == 200 and loads.status == 200 and in_b.status == 503  # (no worker there)


async def test_a_selection_still_waits_for_a_write_that_kv_events_followed(
    autojump_clock: trio.abc.Clock, nursery: trio.Nursery
) -> None:
    journal = GatedJournal()
    app, system = await kv_service(nursery, journal)
    booking = await pending(
        app, nursery, "POST", "/select_and_reserve", {**A, "token_ids": PROMPT, "reservation_id": "r"}
    )
    assert booking == []  # journaled, not yet durable
    booked_lsn = system.journal.last_lsn
    await kv_events(system, 1, A, 100)  # then the workers' KV events: the last records, also not durable
    await kv_events(system, 2, A, 200)
    selected = await pending(app, nursery, "POST", "/select", {**A, "token_ids": PROMPT})
    loads = await pending(app, nursery, "GET", "/loads")
    assert selected == [] and loads == []  # they would show the booking's load: a crash could still undo it
    journal.release(upto=booked_lsn)  # the booking is durable; the KV records still are not
    await trio.testing.wait_all_tasks_blocked()
    assert booking[0].status == 200 and selected[0].status == 200 and loads[0].status == 200
    booked = booking[0].body["worker_id"]
    assert [row["active_requests"] for row in loads[0].body[0]["loads"] if row["worker_id"] == booked] == [1]


async def test_a_selection_waits_for_the_registration_of_a_worker_it_could_pick(
    autojump_clock: trio.abc.Clock, nursery: trio.Nursery
) -> None:
    journal = GatedJournal()
    app, system = await kv_service(nursery, journal)
    registered = await pending(app, nursery, "POST", "/workers", kv_worker(3, B))
    assert registered == []
    created_lsn = system.journal.last_lsn
    await kv_events(system, 3, B, 300)
    await kv_events(system, 1, A, 100)
    selected = await pending(app, nursery, "POST", "/select", {**B, "token_ids": PROMPT})
    assert selected == []  # worker 3 is not durable yet
    journal.release(upto=created_lsn)
    await trio.testing.wait_all_tasks_blocked()
    assert registered[0].status == 201
    assert (selected[0].status, selected[0].body["worker_id"], selected[0].body["overlap"]["gpu"]) == (200, 3, 16)


async def test_kv_ingest_waits_for_no_fsync_and_asks_the_journal_for_none(
    autojump_clock: trio.abc.Clock, nursery: trio.Nursery
) -> None:
    # A listener's group is applied and the listener goes on while the records are not durable, and nobody is
    # left waiting for them either: the journal sees no durability callback, so a FileJournal under ``always``
    # may hold a flood's records back and fsync several runs at once (it fsynced each run alone before).
    journal = GatedJournal()
    _, system = await kv_service(nursery, journal)
    before = journal.last_lsn
    key = ListenerKey(ScopeKey(A["model_name"], A["tenant_id"]), WorkerRank(1, 0), "tcp://127.0.0.1:1", None)
    hashes = [(seq + 1) * 10 for seq in range(3)]
    group = [(seq, encode_batch([BlockStored((h,), None, PROMPT[:BLOCK], BLOCK)])) for seq, h in enumerate(hashes)]
    with trio.fail_after(1):  # virtual time: returns without any fsync
        await KvIngest(system).consumer(key)(group)
    assert journal.last_lsn == before + 1 and journal.durable_lsn == before  # one run, applied, not durable
    assert journal.pending_callbacks() == 0


class ActorSteps(trio.abc.Instrument):
    """Counts the steps taken by scope actors' own tasks."""

    def __init__(self) -> None:
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if getattr(task.coro, "cr_code", None) is ScopeActor.run.__code__:
            self.steps += 1


def kv_group(first_seq: int, count: int) -> list[tuple[int, bytes]]:
    """``count`` one-block batches from ``first_seq`` on, as a listener hands them over."""
    return [
        (seq, encode_batch([BlockStored(((seq + 1) * 10,), None, PROMPT[:BLOCK], BLOCK)]))
        for seq in range(first_seq, first_seq + count)
    ]


async def test_a_kv_run_for_an_idle_actor_is_applied_in_the_listeners_task(
    autojump_clock: trio.abc.Clock, nursery: trio.Nursery
) -> None:
    # The actor waits on an empty mailbox: the run is applied as its turn would apply it, without a step of its
    # task (handing it over and being woken back cost two task steps a run).
    journal = GatedJournal()
    _, system = await kv_service(nursery, journal)
    await trio.testing.wait_all_tasks_blocked()
    before = journal.last_lsn
    key = ListenerKey(ScopeKey(A["model_name"], A["tenant_id"]), WorkerRank(1, 0), "tcp://127.0.0.1:1", None)
    steps = ActorSteps()
    trio.lowlevel.add_instrument(steps)
    try:
        await KvIngest(system).consumer(key)(kv_group(0, 3))
    finally:
        trio.lowlevel.remove_instrument(steps)
    assert journal.last_lsn == before + 1 and steps.steps == 0
    assert system.states()[0].selection.kv_watermarks[WorkerRank(1, 0)] == 2
