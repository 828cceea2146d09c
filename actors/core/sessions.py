"""Session affinity: a session id pinned to the rank that served it (behaviour.md#loads-dump-and-session-affinity,
1.6.1's behaviour).

A booking with a ``session_id`` pins the session to the chosen (worker, dp_rank); later selections of the
session prefer that rank while it is eligible. The pin holds while any booking of the session is live and for
``ttl`` after its last use (its last booking or release), as 1.6.1 does: probed with a 2 s TTL, a session with a
live reservation stayed pinned past 2 s and let go 2 s after the reservation was deleted. A worker that leaves
does not end the pin: when it comes back the session returns to it. A query (``/select``) never pins.

Bindings replicate to peers with ``(sequence, writer_id)`` versions: a binding replaces another only when its
version is greater. Per scope at most ``MAX_SESSIONS`` are kept; overflow policy: the least recently used
binding is dropped (it is journaled as expired).
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

import attrs

MAX_SESSIONS = 100_000


@attrs.define
class SessionBinding:
    worker_id: int
    dp_rank: int
    last_used: int  # ns: the last booking or release
    ttl_ns: int
    sequence: int
    writer_id: int
    requests: set[str] = attrs.Factory(set)  # bookings made under the session that may still be live

    def held(self, live_requests: Container[str]) -> bool:
        return any(request_id in live_requests for request_id in self.requests)

    def expired(self, now: int, live_requests: Container[str]) -> bool:
        return now - self.last_used > self.ttl_ns and not self.held(live_requests)

    @property
    def version(self) -> tuple[int, int]:
        return (self.sequence, self.writer_id)

    def to_plain(self) -> list[Any]:
        return [
            self.worker_id,
            self.dp_rank,
            self.last_used,
            self.ttl_ns,
            self.sequence,
            self.writer_id,
            sorted(self.requests),
        ]

    @classmethod
    def from_plain(cls, plain: list[Any]) -> SessionBinding:
        worker_id, dp_rank, last_used, ttl_ns, sequence, writer_id, requests = plain
        return cls(worker_id, dp_rank, last_used, ttl_ns, sequence, writer_id, set(requests))
