"""The frame: how one record (or one snapshot) is laid out in a file, and how damage is told from a tear.

A frame is ``[u32 BE body length][u32 BE crc32(body)][body]`` with ``body = [u64 BE lsn][payload]``.
The payload is opaque here; the domain's codec versions it.
"""

from __future__ import annotations

import enum
import struct
import zlib
from typing import Final

import attrs

MAX_PAYLOAD_BYTES: Final = 1 << 28  # a sanity bound; it also lets recovery reject absurd lengths

HEAD: Final = struct.Struct(">II")  # body length, crc32 of body
LSN: Final = struct.Struct(">Q")
LSN_BYTES: Final = LSN.size
HEADER: Final = struct.Struct(">IIQ")  # HEAD and LSN together
FRAME_OVERHEAD: Final = HEAD.size + LSN_BYTES
MAX_BODY: Final = LSN_BYTES + MAX_PAYLOAD_BYTES


def encode_frame(lsn: int, payload: bytes) -> bytes:
    """One frame, exactly as ``FileJournal.append`` lays it out (snapshot files use it too)."""
    crc = zlib.crc32(payload, zlib.crc32(LSN.pack(lsn)))
    return HEADER.pack(LSN.size + len(payload), crc, lsn) + payload


class Bad(enum.Enum):
    HEADER = "incomplete header"
    LENGTH = "impossible length"
    INCOMPLETE = "incomplete frame"
    CHECKSUM = "checksum mismatch"


@attrs.frozen
class BadFrame:
    kind: Bad
    detail: str
    length: int = 0


def parse_frame(data: bytes, offset: int) -> tuple[int, int] | BadFrame:
    """Return (lsn, end offset) of the frame at ``offset``, or why it is not a valid frame."""
    available = len(data) - offset
    if available < HEAD.size:
        return BadFrame(Bad.HEADER, f"incomplete frame header ({available} of {HEAD.size} bytes)")
    length, crc = HEAD.unpack_from(data, offset)
    if not LSN.size <= length <= MAX_BODY:
        return BadFrame(Bad.LENGTH, f"impossible frame length {length}")
    end = offset + HEAD.size + length
    if end > len(data):
        have = available - HEAD.size
        return BadFrame(Bad.INCOMPLETE, f"incomplete frame ({have} of {length} body bytes)", length)
    if zlib.crc32(memoryview(data)[offset + HEAD.size : end]) != crc:
        return BadFrame(Bad.CHECKSUM, "checksum mismatch", length)
    return LSN.unpack_from(data, offset + HEAD.size)[0], end


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
    rest = len(data) - offset
    if data.count(0, offset) == rest:
        return Tear(f"{rest} zero bytes: preallocated space or a torn append left by a crash")
    if bad.kind is Bad.CHECKSUM:
        end = offset + HEAD.size + bad.length
        if data.count(0, end) != len(data) - end:
            return None
        return Tear("a complete final frame that fails its checksum", suspicious=True)
    # The length may be what is damaged: look for a valid frame of the next few LSNs further on.
    for lsn in range(expected_lsn, expected_lsn + 4):
        pattern = LSN.pack(lsn)
        at = data.find(pattern, offset + HEAD.size + 1)
        while at != -1:
            if not isinstance(parse_frame(data, at - HEAD.size), BadFrame):
                return None
            at = data.find(pattern, at + 1)
    return Tear(bad.detail)
