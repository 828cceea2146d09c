"""Many subjects of the stream asked about per round, over the replica's shared NATS session.

What the overtaken check (``subject_check``) and the follower copies (``follow_link``) share. nats-py is
asyncio-only, so the connection lives on an asyncio thread (``journal/nats_session``: one per replica, which the
scopes' journals use too); trio crosses to it once per round with every subject, and the subjects are asked in
parallel there. The one request is JetStream's "next message by subject" get (``STREAM.MSG.GET`` with
``next_by_subj``): no consumer, nothing kept on the server, so a reconnect or a server restart loses nothing. Each
request has ``REQUEST_TIMEOUT_SECONDS``.

A user subclasses ``SubjectLink`` with a question: an async function run on the asyncio thread for one subject,
answering None for "nothing to say about it this round". A link owns nothing: the session is closed by whoever
opened it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Final, Self, TypeVar

from kvrouter.journal.nats_session import NatsSession

REQUEST_TIMEOUT_SECONDS: Final = 2.0

T = TypeVar("T")


class Subjects:
    """The asyncio side: a JetStream context of its own on the shared connection, and the request every question
    is made of."""

    def __init__(self, nc: Any, stream: str) -> None:
        self._js = nc.jetstream(timeout=REQUEST_TIMEOUT_SECONDS)
        self._stream = stream

    @classmethod
    async def on(cls, nc: Any, stream: str) -> Subjects:
        return cls(nc, stream)

    async def next_after(self, subject: str, seq: int) -> Any:
        """The subject's first message past ``seq``; raises ``nats.js.errors.NotFoundError`` if there is none."""
        return await self._js.get_msg(self._stream, seq=seq + 1, subject=subject, next=True)

    async def ask(self, question: Question[T], after: dict[str, int]) -> dict[str, T]:
        subjects = list(after)
        found = await asyncio.gather(*(question(self, subject, after[subject]) for subject in subjects))
        return {subject: answer for subject, answer in zip(subjects, found, strict=True) if answer is not None}


Question = Callable[[Subjects, str, int], Awaitable[T | None]]


class SubjectLink:
    """The trio side: ``await Sub.open(session, stream)``, ``ask`` per round."""

    def __init__(self, session: NatsSession, subjects: Subjects) -> None:
        self._session = session
        self._subjects = subjects

    @classmethod
    async def open(cls, session: NatsSession, stream: str) -> Self:
        return cls(session, await session.call(Subjects.on, session.nc, stream))

    async def ask(self, question: Question[T], after: dict[str, int]) -> dict[str, T]:
        """``question(subjects, subject, after[subject])`` for every subject at once; the answers that are not None."""
        if not after:
            return {}
        return await self._session.call(self._subjects.ask, question, after)
