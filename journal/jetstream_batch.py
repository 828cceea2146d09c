"""How the JetStream journal lays records out in its stream: one NATS message per group commit.

Pure (no I/O): the JetStream journal (``journal/jetstream``) frames and unframes with it, and tests check it alone.

Each message on the journal's subject holds the records of one group commit (or a part of one, when the group
exceeds the server's ``max_payload``), in LSN order, with no gap:

* header ``Kvr-Lsn``: the LSN of the message's first record (the others follow, one apart);
* header ``Kvr-Journal``: the layout's version (``FORMAT``), so a reader refuses a layout it does not know;
* header ``Nats-Expected-Last-Subject-Sequence``: the fence (the stream sequence of the subject's last message as
  the writer knows it; JetStream refuses the message if another writer appended since);
* header ``Kvr-Prev``: the stream sequence of the message this one follows on the log (its writer's last message
  of the chain, below). Usually the fence; they differ only after a message off the chain (a writer recovered
  past it). A message written before this header existed is read with its fence in its place.
* body: for each record, a 4-byte big-endian word (the payload's length, bit 31 set when the writer marked it
  rebuildable), then the payload.

One message per group makes the fence exact (a group lands whole or not at all) and costs one acknowledgement per
group instead of one per record. JetStream checksums what it stores, so the frames carry no CRC of their own.

**The chain.** The fence alone does not keep the log linear: a clustered stream on nats-server before 2.9.21 checks
it before replication, so two appends fenced on the same sequence at the same moment can both be stored. The log
is therefore the chain of messages each naming the one before it (``Kvr-Prev``), from the first message read: a
message naming another is off the chain, and every reader passes over it (``Chain``). A writer checks, after
JetStream acknowledged its message, that no other message took its place on the chain (``jetstream_link``), and
acknowledges nothing otherwise.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Final

FORMAT: Final = "1"
LSN_HEADER: Final = "Kvr-Lsn"
FORMAT_HEADER: Final = "Kvr-Journal"
FENCE_HEADER: Final = "Nats-Expected-Last-Subject-Sequence"
PREV_HEADER: Final = "Kvr-Prev"
WORD: Final = struct.Struct(">I")
REBUILDABLE_BIT: Final = 1 << 31
# What the headers above take at most (their names, values up to 20 digits, NATS/1.0 framing), rounded up: a
# message's body may use the server's max_payload minus this.
HEADER_RESERVE: Final = 256


class MalformedBatch(ValueError):
    """A message on the journal's subject that this layout cannot read (another writer's, or a newer format)."""


def frame(payload: bytes, rebuildable: bool) -> bytes:
    """One record as it sits in a message body."""
    size = len(payload)
    return WORD.pack(size | REBUILDABLE_BIT if rebuildable else size) + payload


def headers(first_lsn: int, expected_last_sequence: int, prev: int) -> dict[str, str]:
    return {
        LSN_HEADER: str(first_lsn),
        FORMAT_HEADER: FORMAT,
        FENCE_HEADER: str(expected_last_sequence),
        PREV_HEADER: str(prev),
    }


def prev_of(message_headers: dict[str, str] | None, seq: int) -> int:
    """The sequence of the message that the one at ``seq`` follows on the chain (its fence when it predates
    ``Kvr-Prev``)."""
    found = message_headers or {}
    try:
        return int(found.get(PREV_HEADER, found[FENCE_HEADER]))
    except (KeyError, ValueError):
        raise MalformedBatch(f"stream message {seq} names no valid {PREV_HEADER} or {FENCE_HEADER} header") from None


class Chain:
    """Which messages of a subject, read in order, are the log: the first one read (the log's start, or the first
    after a snapshot), then each that names the last one taken as its ``Kvr-Prev``."""

    __slots__ = ("tail",)

    def __init__(self, tail: int | None = None) -> None:
        self.tail = tail  # the sequence of the chain's last message; None until the first message is read

    def take(self, seq: int, prev: int) -> bool:
        """Whether the message at ``seq`` naming ``prev`` is on the chain (then it is its new tail)."""
        if self.tail is not None and prev != self.tail:
            return False
        self.tail = seq
        return True


def first_lsn(message_headers: dict[str, str] | None, seq: int) -> int:
    """The LSN of the first record in the message at stream sequence ``seq`` (checked against the format)."""
    found = message_headers or {}
    if found.get(FORMAT_HEADER) != FORMAT:
        raise MalformedBatch(
            f"stream message {seq} has journal format {found.get(FORMAT_HEADER)!r}; this kvrouter reads {FORMAT!r}"
        )
    try:
        lsn = int(found[LSN_HEADER])
    except (KeyError, ValueError):
        raise MalformedBatch(f"stream message {seq} has no valid {LSN_HEADER} header") from None
    if lsn < 1:
        raise MalformedBatch(f"stream message {seq} starts at lsn {lsn}")
    return lsn


def unframe(body: bytes, seq: int) -> Iterator[bytes]:
    """The payloads of one message body, in order (a truncated body raises: JetStream stores messages whole)."""
    view = memoryview(body)
    offset, end = 0, len(body)
    while offset < end:
        if offset + WORD.size > end:
            raise MalformedBatch(f"stream message {seq} ends inside a record header")
        (word,) = WORD.unpack_from(view, offset)
        size = word & ~REBUILDABLE_BIT
        start = offset + WORD.size
        if start + size > end:
            raise MalformedBatch(f"stream message {seq} ends inside a record")
        yield bytes(view[start : start + size])
        offset = start + size


def record_sizes(body: bytes, seq: int) -> list[int]:
    """The payload sizes of one message body (startup counts bytes since the snapshot without keeping payloads)."""
    return [len(payload) for payload in unframe(body, seq)]
