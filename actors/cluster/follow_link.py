"""Read the messages a scope's subject holds past a sequence (what a follower copy has not folded yet).

The asyncio side of ``followers.py``: one NATS connection on an asyncio thread of its own (nats-py is
asyncio-only), asked once per round for every followed subject, the subjects in parallel. Each subject is read
with JetStream's "next message by subject" get (``STREAM.MSG.GET`` with ``next_by_subj``), one message per request,
from the sequence after the one folded, until "not found" (nothing more) or ``MAX_MESSAGES_PER_ROUND``. No consumer:
nothing is kept on the server, and a reconnect or a server restart loses nothing (the next round asks again from
the sequence folded). Bounded: each request has ``REQUEST_TIMEOUT_SECONDS``; a subject whose read fails says
nothing this round.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Final

import attrs
import nats.errors
import nats.js.errors

from kvrouter.journal import jetstream_batch as batch
from kvrouter.journal.asyncio_thread import AsyncioThread
from kvrouter.journal.jetstream_link import open_nats

log = logging.getLogger("kvrouter.cluster")

REQUEST_TIMEOUT_SECONDS: Final = 2.0
MAX_MESSAGES_PER_ROUND: Final = 256  # per subject: a copy further behind catches up over several rounds


@attrs.frozen
class Message:
    """One message of a subject: its stream sequence, its first record's lsn, the message it follows on the log's
    chain (``jetstream_batch``), and its records' payloads."""

    seq: int
    first_lsn: int
    payloads: tuple[bytes, ...]
    prev: int = 0


@attrs.frozen
class Read:
    """What a subject holds past the sequence asked: its messages, and whether that is all of them (the copy is
    then current as of the read)."""

    messages: tuple[Message, ...]
    complete: bool


class _Link:
    def __init__(self, nc: Any, stream: str) -> None:
        self._nc = nc
        self._js = nc.jetstream(timeout=REQUEST_TIMEOUT_SECONDS)
        self._stream = stream

    @classmethod
    async def connect(cls, servers: tuple[str, ...], stream: str) -> _Link:
        return cls(await open_nats(servers, "kvrouter-followers"), stream)

    async def read(self, after: dict[str, int]) -> dict[str, Read]:
        subjects = list(after)
        found = await asyncio.gather(*(self._read_one(subject, after[subject]) for subject in subjects))
        return {subject: read for subject, read in zip(subjects, found, strict=True) if read is not None}

    async def _read_one(self, subject: str, seq: int) -> Read | None:
        messages: list[Message] = []
        while len(messages) < MAX_MESSAGES_PER_ROUND:
            try:
                got = await self._js.get_msg(self._stream, seq=seq + 1, subject=subject, next=True)
            except nats.js.errors.NotFoundError:
                return Read(tuple(messages), complete=True)
            except (TimeoutError, nats.errors.Error) as exc:
                log.debug("following %s failed (%s); asking again next round", subject, exc)
                return Read(tuple(messages), complete=False) if messages else None
            try:
                at = int(got.seq)
                records = tuple(batch.unframe(got.data or b"", at))
                message = Message(at, batch.first_lsn(got.headers, at), records, batch.prev_of(got.headers, at))
            except batch.MalformedBatch as exc:
                log.warning("following %s stops at a message it cannot read: %s", subject, exc)
                return Read(tuple(messages), complete=False)
            seq = message.seq
            messages.append(message)
        return Read(tuple(messages), complete=False)

    async def close(self) -> None:
        await asyncio.wait_for(self._nc.close(), REQUEST_TIMEOUT_SECONDS)


class FollowLink:
    """The trio side: ``await FollowLink.open(servers, stream)``, ``read`` per round, ``aclose`` at the end."""

    def __init__(self, thread: AsyncioThread, link: _Link) -> None:
        self._thread = thread
        self._link = link

    @classmethod
    async def open(cls, servers: tuple[str, ...], stream: str) -> FollowLink:
        thread = AsyncioThread(f"kvrouter-followers-{stream}")
        await thread.start()
        try:
            link = await thread.call(_Link.connect, servers, stream)
        except BaseException:
            await thread.stop()
            raise
        return cls(thread, link)

    async def read(self, after: dict[str, int]) -> dict[str, Read]:
        """For each subject, the messages it holds past ``after[subject]`` (subjects whose read failed: absent)."""
        if not after:
            return {}
        return await self._thread.call(self._link.read, after)

    async def aclose(self) -> None:
        await self._thread.stop(before=self._link.close)
