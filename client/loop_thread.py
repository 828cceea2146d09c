"""One trio loop on a thread of its own, hosting one resource, with calls carried in from other threads and
from asyncio: the bridge behind both the threaded clients (``client/threaded.py``) and the embedded router's
asyncio and blocking faces (``api/embedded_thread.py``).

The resource (a connected ``StreamClient``, an open ``Router``) is opened by an async context manager inside
``trio.run`` on the thread, and never leaves that loop, so nothing needs a lock. Each call becomes a task of
the loop (handed over with ``TrioToken.run_sync_soon``); its outcome comes back through a
``concurrent.futures.Future`` (``call_blocking``, any thread) or an asyncio future (``call``, the running asyncio
loop). An asyncio caller that is cancelled cancels its task in the loop.

Closing either lets the calls in flight finish (``finish_on_close``: a router's bookings are made whole) or
cancels them (a client's stream is going away anyway), then closes the resource and joins the thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Generic, TypeVar

import outcome
import trio

R = TypeVar("R")
T = TypeVar("T")
Deliver = Callable[[outcome.Outcome[Any]], None]


class LoopThread(Generic[R]):
    """``resource``, opened by ``open_resource()`` on a trio loop of its own thread; ``call`` / ``call_blocking``
    reach it. ``closed_error(why)`` is what a call meets once the loop no longer takes calls: ``why`` is
    "closed", "stopped while the call was in flight" or "stopped: <what stopped the loop>"."""

    def __init__(
        self,
        open_resource: Callable[[], AbstractAsyncContextManager[R]],
        *,
        name: str,
        closed_error: Callable[[str], Exception],
        finish_on_close: bool,
    ) -> None:
        """Start the thread and wait until the resource is open; a failure to open it is raised here."""
        self._closed_error = closed_error
        self._finish_on_close = finish_on_close
        self._started: concurrent.futures.Future[tuple[R, trio.lowlevel.TrioToken]] = concurrent.futures.Future()
        self._finished: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._accepting = False  # read and written on the loop's thread only
        self._calls: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self._closed = False
        self.thread = threading.Thread(target=self._main, args=(open_resource,), name=name, daemon=True)
        self.thread.start()
        try:
            self.resource, self._token = self._started.result()
        except BaseException:
            self.thread.join()
            raise

    # -- the loop's thread ----------------------------------------------------------------------------

    def _main(self, open_resource: Callable[[], AbstractAsyncContextManager[R]]) -> None:
        try:
            trio.run(self._serve, open_resource)
        except BaseException as exc:
            (self._finished if self._started.done() else self._started).set_exception(exc)
        else:
            self._finished.set_result(None)

    async def _serve(self, open_resource: Callable[[], AbstractAsyncContextManager[R]]) -> None:
        async with open_resource() as resource, trio.open_nursery() as calls:
            self._calls, self._stop, self._accepting = calls, trio.Event(), True
            self._started.set_result((resource, trio.lowlevel.current_trio_token()))
            await self._stop.wait()
            self._accepting = False
            if not self._finish_on_close:
                calls.cancel_scope.cancel()

    def _spawn(
        self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...], scope: trio.CancelScope, deliver: Deliver
    ) -> None:
        """On the loop's thread (a ``run_sync_soon`` callback): start the call, or refuse it once closing."""
        if not self._accepting or self._calls is None:
            deliver(outcome.Error(self._closed_error("closed")))
            return
        self._calls.start_soon(self._run_call, fn, args, scope, deliver)

    async def _run_call(
        self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...], scope: trio.CancelScope, deliver: Deliver
    ) -> None:
        """Every caller gets exactly one outcome; only the loop's own end propagates here."""
        try:
            with scope:
                result: outcome.Outcome[Any] = outcome.Value(await fn(*args))
            if scope.cancelled_caught:
                result = outcome.Error(asyncio.CancelledError())  # only an asyncio caller cancels its scope
        except Exception as exc:
            result = outcome.Error(exc)
        except BaseException:
            deliver(outcome.Error(self._closed_error("stopped while the call was in flight")))
            raise
        deliver(result)

    # -- other threads --------------------------------------------------------------------------------

    def _submit(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...], deliver: Deliver) -> trio.CancelScope:
        scope = trio.CancelScope()
        try:
            self._token.run_sync_soon(self._spawn, fn, args, scope, deliver)
        except trio.RunFinishedError:
            failure = self._finished.exception() if self._finished.done() else None
            raise self._closed_error(f"stopped: {failure}" if failure is not None else "closed") from None
        return scope

    def call_blocking(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the loop; block this thread until it ends (never from the loop's own thread, nor
        from an asyncio loop's thread, which it would hold up)."""
        if threading.current_thread() is self.thread:
            raise RuntimeError("a blocking call from the loop's own thread would wait for itself forever")
        done: concurrent.futures.Future[outcome.Outcome[T]] = concurrent.futures.Future()
        self._submit(fn, args, done.set_result)
        result: T = done.result().unwrap()
        return result

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the loop and await it from the running asyncio loop."""
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
        """Stop taking calls, finish or cancel those in flight, close the resource and join the thread. Raises
        what stopped the loop, if something did. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._stop is not None:
            with contextlib.suppress(trio.RunFinishedError):  # it has ended already: raised below
                self._token.run_sync_soon(self._stop.set)
        self.thread.join()
        self._finished.result()

    @property
    def closed(self) -> bool:
        return self._closed
