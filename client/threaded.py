"""The client for plain threads (``BlockingClient``) and asyncio (``AsyncioClient``).

Both run the trio ``StreamClient`` on a loop of its own, on a thread of its own, and carry each call
into it (``TrioToken.run_sync_soon`` starts it as a task there); the outcome comes back through a
``concurrent.futures.Future`` (threads) or an asyncio future. Why not a second implementation on asyncio:
the protocol (coalescing, id matching, the in-flight bound) then exists once, on trio-websocket, which
kvrouter already depends on, and asyncio has no WebSocket client of its own. The price is one thread hop
per call, which batching amortises: calls made concurrently from many threads or asyncio tasks go out
together in the same message.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

from kvrouter.client.operations import Op, Operations, StreamClosed
from kvrouter.client.stream import CONNECT_SECONDS, MAX_IN_FLIGHT, StreamClient

T = TypeVar("T")
Deliver = Callable[[outcome.Outcome[Any]], None]


class ClientThread:
    """A ``StreamClient`` connected on its own trio loop and thread."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        max_in_flight: int = MAX_IN_FLIGHT,
        connect_timeout: float | None = CONNECT_SECONDS,
        compact: bool = True,
    ) -> None:
        """Connect (raises ``StreamClosed`` if the service refuses, ``OSError`` if it cannot be reached,
        ``TimeoutError`` if it does not answer the upgrade within ``connect_timeout`` seconds)."""
        started: concurrent.futures.Future[tuple[StreamClient, trio.lowlevel.TrioToken]] = concurrent.futures.Future()
        self._finished: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._stop: trio.Event | None = None
        self._calls: trio.Nursery | None = None
        self._thread = threading.Thread(
            target=self._main,
            args=(url, token, max_in_flight, connect_timeout, compact, started),
            name="kvrouter-client",
            daemon=True,
        )
        self._thread.start()
        try:
            self.client, self._token = started.result()
        except BaseException:
            self._thread.join()
            raise

    def _main(
        self,
        url: str,
        token: str | None,
        limit: int,
        timeout: float | None,
        compact: bool,
        started: concurrent.futures.Future[Any],
    ) -> None:
        try:
            trio.run(self._serve, url, token, limit, timeout, compact, started)
        except BaseException as exc:
            (self._finished if started.done() else started).set_exception(exc)
        else:
            self._finished.set_result(None)

    async def _serve(
        self,
        url: str,
        token: str | None,
        limit: int,
        connect_seconds: float | None,
        compact: bool,
        started: concurrent.futures.Future[Any],
    ) -> None:
        connecting = StreamClient.connect(
            url, token=token, max_in_flight=limit, connect_timeout=connect_seconds, compact=compact
        )
        async with connecting as client, trio.open_nursery() as calls:
            self._calls, self._stop = calls, trio.Event()
            started.set_result((client, trio.lowlevel.current_trio_token()))
            await self._stop.wait()
            calls.cancel_scope.cancel()

    def submit(self, op: Op[Any], deliver: Deliver) -> None:
        """Start ``op`` on the client's loop; ``deliver`` gets its outcome (on the loop's thread)."""

        def spawn() -> None:
            if self._calls is None or self._stop is None or self._stop.is_set():
                deliver(outcome.Error(StreamClosed("the client was closed")))
            else:
                self._calls.start_soon(run)

        async def run() -> None:
            try:
                result: outcome.Outcome[Any] = outcome.Value(await self.client.perform(op))
            except Exception as exc:
                result = outcome.Error(exc)
            except BaseException:
                deliver(outcome.Error(StreamClosed("the client was closed while the call was in flight")))
                raise
            deliver(result)

        try:
            self._token.run_sync_soon(spawn)
        except trio.RunFinishedError:
            raise StreamClosed("the client's loop has ended") from None

    def close(self) -> None:
        """Close the stream and join the thread (calls still waiting raise ``StreamClosed``). Idempotent."""
        if self._stop is not None:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._stop.set)
        self._thread.join()
        with contextlib.suppress(StreamClosed):
            self._finished.result()


class _ThreadHosted(Operations):
    """What both flavours on a ``ClientThread`` share: the connection (made at once, blocking briefly), its
    format, and ``close``; each supplies ``perform`` for its callers."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        max_in_flight: int = MAX_IN_FLIGHT,
        connect_timeout: float | None = CONNECT_SECONDS,
        compact: bool = True,
    ) -> None:
        self._host = ClientThread(
            url, token=token, max_in_flight=max_in_flight, connect_timeout=connect_timeout, compact=compact
        )

    @property
    def format(self) -> str:
        """The format the stream speaks: "msgpack" (the compact format) or "json" (``compact=False``, or a
        service without the compact format), as ``StreamClient.format``."""
        return self._host.client.format

    def close(self) -> None:
        """Close the stream and join the client's thread (calls still waiting raise ``StreamClosed``)."""
        self._host.close()


class BlockingClient(_ThreadHosted):
    """``BlockingClient(url, token=...)``: the operations, each blocking the calling thread until its result
    (any number of threads may call at once; their calls share messages). Close with ``close()`` or ``with``."""

    def perform(self, op: Op[T]) -> T:
        if threading.current_thread() is self._host._thread:
            raise RuntimeError("a blocking client call from the client's own loop would wait for itself forever")
        done: concurrent.futures.Future[outcome.Outcome[T]] = concurrent.futures.Future()
        self._host.submit(op, done.set_result)
        result: T = done.result().unwrap()
        return result

    def __enter__(self) -> BlockingClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncioClient(_ThreadHosted):
    """``AsyncioClient(url, token=...)`` (connects at once, blocking briefly): the operations as coroutines for
    the running asyncio loop. Close with ``close()`` (blocking) or ``async with``."""

    async def perform(self, op: Op[T]) -> T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[outcome.Outcome[T]] = loop.create_future()

        def settle(result: outcome.Outcome[T]) -> None:
            if not future.done():
                future.set_result(result)

        def deliver(result: outcome.Outcome[T]) -> None:
            with contextlib.suppress(RuntimeError):  # the asyncio loop is closed: nobody waits any more
                loop.call_soon_threadsafe(settle, result)

        self._host.submit(op, deliver)
        result: T = (await future).unwrap()
        return result

    async def __aenter__(self) -> AsyncioClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)
