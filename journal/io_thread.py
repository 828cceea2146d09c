"""One long-lived thread for the journal's blocking calls (write, fsync).

``trio.to_thread.run_sync`` hands each call to a cached worker and back, ~80 µs of the event
loop's time here; a dedicated thread fed through a ``SimpleQueue`` and answering with
``TrioToken.run_sync_soon`` costs about half. The journal makes one such call per group commit,
so this is per-batch overhead taken off the request path. Calls are not cancellable once
submitted, exactly like ``to_thread.run_sync``'s default: a write in progress is never abandoned.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

T = TypeVar("T")


class IoThread:
    def __init__(self, name: str = "kvrouter-journal-io") -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Callable[[outcome.Outcome[Any]], None]] | None]
        self._calls = queue.SimpleQueue()
        self._token = trio.lowlevel.current_trio_token()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            call, deliver = item
            result = outcome.capture(call)
            self._token.run_sync_soon(deliver, result)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        done = trio.Event()
        box: list[outcome.Outcome[T]] = []

        def deliver(result: outcome.Outcome[T]) -> None:
            box.append(result)
            done.set()

        self._calls.put((lambda: fn(*args), deliver))
        with trio.CancelScope(shield=True):  # submitted work always finishes; so does the wait
            await done.wait()
        return box[0].unwrap()

    def close(self) -> None:
        """Let the thread exit after the calls already queued."""
        self._calls.put(None)
