"""Replica sync with a live Dynamo 1.6.1 slot tracker, peered both ways with a kvrouter replica.

Optional: runs only when the reference is importable in the Python named by KVROUTER_REFERENCE_PYTHON
(or in this one). The reference binds 0.0.0.0; the test only ever talks to 127.0.0.1.
"""

from __future__ import annotations

import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest
import trio

from kvrouter.actors.core.commands import AddRequest, CompletePrefill, FreeRequest, RegisterWorker
from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.peers.replicator import Replicator, random_router_id
from kvrouter.actors.ports import WallClock
from kvrouter.actors.system import ActorSystem
from kvrouter.journal.memory import MemoryJournal
from tests.support.kv_publisher import free_tcp_port
from tests.support.processes import require_reference

pytestmark = pytest.mark.conformance


REFERENCE = require_reference()

SCOPE = ScopeKey("m", "g")  # routing_group "g" on the reference's side
GROUP = {"model_name": "m", "routing_group": "g"}
WORKER = 7
ATTEMPT = 0.3  # how long one slow-joiner attempt waits before trying again


async def within(seconds: float, check: Callable[[], Awaitable[bool]]) -> bool:
    with trio.move_on_after(seconds):
        while not await check():  # noqa: ASYNC110 - polling another process over HTTP
            await trio.sleep(0.01)
        return True
    return False


async def eventually(check: Callable[[], Awaitable[bool]]) -> None:
    assert await within(10, check), "condition not reached in time"


async def start_reference(argv: list[str], http_port: int, log: Path) -> trio.Process:
    with log.open("wb") as stderr:  # a file, not a pipe: an unread pipe would stall the reference
        process = await trio.lowlevel.open_process(argv, stdout=subprocess.DEVNULL, stderr=stderr)
    async with httpx.AsyncClient(timeout=1) as http:
        with trio.fail_after(30):
            while True:
                try:
                    if (await http.get(f"http://127.0.0.1:{http_port}/health")).status_code == 200:
                        return process
                except httpx.TransportError:
                    pass
                await trio.sleep(0.05)


async def test_replica_sync_with_the_reference(tmp_path: Path) -> None:
    http_port, reference_replica_port, our_port = free_tcp_port(), free_tcp_port(), free_tcp_port()
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            journal = MemoryJournal()
            system = ActorSystem(journal, WallClock(), encode_snapshots_in_thread=False)
            await nursery.start(journal.run)
            await nursery.start(system.run)
            replicator = Replicator(
                system,
                port=our_port,
                peers=[f"tcp://127.0.0.1:{reference_replica_port}"],
                router_id=random_router_id(),
                host="127.0.0.1",
            )
            our_endpoint = await nursery.start(replicator.run)
            reference = await start_reference(
                [
                    REFERENCE,
                    "-m",
                    "dynamo.slot_tracker",
                    "--port",
                    str(http_port),  # type: ignore[list-item]
                    "--replica-sync-port",
                    str(reference_replica_port),
                    "--replica-sync-peers",
                    our_endpoint,
                ],
                http_port,
                tmp_path / "reference.log",
            )
            try:
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=10) as http:
                    await exchange(http, system, replicator, our_endpoint)
            finally:
                reference.kill()
                await reference.wait()
            nursery.cancel_scope.cancel()


async def exchange(http: httpx.AsyncClient, system: ActorSystem, replicator: Replicator, our_endpoint: str) -> None:
    assert (await http.get("/replica_sync/peers")).json() == [our_endpoint]
    registered = await http.post(
        "/register", json={**GROUP, "worker_id": WORKER, "block_size": 16, "dp_start": 0, "dp_size": 2}
    )
    assert registered.status_code == 201
    await system.ask(SCOPE, RegisterWorker(WORKER, block_size=16, dp_start=0, dp_size=2))

    def ours() -> dict:
        state = system.state(SCOPE)
        return dict(state.requests) if state is not None else {}

    # Reference -> kvrouter. Retry the first admission until kvrouter's SUB is live (slow joiner).
    for attempt in range(100):
        request_id = f"ref-{attempt}"
        body = {
            **GROUP,
            "request_id": request_id,
            "worker_id": WORKER,
            "dp_rank": 1,
            "sequence_hashes": [1, 2, -1],
            "new_isl_tokens": 12,
        }
        assert (await http.post("/add", json=body)).status_code == 201

        async def seen(r: str = request_id) -> bool:
            return r in ours()

        if await within(ATTEMPT, seen):
            break
        assert (await http.post("/free", json={**GROUP, "request_id": request_id})).status_code == 200
    else:
        raise AssertionError("kvrouter never heard the reference")
    # An attempt kvrouter's SUB missed was freed on the reference, and that free may have been heard (the SUB went
    # live in between): a free of a request kvrouter never saw, dropped as unknown. Nothing else may be dropped.
    joining = dict(replicator.stats.dropped)
    assert set(joining) <= {"unknown_request"} and joining.get("unknown_request", 0) <= attempt
    request = ours()[request_id]
    assert (request.rank, request.sequence_hashes) == (WorkerRank(WORKER, 1), (1, 2, 2**64 - 1))
    rank = system.state(SCOPE).ranks[WorkerRank(WORKER, 1)]  # type: ignore[union-attr]
    assert (rank.prefill_tokens, rank.active_decode_blocks) == (12, 3)

    async def prefill_done() -> bool:
        return rank.prefill_tokens == 0

    async def freed() -> bool:
        return request_id not in ours()

    assert (await http.post("/prefill_complete", json={**GROUP, "request_id": request_id})).status_code == 200
    await eventually(prefill_done)
    assert (await http.post("/free", json={**GROUP, "request_id": request_id})).status_code == 200
    await eventually(freed)

    # kvrouter -> reference, read back through the reference's /loads.
    async def load(dp_rank: int) -> tuple[int, int]:
        rows = (await http.get("/loads", params=GROUP)).json()
        row = next(r for r in rows if (r["worker_id"], r["dp_rank"]) == (WORKER, dp_rank))
        return row["active_prefill_tokens"], row["active_decode_blocks"]

    def load_is(expected: tuple[int, int]) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            return await load(0) == expected

        return check

    for attempt in range(100):
        request_id = f"kv-{attempt}"
        await system.ask(SCOPE, AddRequest(request_id, WORKER, 0, (4, 5, 2**64 - 1), 7, at=WallClock().now_ns()))
        if await within(ATTEMPT, load_is((7, 3))):
            break
        await system.ask(SCOPE, FreeRequest(request_id))
        await eventually(load_is((0, 0)))  # in case the free is heard but the add was not
    else:
        raise AssertionError("the reference never heard kvrouter")
    await system.ask(SCOPE, CompletePrefill(request_id))
    await eventually(load_is((0, 3)))
    # The reference knows the request (with the right rank) by the id kvrouter published.
    duplicate = await http.post(
        "/add", json={**GROUP, "request_id": request_id, "worker_id": WORKER, "dp_rank": 1, "sequence_hashes": []}
    )
    assert duplicate.json() == {
        "error": f"Request {request_id} already exists (assigned to worker "
        f"WorkerWithDpRank {{ worker_id: {WORKER}, dp_rank: 0 }})"
    }
    await system.ask(SCOPE, FreeRequest(request_id))
    await eventually(load_is((0, 0)))

    # Neither side echoes: the reference never sent kvrouter's events back, and nothing was dropped.
    await trio.sleep(ATTEMPT)
    assert replicator.stats.dropped == joining
