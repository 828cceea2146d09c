"""Read the messages a scope's subject holds past a sequence (what a follower copy has not folded yet).

The NATS side of ``followers.py``, on a ``subject_link`` (one NATS connection on an asyncio thread of its own,
asked once per round for every followed subject, the subjects in parallel). Each subject is read with JetStream's
"next message by subject" get, one message per request, from the sequence after the one folded, until "not found"
(nothing more) or ``MAX_MESSAGES_PER_ROUND``. No consumer: nothing is kept on the server, and a reconnect or a
server restart loses nothing (the next round asks again from the sequence folded). Bounded: each request has the
link's timeout; a subject whose read fails says nothing this round.
"""

from __future__ import annotations

import logging
from typing import Final

import attrs
import nats.errors
import nats.js.errors

from kvrouter.actors.cluster.subject_link import SubjectLink, Subjects
from kvrouter.journal import jetstream_batch as batch

log = logging.getLogger("kvrouter.cluster")

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


class FollowLink(SubjectLink):
    """``await FollowLink.open(servers, stream)``, ``read`` per round, ``aclose`` at the end."""

    NAME = "kvrouter-followers"

    async def read(self, after: dict[str, int]) -> dict[str, Read]:
        """For each subject, the messages it holds past ``after[subject]`` (subjects whose read failed: absent)."""
        return await self.ask(_read_one, after)


async def _read_one(subjects: Subjects, subject: str, seq: int) -> Read | None:
    messages: list[Message] = []
    while len(messages) < MAX_MESSAGES_PER_ROUND:
        try:
            got = await subjects.next_after(subject, seq)
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
