"""Ask JetStream whether scopes' subjects hold a message past the sequence their owner holds (the overtaken rule).

An owner's state is the fold of its subject up to the sequence it holds. The subject can move past it without an
append of its own being refused: an append it gave up on (no answer in time) lands after it recovered, or another
writer appends behind its back. Its next append would be fenced, but until then it answers reads from a stale
state. So ``OwnedScopes`` asks, every ``CHECK_INTERVAL_SECONDS``, for each scope it serves with nothing of its own
in flight: is there a message on the subject after the sequence held? (JetStream's "next message by subject" get:
``STREAM.MSG.GET`` with ``next_by_subj``, answered "not found" while nothing moved, a few bytes.)

Why a check and not a consumer following every subject: the answer comes from the stream itself at the moment of
asking, so nothing is missed across a reconnect, a server restart or a consumer reset, and a replica holds no
consumer state on the server; while nothing moved it costs one small request per served scope per interval, all of
them in one crossing to the asyncio thread, in parallel there. A subject passed is found within an interval plus a
request's time.

nats-py is asyncio-only: the connection lives on an asyncio thread of its own (``journal/asyncio_thread``). Bounded:
each request has ``REQUEST_TIMEOUT_SECONDS``; a check that fails (no answer, no connection) says nothing about that
subject this round, and the next round asks again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Final

import nats
import nats.errors
import nats.js.errors

from kvrouter.journal.asyncio_thread import AsyncioThread
from kvrouter.journal.jetstream_link import open_nats

log = logging.getLogger("kvrouter.cluster")

CHECK_INTERVAL_SECONDS: Final = 0.5
REQUEST_TIMEOUT_SECONDS: Final = 2.0


class _Link:
    """The asyncio side: one connection, and the per-subject question."""

    def __init__(self, nc: Any, stream: str) -> None:
        self._nc = nc
        self._js = nc.jetstream(timeout=REQUEST_TIMEOUT_SECONDS)
        self._stream = stream

    @classmethod
    async def connect(cls, servers: tuple[str, ...], stream: str) -> _Link:
        nc = await open_nats(servers, "kvrouter-subject-check")
        return cls(nc, stream)

    async def passed(self, held: dict[str, int]) -> dict[str, int]:
        subjects = list(held)
        found = await asyncio.gather(*(self._next_after(subject, held[subject]) for subject in subjects))
        return {subject: seq for subject, seq in zip(subjects, found, strict=True) if seq is not None}

    async def _next_after(self, subject: str, seq: int) -> int | None:
        try:
            message = await self._js.get_msg(self._stream, seq=seq + 1, subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            return None
        except (TimeoutError, nats.errors.Error) as exc:
            log.debug("subject check of %s failed (%s); asking again next round", subject, exc)
            return None
        return int(message.seq)

    async def close(self) -> None:
        await asyncio.wait_for(self._nc.close(), REQUEST_TIMEOUT_SECONDS)


class SubjectCheck:
    """The trio side: ``await SubjectCheck.open(...)``, ``passed`` per round, ``aclose`` at the end."""

    def __init__(self, thread: AsyncioThread, link: _Link) -> None:
        self._thread = thread
        self._link = link

    @classmethod
    async def open(cls, servers: tuple[str, ...], stream: str) -> SubjectCheck:
        thread = AsyncioThread(f"kvrouter-subject-check-{stream}")
        await thread.start()
        try:
            link = await thread.call(_Link.connect, servers, stream)
        except BaseException:
            await thread.stop()
            raise
        return cls(thread, link)

    async def passed(self, held: dict[str, int]) -> dict[str, int]:
        """For each subject whose stream holds a message past its ``held`` sequence, that message's sequence."""
        if not held:
            return {}
        return await self._thread.call(self._link.passed, held)

    async def aclose(self) -> None:
        await self._thread.stop(before=self._link.close)
