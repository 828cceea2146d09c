"""The in-process router from asyncio code and from plain threads: the router's trio loop on a thread of
its own, calls carried in and out, bookings journaled across a restart, and nothing left running."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import trio

from kvrouter import IN_PROCESS_KV_EVENTS, AsyncioRouter, BlockingRouter, BlockStored, RouterClosed, RouterError
from kvrouter.api.embedded_thread import _start as start_router_thread
from kvrouter.journal.store import DataDirectoryInUse

BLOCK = 4
PROMPT = list(range(1, 17))
ROUTER_THREADS = ("kvrouter-router", "kvrouter-journal-io")


def worker(worker_id: int) -> dict[str, Any]:
    return {"endpoint": f"http://w{worker_id}", "block_size": BLOCK, "kv_events_endpoint": IN_PROCESS_KV_EVENTS}


def router_threads(before: set[threading.Thread]) -> list[str]:
    """The router threads started since ``before`` was taken (other tests' may still be ending)."""
    return sorted(t.name for t in threading.enumerate() if t not in before and t.name.startswith(ROUTER_THREADS))


def assert_all_ended(before: set[threading.Thread]) -> None:
    """``close`` has joined the router's own thread; the journal's I/O thread was told to stop and ends on
    its own right after (waited for here, so a thread that never ends fails the test)."""
    assert "kvrouter-router" not in " ".join(router_threads(before))
    for thread in threading.enumerate():
        if thread not in before and thread.name.startswith(ROUTER_THREADS):
            thread.join(timeout=10)
    assert router_threads(before) == []


def warm_prefix() -> list[BlockStored]:
    return [BlockStored((501, 502, 503), None, tuple(PROMPT[:12]), BLOCK)]


def test_from_asyncio_concurrent_calls_book_each_request_once() -> None:
    before = set(threading.enumerate())

    async def main() -> None:
        router = await AsyncioRouter.start("llama", seed=3)
        async with router:
            assert router_threads(before) == ["kvrouter-router llama"]
            for worker_id in (1, 2):
                await router.register_worker(worker_id, **worker(worker_id))
            await router.apply_kv_events(2, warm_prefix())
            assert await router.best_worker(PROMPT) == (2, 0, 3)

            chosen = await asyncio.gather(*(router.best_worker(PROMPT, None, f"req-{n}") for n in range(20)))
            assert all(worker_id in (1, 2) for worker_id, _, _ in chosen)
            loads = await router.get_potential_loads(PROMPT)
            assert sum(row["active_requests"] for row in loads) == 20
            # The same id from two tasks at once: booked once, refused once (409), as over HTTP.
            twice = await asyncio.gather(
                *(router.best_worker(PROMPT, None, "dup") for _ in range(2)), return_exceptions=True
            )
            refused = [r for r in twice if isinstance(r, RouterError)]
            assert len(refused) == 1 and refused[0].status == 409
            await asyncio.gather(*(router.mark_prefill_complete(f"req-{n}") for n in range(20)))
            await asyncio.gather(*(router.free(request_id) for request_id in [f"req-{n}" for n in range(20)] + ["dup"]))
            assert sum(row["active_requests"] for row in await router.get_potential_loads(PROMPT)) == 0
            with pytest.raises(RouterError) as gone:
                await router.free("dup")
            assert (gone.value.status, gone.value.message) == (404, "reservation dup not found")
        assert_all_ended(before)
        with pytest.raises(RouterClosed) as closed:
            await router.best_worker(PROMPT)
        assert closed.value.status == 503

    asyncio.run(main())


def test_cancelling_an_asyncio_call_cancels_its_task_in_the_router_loop() -> None:
    before = set(threading.enumerate())
    host = start_router_thread("llama", {})
    running, cancelled = threading.Event(), threading.Event()

    async def waits_forever() -> None:
        running.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            cancelled.set()
            raise

    async def main() -> None:
        call = asyncio.ensure_future(host.call(waits_forever))
        assert await asyncio.to_thread(running.wait, 10)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert await asyncio.to_thread(cancelled.wait, 10)

    try:
        asyncio.run(main())
    finally:
        host.close()
    assert_all_ended(before)


def test_from_plain_threads_with_a_journal_a_restart_keeps_the_bookings(tmp_path: Path) -> None:
    data = tmp_path / "router"
    before = set(threading.enumerate())
    with BlockingRouter("llama", data_dir=data, seed=3) as router:
        for worker_id in (1, 2):
            router.register_worker(worker_id, **worker(worker_id))
        assert router_threads(before) == ["kvrouter-journal-io", "kvrouter-router llama"]  # (it writes)
        router.apply_kv_events(2, warm_prefix())

        def client(thread: int) -> list[str]:
            """Book ten requests, finish the even ones; returns the ids still booked."""
            kept = []
            for n in range(10):
                request_id = f"t{thread}-{n}"
                worker_id, dp_rank, _ = router.best_worker(PROMPT, request_id=request_id)
                assert (worker_id, dp_rank) in ((1, 0), (2, 0))
                router.mark_prefill_complete(request_id)
                if n % 2 == 0:
                    router.free(request_id)
                else:
                    kept.append(request_id)
            return kept

        with ThreadPoolExecutor(4) as pool:
            kept = [request_id for ids in pool.map(client, range(4)) for request_id in ids]
        assert len(kept) == 20
        with pytest.raises(DataDirectoryInUse):
            BlockingRouter("llama", data_dir=data)
        assert router_threads(before) == ["kvrouter-journal-io", "kvrouter-router llama"]
    assert_all_ended(before)

    with BlockingRouter("llama", data_dir=data) as restarted:
        assert sum(row["active_requests"] for row in restarted.get_potential_loads(PROMPT)) == 20
        assert restarted.best_worker(PROMPT, allowed_worker_ids=[2]) == (2, 0, 3)  # the index came back too
        for request_id in kept:
            restarted.free(request_id)
        assert sum(row["active_requests"] for row in restarted.get_potential_loads(PROMPT)) == 0
        assert '"worker_id":2' in restarted.dump_events()
    assert_all_ended(before)


def test_a_closed_router_refuses_calls_and_a_bad_option_fails_at_start() -> None:
    before = set(threading.enumerate())
    router = BlockingRouter("llama")
    router.close()
    router.close()  # idempotent
    with pytest.raises(RouterClosed, match="the router is closed"):
        router.workers()
    with pytest.raises(TypeError, match="no_such_option"):
        BlockingRouter("llama", no_such_option=1)
    assert_all_ended(before)
