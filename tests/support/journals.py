"""Memory journals a test can hold back: durability released by hand, or room to append taken away."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from kvrouter.journal.memory import MemoryJournal


class GatedJournal:
    """A MemoryJournal whose durability the test releases by hand (``release``), honouring the journal
    contract: ``durable_lsn``, ``wait_durable`` and ``call_when_durable`` all follow the gate."""

    def __init__(self) -> None:
        self.inner = MemoryJournal()
        self.durable = 0
        self._moved = trio.Event()
        self._callbacks: list[tuple[int, Callable[[], None]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def durable_lsn(self) -> int:
        return self.durable

    def release(self, upto: int | None = None) -> None:
        """Everything appended (or up to ``upto``) is now durable."""
        self.durable = self.inner.last_lsn if upto is None else upto
        due = [callback for lsn, callback in self._callbacks if lsn <= self.durable]
        self._callbacks = [(lsn, callback) for lsn, callback in self._callbacks if lsn > self.durable]
        for callback in due:
            callback()
        self._moved.set()
        self._moved = trio.Event()

    async def wait_durable(self, lsn: int) -> None:
        while self.durable < lsn:
            await self._moved.wait()

    def call_when_durable(self, lsn: int, callback: Callable[[], None]) -> None:
        if lsn <= self.durable:
            callback()
        else:
            self._callbacks.append((lsn, callback))

    def pending_callbacks(self) -> int:
        """Durability callbacks registered and not yet called."""
        return len(self._callbacks)


class RoomJournal(MemoryJournal):
    """A memory journal that can claim to be full: actors then wait for room after their current turn."""

    def __init__(self) -> None:
        super().__init__()
        self.room = True
        self._opened = trio.Event()

    def has_room(self) -> bool:
        return self.room

    async def wait_for_room(self) -> None:
        while not self.room:
            await self._opened.wait()

    def close_room(self) -> None:
        self.room = False
        self._opened = trio.Event()

    def open_room(self) -> None:
        self.room = True
        self._opened.set()
