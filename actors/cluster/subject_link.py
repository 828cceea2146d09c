"""One NATS connection on an asyncio thread of its own, asking JetStream about many subjects of the stream per round.

What the overtaken check (``subject_check``) and the follower copies (``follow_link``) share. nats-py is
asyncio-only, so the connection lives on an asyncio thread (``journal/asyncio_thread``); trio crosses to it once per
round with every subject, and the subjects are asked in parallel there. The one request is JetStream's "next message
by subject" get (``STREAM.MSG.GET`` with ``next_by_subj``): no consumer, nothing kept on the server, so a reconnect
or a server restart loses nothing. Each request has ``REQUEST_TIMEOUT_SECONDS``.

A user subclasses ``SubjectLink`` with its ``NAME`` (the connection's and the thread's) and a question: an async
function run on the asyncio thread for one subject, answering None for "nothing to say about it this round".
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Final, Self, TypeVar

from kvrouter.journal.asyncio_thread import AsyncioThread
from kvrouter.journal.jetstream_link import open_nats

REQUEST_TIMEOUT_SECONDS: Final = 2.0

T = TypeVar("T")


class Subjects:
    """The asyncio side: the connection, and the request every question is made of."""

    def __init__(self, nc: Any, stream: str) -> None:
        self._nc = nc
        self._js = nc.jetstream(timeout=REQUEST_TIMEOUT_SECONDS)
        self._stream = stream

    @classmethod
    async def connect(cls, servers: tuple[str, ...], stream: str, name: str) -> Subjects:
        return cls(await open_nats(servers, name), stream)

    async def next_after(self, subject: str, seq: int) -> Any:
        """The subject's first message past ``seq``; raises ``nats.js.errors.NotFoundError`` if there is none."""
        return await self._js.get_msg(self._stream, seq=seq + 1, subject=subject, next=True)

    async def ask(self, question: Question[T], after: dict[str, int]) -> dict[str, T]:
        subjects = list(after)
        found = await asyncio.gather(*(question(self, subject, after[subject]) for subject in subjects))
        return {subject: answer for subject, answer in zip(subjects, found, strict=True) if answer is not None}

    async def close(self) -> None:
        await asyncio.wait_for(self._nc.close(), REQUEST_TIMEOUT_SECONDS)


Question = Callable[[Subjects, str, int], Awaitable[T | None]]


class SubjectLink:
    """The trio side: ``await Sub.open(servers, stream)``, ``ask`` per round, ``aclose`` at the end."""

    NAME: ClassVar[str]  # the NATS connection's name; the thread's is NAME-stream

    def __init__(self, thread: AsyncioThread, subjects: Subjects) -> None:
        self._thread = thread
        self._subjects = subjects

    @classmethod
    async def open(cls, servers: tuple[str, ...], stream: str) -> Self:
        thread = AsyncioThread(f"{cls.NAME}-{stream}")
        await thread.start()
        try:
            subjects = await thread.call(Subjects.connect, servers, stream, cls.NAME)
        except BaseException:
            await thread.stop()
            raise
        return cls(thread, subjects)

    async def ask(self, question: Question[T], after: dict[str, int]) -> dict[str, T]:
        """``question(subjects, subject, after[subject])`` for every subject at once; the answers that are not None."""
        if not after:
            return {}
        return await self._thread.call(self._subjects.ask, question, after)

    async def aclose(self) -> None:
        await self._thread.stop(before=self._subjects.close)
