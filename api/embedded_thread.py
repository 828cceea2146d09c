"""The in-process router for asyncio code and plain threads: one trio loop on a thread of its own.

``RouterThread`` runs ``Router.open`` inside ``trio.run`` on a dedicated thread and carries calls into it:
each call becomes a task of that loop (handed over with ``TrioToken.run_sync_soon``), and its outcome comes
back through an asyncio future (``AsyncioRouter``, for asyncio loops such as Ray Serve's) or a
``concurrent.futures.Future`` (``BlockingRouter``, for any thread). The router's actors, journal and KV
listeners never leave that loop, so there is no locking anywhere.

Closing stops taking calls, lets the ones in flight finish, closes the router (actors, journal flushed and
closed, listeners) and joins the thread. A call cancelled on the asyncio side cancels its task in the
loop; like an HTTP request whose client went away, a booking it had already made stays made.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import outcome
import trio

from kvrouter.actors.core.kv_wire import KvBatch, KvEvent
from kvrouter.api.embedded import Router, RouterClosed

T = TypeVar("T")
Deliver = Callable[[outcome.Outcome[Any]], None]


class RouterThread:
    """A ``Router`` on its own trio loop and thread; ``call`` (asyncio) and ``call_blocking`` reach it."""

    def __init__(self, model_name: str = "default", **options: Any) -> None:
        """Start the thread and wait until the router is open (the journal recovered); a failure to open
        (a data directory in use, a corrupt journal, an unknown option) is raised here."""
        self._started: concurrent.futures.Future[tuple[Router, trio.lowlevel.TrioToken]] = concurrent.futures.Future()
        self._finished: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._accepting = False  # read and written on the loop's thread only
        self._calls: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._closed = False
        self._thread = threading.Thread(
            target=self._main, args=(model_name, options), name=f"kvrouter-router {model_name}", daemon=True
        )
        self._thread.start()
        try:
            self.router, self._token = self._started.result()
        except BaseException:
            self._thread.join()
            raise

    # -- the loop's thread ----------------------------------------------------------------------------

    def _main(self, model_name: str, options: dict[str, Any]) -> None:
        try:
            trio.run(self._serve, model_name, options)
        except BaseException as exc:
            (self._finished if self._started.done() else self._started).set_exception(exc)
        else:
            self._finished.set_result(None)

    async def _serve(self, model_name: str, options: dict[str, Any]) -> None:
        async with Router.open(model_name, **options) as router, trio.open_nursery() as calls:
            self._calls, self._stop, self._accepting = calls, trio.Event(), True
            self._started.set_result((router, trio.lowlevel.current_trio_token()))
            await self._stop.wait()
            self._accepting = False  # the calls in flight finish; the router closes after them

    def _spawn(
        self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...], scope: trio.CancelScope, deliver: Deliver
    ) -> None:
        """On the loop's thread (a ``run_sync_soon`` callback): start the call, or refuse it once closing."""
        if not self._accepting or self._calls is None:
            deliver(outcome.Error(RouterClosed()))
            return
        self._calls.start_soon(self._run_call, fn, args, scope, deliver)

    async def _run_call(
        self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...], scope: trio.CancelScope, deliver: Deliver
    ) -> None:
        """Every caller gets exactly one outcome; only the loop's own end (a crash) propagates here."""
        try:
            with scope:
                result: outcome.Outcome[Any] = outcome.Value(await fn(*args))
            if scope.cancelled_caught:
                result = outcome.Error(asyncio.CancelledError())  # only the asyncio caller cancels it
        except Exception as exc:
            result = outcome.Error(exc)
        except BaseException:
            deliver(outcome.Error(RouterClosed("the router stopped while the call was in flight")))
            raise
        deliver(result)

    # -- other threads --------------------------------------------------------------------------------

    def _submit(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...], deliver: Deliver) -> trio.CancelScope:
        scope = trio.CancelScope()
        try:
            self._token.run_sync_soon(self._spawn, fn, args, scope, deliver)
        except trio.RunFinishedError:
            raise self._ended() from None
        return scope

    def _ended(self) -> RouterClosed:
        failure = self._finished.exception() if self._finished.done() else None
        return RouterClosed(f"the router stopped: {failure}") if failure is not None else RouterClosed()

    def call_blocking(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the router's loop; block this thread until it ends (never call this on the
        loop's own thread, or on an asyncio loop's thread, which it would hold up)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("a blocking router call from the router's own loop would wait for itself forever")
        done: concurrent.futures.Future[outcome.Outcome[T]] = concurrent.futures.Future()
        self._submit(fn, args, done.set_result)
        result: T = done.result().unwrap()
        return result

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the router's loop and await it from the running asyncio loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[outcome.Outcome[T]] = loop.create_future()

        def settle(result: outcome.Outcome[T]) -> None:
            if not future.done():  # cancelled meanwhile
                future.set_result(result)

        def deliver(result: outcome.Outcome[T]) -> None:
            with contextlib.suppress(RuntimeError):  # the asyncio loop is closed: nobody is waiting any more
                loop.call_soon_threadsafe(settle, result)

        scope = self._submit(fn, args, deliver)
        try:
            result = await future
        except asyncio.CancelledError:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(scope.cancel)
            raise
        value: T = result.unwrap()
        return value

    def close(self) -> None:
        """Stop taking calls, let those in flight finish, close the router and join the thread. Raises
        what stopped the loop, if something did (a journal that could not be written). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._stop is not None:
            with contextlib.suppress(trio.RunFinishedError):  # it has ended already (failed): raised below
                self._token.run_sync_soon(self._stop.set)
        self._thread.join()
        self._finished.result()

    @property
    def closed(self) -> bool:
        return self._closed


class BlockingRouter:
    """The in-process router for plain threads: the methods of ``Router``, blocking until they are done.

    ``BlockingRouter(model_name, **options)`` takes ``Router.open``'s options and starts the router on a
    thread of its own; any thread may call it, concurrently. Close it with ``close()`` or a ``with`` block.
    """

    def __init__(self, model_name: str = "default", **options: Any) -> None:
        self._host = RouterThread(model_name, **options)
        self.scope = self._host.router.scope

    def __enter__(self) -> BlockingRouter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._host.close()

    def register_worker(self, worker_id: int, **fields: Any) -> dict[str, Any]:
        return self._host.call_blocking(lambda: self._host.router.register_worker(worker_id, **fields))

    def unregister_worker(self, worker_id: int) -> dict[str, Any]:
        return self._host.call_blocking(self._host.router.unregister_worker, worker_id)

    def workers(self) -> list[dict[str, Any]]:
        return self._host.call_blocking(self._host.router.workers)

    def apply_kv_events(
        self, worker_id: int, batch: bytes | KvBatch | Sequence[KvEvent], *, dp_rank: int = 0, seq: int | None = None
    ) -> None:
        return self._host.call_blocking(
            lambda: self._host.router.apply_kv_events(worker_id, batch, dp_rank=dp_rank, seq=seq)
        )

    def best_worker(
        self,
        token_ids: Sequence[int],
        router_config_override: dict[str, Any] | None = None,
        request_id: str | None = None,
        **selection: Any,
    ) -> tuple[int, int, int]:
        router = self._host.router
        return self._host.call_blocking(
            lambda: router.best_worker(token_ids, router_config_override, request_id, **selection)
        )

    def select_disaggregated(
        self,
        token_ids: Sequence[int],
        request_id: str,
        router_config_override: dict[str, Any] | None = None,
        **selection: Any,
    ) -> dict[str, Any]:
        router = self._host.router
        return self._host.call_blocking(
            lambda: router.select_disaggregated(token_ids, request_id, router_config_override, **selection)
        )

    def get_potential_loads(
        self, token_ids: Sequence[int], router_config_override: dict[str, Any] | None = None
    ) -> list[dict[str, Any]]:
        return self._host.call_blocking(self._host.router.get_potential_loads, token_ids, router_config_override)

    def mark_prefill_complete(self, request_id: str) -> None:
        return self._host.call_blocking(self._host.router.mark_prefill_complete, request_id)

    def add_output_block(self, request_id: str, decay_fraction: float | None = None) -> None:
        return self._host.call_blocking(self._host.router.add_output_block, request_id, decay_fraction)

    def free(self, request_id: str) -> None:
        return self._host.call_blocking(self._host.router.free, request_id)

    def dump_events(self) -> str:
        return self._host.call_blocking(self._host.router.dump_events)


class AsyncioRouter:
    """The in-process router for asyncio code (Ray Serve deployments included): ``Router``'s methods as
    coroutines of the running asyncio loop.

    ``AsyncioRouter(model_name, **options)`` takes ``Router.open``'s options and starts the router on a
    thread of its own, waiting until it is open (fine in a deployment's ``__init__``); ``await
    AsyncioRouter.start(...)`` does the same without holding up the asyncio loop. Close it with
    ``await router.aclose()`` or an ``async with`` block.
    """

    def __init__(self, model_name: str = "default", **options: Any) -> None:
        self._host = RouterThread(model_name, **options)
        self.scope = self._host.router.scope

    @classmethod
    async def start(cls, model_name: str = "default", **options: Any) -> AsyncioRouter:
        return await asyncio.to_thread(lambda: cls(model_name, **options))

    async def __aenter__(self) -> AsyncioRouter:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await asyncio.to_thread(self._host.close)

    def close(self) -> None:
        """``aclose`` for code outside the asyncio loop (it blocks until the router has closed)."""
        self._host.close()

    async def register_worker(self, worker_id: int, **fields: Any) -> dict[str, Any]:
        return await self._host.call(lambda: self._host.router.register_worker(worker_id, **fields))

    async def unregister_worker(self, worker_id: int) -> dict[str, Any]:
        return await self._host.call(self._host.router.unregister_worker, worker_id)

    async def workers(self) -> list[dict[str, Any]]:
        return await self._host.call(self._host.router.workers)

    async def apply_kv_events(
        self, worker_id: int, batch: bytes | KvBatch | Sequence[KvEvent], *, dp_rank: int = 0, seq: int | None = None
    ) -> None:
        return await self._host.call(
            lambda: self._host.router.apply_kv_events(worker_id, batch, dp_rank=dp_rank, seq=seq)
        )

    async def best_worker(
        self,
        token_ids: Sequence[int],
        router_config_override: dict[str, Any] | None = None,
        request_id: str | None = None,
        **selection: Any,
    ) -> tuple[int, int, int]:
        router = self._host.router
        return await self._host.call(
            lambda: router.best_worker(token_ids, router_config_override, request_id, **selection)
        )

    async def select_disaggregated(
        self,
        token_ids: Sequence[int],
        request_id: str,
        router_config_override: dict[str, Any] | None = None,
        **selection: Any,
    ) -> dict[str, Any]:
        router = self._host.router
        return await self._host.call(
            lambda: router.select_disaggregated(token_ids, request_id, router_config_override, **selection)
        )

    async def get_potential_loads(
        self, token_ids: Sequence[int], router_config_override: dict[str, Any] | None = None
    ) -> list[dict[str, Any]]:
        return await self._host.call(self._host.router.get_potential_loads, token_ids, router_config_override)

    async def mark_prefill_complete(self, request_id: str) -> None:
        return await self._host.call(self._host.router.mark_prefill_complete, request_id)

    async def add_output_block(self, request_id: str, decay_fraction: float | None = None) -> None:
        return await self._host.call(self._host.router.add_output_block, request_id, decay_fraction)

    async def free(self, request_id: str) -> None:
        return await self._host.call(self._host.router.free, request_id)

    async def dump_events(self) -> str:
        return await self._host.call(self._host.router.dump_events)
