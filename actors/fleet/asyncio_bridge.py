"""The fleet's side of the asyncio bridge: ``AsyncioThread`` (an asyncio loop on a thread of its own, driven from
trio; it lives in ``journal/asyncio_thread``, whose docstring says why) and ``Inbox``.

``Inbox`` is where asyncio callbacks (one per message) put what they receive: a list bounded in bytes (policy: drop
the newest, counted; the event plane's sequence numbers then show the gap), taken whole by trio, which is woken once
when the list stops being empty.
"""

from __future__ import annotations

import contextlib
import threading

import trio

from kvrouter.journal.asyncio_thread import AsyncioThread

__all__ = ["AsyncioThread", "Inbox"]


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
