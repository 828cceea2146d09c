"""An asyncio event loop on a thread of its own, driven from trio: for clients that exist only for asyncio (nats-py).

Why a thread and not an adapter in the trio loop: nats-py is asyncio-only, and in places it swallows the
cancellation of its own tasks, so it cannot share a loop with trio's structured cancellation. Here it runs on a loop
nobody else uses; trio crosses to it once per *batch* (a fetch, a publish of a group of records, a flush of
acknowledgements), never once per message:

* ``AsyncioThread.call(fn, *args)`` runs the coroutine ``fn(*args)`` on the loop and waits for it in trio. The
  asyncio side wakes trio with ``TrioToken.run_sync_soon`` (public, thread-safe). A trio cancellation asks the
  coroutine to stop and returns at once without waiting for it: nothing in trio ever waits on nats-py's cancellation.
  Callers that must not be cancelled halfway (a journal publish) shield the call and bound the coroutine with a
  timeout of its own on the asyncio side.
* ``AsyncioThread.call_blocking(fn, *args, timeout=...)`` is the same from a plain thread (or from trio at startup,
  where blocking is allowed): the journal's synchronous ``read``.

It lives in the journal package (the generic log's JetStream backend needs it, and the journal imports nothing from
the shell); the fleet's NATS event plane uses it too (``actors/fleet/asyncio_bridge``).
``AsyncioThread.stop`` stops the loop and joins the thread; anything still scheduled there is dropped with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

import trio

T = TypeVar("T")

# How long ``stop`` gives the loop's own shutdown (closing its connections) before it leaves the thread behind.
STOP_TIMEOUT_SECONDS: Final = 5.0


class AsyncioThread:
    def __init__(self, name: str) -> None:
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    async def start(self) -> None:
        await trio.to_thread.run_sync(self.start_blocking)

    def start_blocking(self) -> None:
        """``start`` for synchronous callers (a journal opened in a worker thread, as the file journal is)."""
        ready = threading.Event()

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            ready.set()
            try:
                loop.run_forever()
            finally:
                with contextlib.suppress(Exception):
                    pending = asyncio.all_tasks(loop)
                    for task in pending:
                        task.cancel()
                    loop.run_until_complete(asyncio.wait(pending, timeout=1.0) if pending else asyncio.sleep(0))
                loop.close()
                self._stopped.set()

        self._thread = threading.Thread(target=serve, name=self._name, daemon=True)
        self._thread.start()
        ready.wait()

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` on the asyncio loop; its result or exception here."""
        loop = self._loop
        if loop is None or self._stopped.is_set():
            raise RuntimeError(f"{self._name}: the asyncio thread is not running")
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()

        def wake(_: object) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

        future = asyncio.run_coroutine_threadsafe(_awaited(fn, args), loop)
        future.add_done_callback(wake)
        try:
            await done.wait()
        except BaseException:
            future.cancel()  # asked, not awaited (see the module doc)
            raise
        return future.result()

    def call_blocking(self, fn: Callable[..., Awaitable[T]], *args: Any, timeout: float) -> T:
        """Run ``fn(*args)`` on the loop and block this thread for its result (at most ``timeout`` seconds).

        For synchronous callers only (startup, a journal's ``read``): never from the asyncio thread itself."""
        loop = self._loop
        if loop is None or self._stopped.is_set():
            raise RuntimeError(f"{self._name}: the asyncio thread is not running")
        future = asyncio.run_coroutine_threadsafe(_awaited(fn, args), loop)
        try:
            return future.result(timeout)
        except BaseException:  # timed out (or interrupted): asked to stop, not left running on a shared loop
            future.cancel()
            raise

    async def stop(self, before: Callable[[], Awaitable[object]] | None = None) -> None:
        """Run ``before`` on the loop (bounded by ``STOP_TIMEOUT_SECONDS``), then stop the loop and join the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or self._stopped.is_set():
            return
        if before is not None:
            with trio.move_on_after(STOP_TIMEOUT_SECONDS), contextlib.suppress(Exception):
                await self.call(before)
        loop.call_soon_threadsafe(loop.stop)
        await trio.to_thread.run_sync(thread.join, STOP_TIMEOUT_SECONDS, abandon_on_cancel=True)

    def stop_blocking(self) -> None:
        """Stop the loop and join the thread, for synchronous callers (nothing is run on the loop first)."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or self._stopped.is_set():
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(STOP_TIMEOUT_SECONDS)


async def _awaited(fn: Callable[..., Awaitable[T]], args: tuple[Any, ...]) -> T:
    return await fn(*args)
