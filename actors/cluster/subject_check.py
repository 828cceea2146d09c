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

The connection and its asyncio thread are a ``subject_link``'s. Bounded: each request has the link's timeout; a
check that fails (no answer, no connection) says nothing about that subject this round, and the next round asks
again.
"""

from __future__ import annotations

import logging
from typing import Final

import nats.errors
import nats.js.errors

from kvrouter.actors.cluster.subject_link import SubjectLink, Subjects

log = logging.getLogger("kvrouter.cluster")

CHECK_INTERVAL_SECONDS: Final = 0.5


class SubjectCheck(SubjectLink):
    """``await SubjectCheck.open(servers, stream)``, ``passed`` per round, ``aclose`` at the end."""

    NAME = "kvrouter-subject-check"

    async def passed(self, held: dict[str, int]) -> dict[str, int]:
        """For each subject whose stream holds a message past its ``held`` sequence, that message's sequence."""
        return await self.ask(_next_after, held)


async def _next_after(subjects: Subjects, subject: str, seq: int) -> int | None:
    try:
        message = await subjects.next_after(subject, seq)
    except nats.js.errors.NotFoundError:
        return None
    except (TimeoutError, nats.errors.Error) as exc:
        log.debug("subject check of %s failed (%s); asking again next round", subject, exc)
        return None
    return int(message.seq)
