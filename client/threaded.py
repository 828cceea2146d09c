"""The client for plain threads (``BlockingClient``) and asyncio (``AsyncioClient``).

Both run the trio ``StreamClient`` on a loop of its own, on a thread of its own (``client/loop_thread.py``,
the same bridge as the embedded router's), and carry each call into it as a task there; the outcome comes
back through a ``concurrent.futures.Future`` (threads) or an asyncio future. Why not a second implementation on asyncio:
the protocol (coalescing, id matching, the in-flight bound) then exists once, on trio-websocket, which
kvrouter already depends on, and asyncio has no WebSocket client of its own. The price is one thread hop
per call, which batching amortises: calls made concurrently from many threads or asyncio tasks go out
together in the same message.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any, TypeVar

from kvrouter.client.loop_thread import LoopThread
from kvrouter.client.operations import Op, Operations, StreamClosed
from kvrouter.client.replicas import RETRY_SECONDS, ReplicaClient
from kvrouter.client.stream import CONNECT_SECONDS, MAX_IN_FLIGHT, StreamClient

T = TypeVar("T")


def _closed(why: str) -> StreamClosed:
    return StreamClosed(f"the client was {why}" if why == "closed" else f"the client {why}")


class _ThreadHosted(Operations):
    """What both flavours on a ``LoopThread`` share: the connection (made at once, blocking briefly), its
    format, and ``close``; each supplies ``perform`` for its callers."""

    def __init__(
        self,
        url: str | Sequence[str],
        *,
        token: str | None = None,
        max_in_flight: int = MAX_IN_FLIGHT,
        connect_timeout: float | None = CONNECT_SECONDS,
        compact: bool = True,
        retry_seconds: float = RETRY_SECONDS,
    ) -> None:
        """``url``: the service's URL, or a cluster's replicas (a list, or one string of comma-separated URLs),
        through a ``ReplicaClient`` (``retry_seconds``: see there)."""
        options: dict[str, Any] = {
            "token": token, "max_in_flight": max_in_flight, "connect_timeout": connect_timeout, "compact": compact,
        }  # fmt: skip

        def connect() -> contextlib.AbstractAsyncContextManager[StreamClient | ReplicaClient]:
            if isinstance(url, str) and "," not in url:
                return StreamClient.connect(url, **options)
            return ReplicaClient.connect(url, retry_seconds=retry_seconds, **options)

        self._host = LoopThread(connect, name="kvrouter-client", closed_error=_closed, finish_on_close=False)

    @property
    def format(self) -> str:
        """The format the stream speaks: "msgpack" (the compact format) or "json" (``compact=False``, or a
        service without the compact format), as ``StreamClient.format``."""
        return self._host.resource.format

    def close(self) -> None:
        """Close the stream and join the client's thread (calls still waiting raise ``StreamClosed``)."""
        with contextlib.suppress(StreamClosed):
            self._host.close()


class BlockingClient(_ThreadHosted):
    """``BlockingClient(url, token=...)``: the operations, each blocking the calling thread until its result
    (any number of threads may call at once; their calls share messages). Close with ``close()`` or ``with``."""

    def perform(self, op: Op[T]) -> T:
        return self._host.call_blocking(self._host.resource.perform, op)

    def __enter__(self) -> BlockingClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncioClient(_ThreadHosted):
    """``AsyncioClient(url, token=...)`` (connects at once, blocking briefly): the operations as coroutines for
    the running asyncio loop. Close with ``close()`` (blocking) or ``async with``."""

    async def perform(self, op: Op[T]) -> T:
        return await self._host.call(self._host.resource.perform, op)

    async def __aenter__(self) -> AsyncioClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.close)
