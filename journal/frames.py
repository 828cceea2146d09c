"""The frame: how one record (or one snapshot) is laid out in a file, and how damage is told from a tear.

A frame is ``[u32 BE kind << 29 | body length][u32 BE crc32(body)][body]`` with ``body = [u64 BE lsn][payload]``.
The payload is opaque here; the domain's codec versions it.

The top three bits of the first word are the frame's kind (``FrameKind``); the body length needs 29 bits at most
(``MAX_BODY``). Frames written before kinds existed have zeros there: they read as ``RECORD``, so every older
segment reads as it did (``tests/journal/golden`` holds one of each). The kind is *not* covered by the checksum:
it exists for the case where the checksum fails. A writer marks a record ``REBUILDABLE`` when losing it costs
nothing another source cannot give back (the domain says which: ``Journal.append``); recovery may then skip that
record if it is damaged, instead of refusing to start. So that damage cannot turn an ordinary record into a
skippable one, the two kinds differ in all three bits (0b000 and 0b111), and a damaged record is skipped only
when the frame after it confirms its length, which shares the word with the kind (``damaged_frame_end``).

``QUARANTINED`` marks a placeholder ``kvrouter journal quarantine`` wrote over one damaged record (kept
elsewhere): same place, same length, zeroed payload, and a checksum seeded with ``QUARANTINE_SEED``, so neither
a bit flip of an ordinary frame nor damage to the placeholder reads as one.
"""

from __future__ import annotations

import enum
import struct
import zlib
from typing import Final

import attrs

MAX_PAYLOAD_BYTES: Final = 1 << 28  # a sanity bound; it also lets recovery reject absurd lengths

HEAD: Final = struct.Struct(">II")  # kind and body length, crc32 of body
LSN: Final = struct.Struct(">Q")
LSN_BYTES: Final = LSN.size
HEADER: Final = struct.Struct(">IIQ")  # HEAD and LSN together
FRAME_OVERHEAD: Final = HEAD.size + LSN_BYTES
MAX_BODY: Final = LSN_BYTES + MAX_PAYLOAD_BYTES

KIND_SHIFT: Final = 29
LENGTH_MASK: Final = (1 << KIND_SHIFT) - 1
assert MAX_BODY <= LENGTH_MASK
QUARANTINE_SEED: Final = zlib.crc32(b"kvrouter journal: quarantined record")


class FrameKind(enum.IntEnum):
    RECORD = 0b000  # an ordinary record (and every frame written before kinds existed, and snapshots)
    REBUILDABLE = 0b111  # its writer can rebuild it from another source: recovery may skip it when damaged
    QUARANTINED = 0b101  # a placeholder for a record moved out by ``kvrouter journal quarantine``


REBUILDABLE_BITS: Final = FrameKind.REBUILDABLE << KIND_SHIFT


def encode_frame(lsn: int, payload: bytes, kind: FrameKind = FrameKind.RECORD) -> bytes:
    """One frame, exactly as ``FileJournal.append`` lays it out (snapshot files use it too)."""
    seed = QUARANTINE_SEED if kind is FrameKind.QUARANTINED else 0
    crc = zlib.crc32(payload, zlib.crc32(LSN.pack(lsn), seed))
    return HEADER.pack(kind << KIND_SHIFT | (LSN.size + len(payload)), crc, lsn) + payload


def quarantine_frame(lsn: int, frame_size: int) -> bytes:
    """The placeholder that takes the place of a frame of ``frame_size`` bytes (header included) at ``lsn``."""
    return encode_frame(lsn, bytes(frame_size - FRAME_OVERHEAD), FrameKind.QUARANTINED)


class Bad(enum.Enum):
    HEADER = "incomplete header"
    LENGTH = "impossible length"
    INCOMPLETE = "incomplete frame"
    CHECKSUM = "checksum mismatch"
    QUARANTINED = "quarantined"  # not damage: a valid placeholder, whose lsn is ``BadFrame.lsn``


@attrs.frozen
class BadFrame:
    kind: Bad
    detail: str
    length: int = 0
    # CHECKSUM: whether the frame's kind says REBUILDABLE (trust it only once ``damaged_frame_end`` confirms the
    # length, which shares its word).
    rebuildable: bool = False
    lsn: int = 0  # QUARANTINED: the placeholder's lsn (covered by its checksum)


