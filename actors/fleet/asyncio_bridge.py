"""An asyncio event loop on a thread of its own, driven from trio: for clients that exist only for asyncio (nats-py).

Why a thread and not an adapter in the trio loop: nats-py is asyncio-only, and in places it swallows the
cancellation of its own tasks, so it cannot share a loop with trio's structured cancellation. Here it runs on a loop
nobody else uses; trio crosses to it once per *batch* (a fetch, a flush of acknowledgements, a subscription change),
never once per message:

* ``AsyncioThread.call(fn, *args)`` runs the coroutine ``fn(*args)`` on the loop and waits for it in trio. The
  asyncio side wakes trio with ``TrioToken.run_sync_soon`` (public, thread-safe). A trio cancellation asks the
  coroutine to stop and returns at once without waiting for it: nothing in trio ever waits on nats-py's cancellation.
* ``Inbox`` is where asyncio callbacks (one per message) put what they receive: a list bounded in bytes (policy:
  drop the newest, counted; the event plane's sequence numbers then show the gap), taken whole by trio, which is
  woken once when the list stops being empty.

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
        await trio.to_thread.run_sync(ready.wait)

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


async def _awaited(fn: Callable[..., Awaitable[T]], args: tuple[Any, ...]) -> T:
    return await fn(*args)


class Inbox:
    """Messages put by asyncio callbacks, taken in batches by one trio task (see the module doc)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._items: list[bytes] = []
        self._bytes = 0
        self.dropped = 0  # messages refused because the inbox was full
        self._token: trio.lowlevel.TrioToken | None = None
        self._nonempty = trio.Event()

    def bind(self) -> None:
        """Called from trio before any ``put``: where to send wake-ups."""
        self._token = trio.lowlevel.current_trio_token()

    def put(self, data: bytes) -> None:
        """From the asyncio thread: queue ``data``, or drop it when full. Never blocks on trio."""
        with self._lock:
            if self._bytes + len(data) > self.max_bytes and self._items:
                self.dropped += 1
                return
            self._items.append(data)
            self._bytes += len(data)
            wake = self._nonempty if len(self._items) == 1 else None
        if wake is not None and self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(wake.set)

    async def take(self) -> list[bytes]:
        """Everything queued, once something is."""
        while True:
            with self._lock:
                if self._items:
                    items, self._items, self._bytes = self._items, [], 0
                    return items
                if self._nonempty.is_set():  # a wake-up for items taken already
                    self._nonempty = trio.Event()
                nonempty = self._nonempty
            await nonempty.wait()
