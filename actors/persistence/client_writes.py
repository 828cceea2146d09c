"""Which journal records are a client's acknowledged writes, in the words of the API that made them.

``kvrouter journal truncate-after`` drops every record after an lsn: before it does (and in its dry run) it
names the client writes it would drop, so that an operator does not cut away acknowledged bookings believing
they were only a worker's KV events. The journal itself cannot tell: its payloads are opaque to it.

A record counts once, by its first event that a client's request made; records with none (a worker's KV
events, expiries, the service's own bookkeeping) are counted apart, and so are records that do not decode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Final

import attrs

from kvrouter.actors.core.events import (
    OutputBlockAdded,
    PrefillCompleted,
    RequestAdded,
    RequestFreed,
    WorkerRegistered,
    WorkerRemoved,
    WorkerUnregistered,
    WorkerUpserted,
)
from kvrouter.actors.persistence.codec import RecordFormatError, decode_record

EXAMPLES: Final = 5  # ids named per kind of write

BOOKING = "booking"  # a request's booking on a rank: the slot tracker's /add, the selection service's reservations

# Event class -> (what the write is called, how its id is read from the event).
_WRITES: Final[dict[type, tuple[str, Callable[[Any], object]]]] = {
    RequestAdded: (BOOKING, lambda event: event.request_id),
    PrefillCompleted: ("prefill completion", lambda event: event.request_id),
    OutputBlockAdded: ("output block", lambda event: event.request_id),
    RequestFreed: ("release", lambda event: event.request_id),
    WorkerRegistered: ("worker registration", lambda event: event.worker_id),
    WorkerUnregistered: ("worker unregistration", lambda event: event.worker_id),
    WorkerUpserted: ("worker record", lambda event: event.record.worker_id),
    WorkerRemoved: ("worker removal", lambda event: event.worker_id),
}


@attrs.define
class ClientWrites:
    """The records of a stretch of the log, sorted by what they are."""

    counts: dict[str, int] = attrs.Factory(dict)  # kind of client write -> records
    examples: dict[str, list[str]] = attrs.Factory(dict)  # kind -> the first ids
    other: int = 0  # records no client request made (workers' KV events, expiries)
    undecodable: int = 0

    def add(self, payload: bytes) -> None:
        try:
            record = decode_record(payload)
        except RecordFormatError:
            self.undecodable += 1
            return
        for event in record.events:
            write = _WRITES.get(type(event))
            if write is not None:
                kind, ident = write
                self.counts[kind] = self.counts.get(kind, 0) + 1
                shown = self.examples.setdefault(kind, [])
                if len(shown) < EXAMPLES:
                    shown.append(str(ident(event)))
                return
        self.other += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def describe(self, booking: str = BOOKING) -> str:
        """``2000 reservations (r0, r1, r2, r3, r4, ...), 1 worker record (1)``: ``booking`` names bookings."""
        parts = []
        for kind, count in self.counts.items():
            name = booking if kind == BOOKING else kind
            ids = self.examples[kind]
            more = ", ..." if count > len(ids) else ""
            parts.append(f"{count} {name}{'' if count == 1 else 's'} ({', '.join(ids)}{more})")
        return ", ".join(parts) if parts else "none"


def client_writes(payloads: Iterable[bytes]) -> ClientWrites:
    writes = ClientWrites()
    for payload in payloads:
        writes.add(payload)
    return writes
