"""Per-publisher bookkeeping of Dynamo's event plane: where each publisher's envelopes go, their sequence, what was
lost. Plain synchronous state (no I/O), owned by the event plane's ingest task.

A publisher's ``sequence`` counts its envelopes from 0; its watermark (the last sequence applied) is journaled with
the blocks, on the rank it speaks for (``Publisher.stream_rank``), so a restart resumes after it: an envelope at or
below the watermark was applied already (a JetStream redelivery, or a duplicate) and is skipped; one past
``watermark + 1`` reveals a gap. Nothing can fill a gap once it is seen (core NATS and ZMQ keep nothing; JetStream
delivered everything it held), so each is counted as lost on the worker: ``lost_batches`` is the number of envelopes
never applied, including those published before kvrouter first heard the publisher.

Dynamo gives a restarted worker a new instance id, and so a new publisher: a sequence going back is never taken for
a restart of the same publisher.
"""

from __future__ import annotations

from typing import Final, Literal

import attrs

from kvrouter.actors.core.ids import ScopeKey, WorkerRank
from kvrouter.actors.fleet.dynamo_layout import Publisher

PublisherState = Literal["waiting", "active", "failed"]
# Envelopes of publishers discovery has not shown yet (a worker publishes as soon as it registers, and the etcd
# watch may come a moment later), kept until it does: at most this many bytes in all, the oldest dropped first
# (policy: drop-oldest; a dropped envelope shows as a gap once its publisher is known).
UNKNOWN_PUBLISHER_BYTES: Final = 4 * 1024 * 1024


@attrs.define
class PublisherStatus:
    """What ``GET /workers`` shows for one publisher (under its stream rank's ``kv_listeners``)."""

    plane: str  # "nats", "jetstream" or "zmq"
    source: str  # the NATS subject or ZMQ endpoint it is read from
    publisher_id: str  # hex, as the discovery keys name it
    state: PublisherState = "waiting"
    last_seq: int | None = None  # the watermark: the last sequence applied (or resumed from)
    last_error: str | None = None
    batches: int = 0  # envelopes applied
    gaps: int = 0  # times the sequence skipped ahead
    lost_batches: int = 0  # envelopes never applied (gaps, and those before kvrouter first heard it)
    stale_dropped: int = 0  # at or below the watermark: applied already
    malformed: int = 0  # envelopes or payloads that could not be read
    foreign_events: int = 0  # router events naming another worker or a dp rank the worker does not have


@attrs.define
class Route:
    """Where one publisher's envelopes go, and its status."""

    publisher: Publisher
    scope: ScopeKey
    dp_ranks: frozenset[int]
    status: PublisherStatus

    @property
    def stream_rank(self) -> WorkerRank:
        return WorkerRank(self.publisher.worker_id, self.publisher.stream_rank)


Verdict = Literal["apply", "stale"]


def sequence_verdict(status: PublisherStatus, sequence: int) -> Verdict:
    """Whether the envelope numbered ``sequence`` is applied; counts a gap it reveals (and moves nothing else)."""
    last = status.last_seq
    if last is not None and sequence <= last:
        status.stale_dropped += 1
        return "stale"
    expected = 0 if last is None else last + 1
    if sequence > expected:
        status.gaps += 1
        status.lost_batches += sequence - expected
        first = "" if last is not None else " (published before kvrouter heard this publisher)"
        status.last_error = f"envelopes {expected}..{sequence - 1} lost{first}"
    return "apply"
