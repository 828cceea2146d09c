"""How the JetStream journal lays records out in its stream: one NATS message per group commit.

Pure (no I/O): the JetStream journal (``journal/jetstream``) frames and unframes with it, and tests check it alone.

Each message on the journal's subject holds the records of one group commit (or a part of one, when the group
exceeds the server's ``max_payload``), in LSN order, with no gap:

* header ``Kvr-Lsn``: the LSN of the message's first record (the others follow, one apart);
* header ``Kvr-Journal``: the layout's version (``FORMAT``), so a reader refuses a layout it does not know;
* header ``Nats-Expected-Last-Subject-Sequence``: the fence (the stream sequence of the subject's last message as
  the writer knows it; JetStream refuses the message if another writer appended since);
* body: for each record, a 4-byte big-endian word (the payload's length, bit 31 set when the writer marked it
  rebuildable), then the payload.

One message per group makes the fence exact (a group lands whole or not at all) and costs one acknowledgement per
group instead of one per record. JetStream checksums what it stores, so the frames carry no CRC of their own.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Final

FORMAT: Final = "1"
LSN_HEADER: Final = "Kvr-Lsn"
FORMAT_HEADER: Final = "Kvr-Journal"
FENCE_HEADER: Final = "Nats-Expected-Last-Subject-Sequence"
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


def headers(first_lsn: int, expected_last_sequence: int) -> dict[str, str]:
    return {LSN_HEADER: str(first_lsn), FORMAT_HEADER: FORMAT, FENCE_HEADER: str(expected_last_sequence)}


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