def parse_frame(data: bytes, offset: int) -> tuple[int, int] | BadFrame:
    """Return (lsn, end offset) of the frame at ``offset``, or why it is not a valid frame."""
    available = len(data) - offset
    if available < HEAD.size:
        return BadFrame(Bad.HEADER, f"incomplete frame header ({available} of {HEAD.size} bytes)")
    word, crc = HEAD.unpack_from(data, offset)
    length = word & LENGTH_MASK
    if not LSN.size <= length <= MAX_BODY:
        return BadFrame(Bad.LENGTH, f"impossible frame length {length}")
    end = offset + HEAD.size + length
    if end > len(data):
        have = available - HEAD.size
        return BadFrame(Bad.INCOMPLETE, f"incomplete frame ({have} of {length} body bytes)", length)
    body = memoryview(data)[offset + HEAD.size : end]
    if zlib.crc32(body) != crc:
        kind = word >> KIND_SHIFT
        if kind == FrameKind.QUARANTINED and zlib.crc32(body, QUARANTINE_SEED) == crc:
            return BadFrame(Bad.QUARANTINED, "quarantined", length, lsn=LSN.unpack_from(data, offset + HEAD.size)[0])
        return BadFrame(Bad.CHECKSUM, "checksum mismatch", length, kind == FrameKind.REBUILDABLE)
    return LSN.unpack_from(data, offset + HEAD.size)[0], end


def damaged_frame_end(data: bytes, offset: int, bad: BadFrame, lsn: int) -> int | None:
    """Where the frame after the damaged one at ``offset`` (expected to hold ``lsn``) starts, when its own
    length says so and the bytes there agree: the file ends exactly there, or a frame of ``lsn + 1`` starts
    there. None when the length cannot be trusted (then ``find_next_frame`` may still find the next record)."""
    if bad.kind is not Bad.CHECKSUM:
        return None
    end = offset + HEAD.size + bad.length
    if end == len(data):
        return end
    if end + HEADER.size <= len(data) and LSN.unpack_from(data, end + HEAD.size)[0] == lsn + 1:
        after = parse_frame(data, end)
        if not isinstance(after, BadFrame) or after.kind in (Bad.CHECKSUM, Bad.QUARANTINED):
            return end
    return None


def find_next_frame(data: bytes, offset: int, lsn: int) -> int | None:
    """The offset of the first valid frame of ``lsn + 1`` after ``offset`` (where a damaged frame of ``lsn``
    starts), whatever the damaged frame's header says; None if there is none in ``data``."""
    pattern = LSN.pack(lsn + 1)
    at = data.find(pattern, offset + HEAD.size + 1)
    while at != -1:
        start = at - HEAD.size
        parsed = parse_frame(data, start)
        if not isinstance(parsed, BadFrame) and parsed[0] == lsn + 1:
            return start
        at = data.find(pattern, at + 1)
    return None


@attrs.frozen
class Tear:
    """Bytes at the end of the last segment that recovery may cut: an append a crash interrupted."""

    why: str
    # A whole final frame whose checksum fails: most likely a torn write into preallocated space,
    # but it may be damage to a record that was acknowledged, so it is reported as an error.
    suspicious: bool = False


def torn_tail(data: bytes, offset: int, expected_lsn: int, bad: BadFrame) -> Tear | None:
    """Describe the bytes from ``offset`` to the end if they look like an interrupted append.

    None means real data follows the bad frame (so it is damage, not a torn tail).
    """
    if bad.kind is Bad.QUARANTINED:
        return None
    rest = len(data) - offset
    if data.count(0, offset) == rest:
        return Tear(f"{rest} zero bytes: preallocated space or a torn append left by a crash")
    if bad.kind is Bad.CHECKSUM:
        end = offset + HEAD.size + bad.length
        if data.count(0, end) != len(data) - end:
            return None
        return Tear("a complete final frame that fails its checksum", suspicious=True)
    # The length may be what is damaged: look for a valid frame (or placeholder) of the next few LSNs further on.
    for lsn in range(expected_lsn, expected_lsn + 4):
        pattern = LSN.pack(lsn)
        at = data.find(pattern, offset + HEAD.size + 1)
        while at != -1:
            found = parse_frame(data, at - HEAD.size)
            if not isinstance(found, BadFrame) or found.kind is Bad.QUARANTINED:
                return None
            at = data.find(pattern, at + 1)
    return Tear(bad.detail)
