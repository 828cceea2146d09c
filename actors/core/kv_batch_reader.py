# cython: annotation_typing=False, boundscheck=False, wraparound=False
"""A direct reader for the common shape of a KV-event batch, compiled (README "Compiled hot paths").

Older vLLM publishes ``[ts, [["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, lora_name],
["BlockRemoved", hashes, medium], ["AllBlocksCleared"], ...], dp_rank]``; vLLM 0.33 and SGLang 0.5 send the same
batch array with each event a map (``{"type": "BlockStored", "block_hashes": ..., ...}``, fields in any order, some
the decoders do not use). Read through ``msgpack.unpackb``, each token id becomes a Python int (~36 bytes) only to
be packed into 4 again; this reader walks the msgpack bytes once and writes token ids straight into an
``array("I")``. It takes only those shapes, with every value of the type the wire contract names: anything else (a
batch map, newer vLLM's extra array slots, multimodal infos, a remote locality, an out-of-range value, a key
named twice, trailing bytes, a truncated payload) returns None, and ``kv_wire.decode_batch`` decodes the payload
the general way, which also words the errors. So it never decides what is valid; the tests hold it to the
general decoder.

Compiled, it runs in C (``kv_batch_reader.pxd``); as plain Python it is correct but slower than msgpack, so
``kv_wire`` uses it only when compiled (``COMPILED``).
"""

from __future__ import annotations

import struct
from array import array
from typing import Any

COMPILED = not __file__.endswith(".py")  # an extension module's file is the .so

U64_MASK = (1 << 64) - 1
_STORED = b"BlockStored"
_REMOVED = b"BlockRemoved"
_CLEARED = b"AllBlocksCleared"
_NIL = 0xC0
_ZERO_TOKEN = array("I", [0])
# Event tuples handed to kv_wire: (STORED, hashes, parent, tokens, block_size, lora_id, medium, lora_name,
# cache_salt), (REMOVED, hashes, medium), (CLEARED,).
STORED = 0
REMOVED = 1
CLEARED = 2


class _Reader:
    """A cursor over one payload. Methods return a sentinel (-1 / None / False) where the bytes are not what the
    fast shape expects; the caller then gives up on the whole payload."""

    def __init__(self, data: bytes) -> None:
        self.buf = data
        self.pos = 0
        self.end = len(data)
        self.last_start = 0  # where the last string read began

    def byte(self) -> int:
        """The next byte (consumed), or -1 at the end."""
        if self.pos >= self.end:
            return -1
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def be(self, size: int) -> int:
        """A big-endian unsigned integer of ``size`` (1, 2 or 4) bytes, or -1 if the payload ends first."""
        if self.pos + size > self.end:
            return -1
        value = 0
        for i in range(size):
            value = (value << 8) | self.buf[self.pos + i]
        self.pos += size
        return value

    def array_header(self) -> int:
        """The element count of an array, or -1 if the next value is not one."""
        b = self.byte()
        if 0x90 <= b <= 0x9F:
            return b - 0x90
        if b == 0xDC:
            return self.be(2)
        if b == 0xDD:
            return self.be(4)
        return -1

    def map_header(self) -> int:
        """The pair count of a map, or -1 if the next value is not one."""
        b = self.byte()
        if 0x80 <= b <= 0x8F:
            return b - 0x80
        if b == 0xDE:
            return self.be(2)
        if b == 0xDF:
            return self.be(4)
        return -1

    def skip(self, depth: int) -> bool:
        """Step over the next value, whatever it is, checking it as ``msgpack.unpackb`` would; False where it might
        not accept it (truncated, invalid UTF-8, a map key other than a string or bytes, an extension type, nesting
        deeper than ``_MAX_SKIP_DEPTH``): the caller then leaves the payload to the general decoder."""
        b = self.byte()
        if b < 0:
            return False
        if b <= 0x7F or b >= 0xE0 or b == 0xC0 or b == 0xC2 or b == 0xC3:
            return True
        size = -1
        if 0xA0 <= b <= 0xBF or 0xD9 <= b <= 0xDB:  # a string: it must decode as UTF-8
            self.pos -= 1
            return self.string() is not None and self.utf8_ok()
        if 0x90 <= b <= 0x9F or b == 0xDC or b == 0xDD or 0x80 <= b <= 0x8F or b == 0xDE or b == 0xDF:
            if depth >= _MAX_SKIP_DEPTH:
                return False
            is_map = 0x80 <= b <= 0x8F or b == 0xDE or b == 0xDF
            self.pos -= 1
            count = self.map_header() if is_map else self.array_header()
            if count < 0:
                return False
            for _i in range(count):
                if is_map:
                    if self.pos >= self.end:
                        return False
                    key = self.buf[self.pos]
                    if not (0xA0 <= key <= 0xBF or 0xD9 <= key <= 0xDB or 0xC4 <= key <= 0xC6):
                        return False  # msgpack takes only string or bytes keys
                    if not self.skip(depth + 1):
                        return False
                if not self.skip(depth + 1):
                    return False
            return True
        if b == 0xC4:
            size = self.be(1)
        elif b == 0xC5:
            size = self.be(2)
        elif b == 0xC6:
            size = self.be(4)
        elif b == 0xCC or b == 0xD0:
            size = 1
        elif b == 0xCD or b == 0xD1:
            size = 2
        elif b == 0xCA or b == 0xCE or b == 0xD2:
            size = 4
        elif b == 0xCB or b == 0xCF or b == 0xD3:
            size = 8
        if size < 0 or self.pos + size > self.end:
            return False  # an extension type (0xC7-0xC9, 0xD4-0xD8), 0xC1, or cut short
        self.pos += size
        return True

    def utf8_ok(self) -> bool:
        """Whether the string just read (``last_start`` to ``pos``) is valid UTF-8."""
        try:
            bytes(self.buf[self.last_start : self.pos]).decode("utf-8")
        except UnicodeDecodeError:
            return False
        return True

    def nil(self) -> bool:
        """Consume a nil if it is next."""
        if self.pos < self.end and self.buf[self.pos] == _NIL:
            self.pos += 1
            return True
        return False

    def string(self) -> bytes | None:
        """The next value's UTF-8 bytes if it is a string, else None."""
        b = self.byte()
        if 0xA0 <= b <= 0xBF:
            size = b - 0xA0
        elif b == 0xD9:
            size = self.be(1)
        elif b == 0xDA:
            size = self.be(2)
        elif b == 0xDB:
            size = self.be(4)
        else:
            return None
        if size < 0 or self.pos + size > self.end:
            return None
        start = self.last_start = self.pos
        self.pos += size
        return bytes(self.buf[start : self.pos])

    def u32(self) -> int:
        """A non-negative integer below 2**32, or -1 if the next value is anything else."""
        b = self.byte()
        if 0 <= b <= 0x7F:
            return b
        if b == 0xCC:
            return self.be(1)
        if b == 0xCD:
            return self.be(2)
        if b == 0xCE:
            return self.be(4)
        if b == 0xCF or b == 0xD3:  # a 64-bit encoding of a small value: rare, let the general path judge
            return -1
        if b == 0xD0:
            v = self.be(1)
            return v if 0 <= v < 0x80 else -1
        if b == 0xD1:
            v = self.be(2)
            return v if 0 <= v < 0x8000 else -1
        if b == 0xD2:
            v = self.be(4)
            return v if 0 <= v < 0x80000000 else -1
        return -1

    def hash64(self) -> Any:
        """A 64-bit hash as u64 (signed values wrap, as the general decoder does), or None if not an integer."""
        b = self.byte()
        if b < 0:
            return None
        if b <= 0x7F:
            return b
        if b >= 0xE0:
            return (b - 0x100) & U64_MASK
        if b == 0xCC:
            v = self.be(1)
        elif b == 0xCD:
            v = self.be(2)
        elif b == 0xCE:
            v = self.be(4)
        elif b == 0xCF or b == 0xD3:  # u64 or i64: the same 8 bytes either way once a negative one wraps to u64
            if self.pos + 8 > self.end:
                return None
            wide = 0  # compiled: a C u64 (an engine's block hashes are 64-bit: this runs for most of them)
            for i in range(self.pos, self.pos + 8):
                wide = (wide << 8) | self.buf[i]
            self.pos += 8
            return wide
        elif b == 0xD0:
            v = self.be(1)
            return None if v < 0 else ((v - 0x100) if v >= 0x80 else v) & U64_MASK
        elif b == 0xD1:
            v = self.be(2)
            return None if v < 0 else ((v - 0x10000) if v >= 0x8000 else v) & U64_MASK
        elif b == 0xD2:
            v = self.be(4)
            return None if v < 0 else ((v - 0x100000000) if v >= 0x80000000 else v) & U64_MASK
        else:
            return None
        return None if v < 0 else v

    def hashes(self) -> tuple[int, ...] | None:
        count = self.array_header()
        if count < 0:
            return None
        out = []
        for _i in range(count):
            h = self.hash64()
            if h is None:
                return None
            out.append(h)
        return tuple(out)

    def tokens(self) -> array[int] | None:
        count = self.array_header()
        if count < 0 or count > self.end - self.pos:  # at least one byte a token
            return None
        packed = _ZERO_TOKEN * count  # one allocation, zeroed (not a bytes object copied into an array)
        view = packed  # compiled: a typed view, written at C speed
        buf, pos, end = self.buf, self.pos, self.end  # every index below is checked against end first
        for i in range(count):
            if pos >= end:
                return None
            b = buf[pos]
            if b <= 0x7F:  # the encodings of a u32, inline: this loop runs once per token
                t = b
                pos += 1
            elif b == 0xCD and pos + 3 <= end:
                t = (buf[pos + 1] << 8) | buf[pos + 2]
                pos += 3
            elif b == 0xCE and pos + 5 <= end:
                t = (buf[pos + 1] << 24) | (buf[pos + 2] << 16) | (buf[pos + 3] << 8) | buf[pos + 4]
                pos += 5
            else:  # uint8, the signed encodings of a u32, or not a u32 at all
                self.pos = pos
                t = self.u32()
                if t < 0:
                    return None
                pos = self.pos
            view[i] = t
        self.pos = pos
        return packed

    def optional_str(self) -> tuple[bool, str | None]:
        """(ok, text): nil or a UTF-8 string."""
        if self.nil():
            return True, None
        raw = self.string()
        if raw is None:
            return False, None
        try:
            return True, raw.decode("utf-8")
        except UnicodeDecodeError:
            return False, None

    def optional_int(self) -> tuple[bool, Any]:
        """(ok, value): nil or an integer (as the general decoder takes it: signed or unsigned, any width)."""
        if self.nil():
            return True, None
        if self.pos >= self.end:
            return False, None
        b = self.buf[self.pos]
        if b <= 0x7F or b >= 0xE0 or 0xCC <= b <= 0xD3:
            h = self.hash64()
            if h is None:
                return False, None
            if (b == 0xD0 or b == 0xD1 or b == 0xD2 or b == 0xD3 or b >= 0xE0) and h >> 63:
                return True, h - (1 << 64)  # a negative value stays negative
            return True, h
        return False, None


def read_batch(data: bytes) -> tuple[float, Any, list[tuple[Any, ...]]] | None:
    """``(ts, dp_rank, events)`` of a payload in the common shape, else None (decode it the general way)."""
    reader = _Reader(data)
    top = reader.array_header()
    if top != 2 and top != 3:
        return None
    ts = _number(reader)
    if ts is None:
        return None
    count = reader.array_header()
    if count < 0:
        return None
    events = []
    for _i in range(count):
        event = _event(reader)
        if event is None:
            return None
        events.append(event)
    dp_rank = None
    if top == 3 and not reader.nil():
        dp_rank = reader.u32()
        if dp_rank < 0:
            return None
    if reader.pos != reader.end:
        return None
    return ts, dp_rank, events


def _number(reader: _Reader) -> float | None:
    if reader.pos >= reader.end:
        return None
    b = reader.buf[reader.pos]
    if b == 0xCB or b == 0xCA:
        size = 8 if b == 0xCB else 4
        if reader.pos + 1 + size > reader.end:
            return None
        raw = bytes(reader.buf[reader.pos + 1 : reader.pos + 1 + size])
        reader.pos += 1 + size
        return float(struct.unpack(">d" if size == 8 else ">f", raw)[0])
    ok, value = reader.optional_int()
    if not ok or value is None:
        return None
    return float(value)


def _event(reader: _Reader) -> tuple[Any, ...] | None:
    if reader.pos < reader.end and (0x80 <= reader.buf[reader.pos] <= 0x8F or 0xDE <= reader.buf[reader.pos] <= 0xDF):
        return _map_event(reader)
    size = reader.array_header()
    if size < 1:
        return None
    tag = reader.string()
    if tag == _STORED:
        if size < 5 or size > 8:
            return None
        hashes = reader.hashes()
        if hashes is None:
            return None
        parent = None
        if not reader.nil():
            parent = reader.hash64()
            if parent is None:
                return None
        tokens = reader.tokens()
        if tokens is None:
            return None
        block_size = reader.u32()
        if block_size < 0:
            return None
        lora_id = medium = lora_name = None
        if size > 5:
            ok, lora_id = reader.optional_int()
            if not ok:
                return None
        if size > 6:
            ok, medium = reader.optional_str()
            if not ok:
                return None
        if size > 7:
            ok, lora_name = reader.optional_str()
            if not ok:
                return None
        return (STORED, hashes, parent, tokens, block_size, lora_id, medium, lora_name, None)
    if tag == _REMOVED:
        if size < 2 or size > 3:
            return None
        hashes = reader.hashes()
        if hashes is None:
            return None
        medium = None
        if size > 2:
            ok, medium = reader.optional_str()
            if not ok:
                return None
        return (REMOVED, hashes, medium)
    if tag == _CLEARED and size == 1:
        return (CLEARED,)
    return None


# The keys of a map event (vLLM 0.33, SGLang 0.5) the reader takes, each with its bit (``_map_event`` dispatches on
# it, and one named twice is left to the general decoder); any other key's value is stepped over (the general
# decoder ignores it too).
_KEY_BITS = {
    key: 1 << position
    for position, key in enumerate(
        [
            b"type",
            b"block_hashes",
            b"parent_block_hash",
            b"parent_hash",
            b"token_ids",
            b"block_size",
            b"lora_id",
            b"medium",
            b"lora_name",
            b"cache_salt",
            b"locality",
            b"block_mm_infos",
        ]
    )
}
_MAX_SKIP_DEPTH = 32


def _optional_hash(reader: _Reader) -> tuple[bool, Any]:
    """(ok, hash): nil or a 64-bit hash (as u64)."""
    if reader.nil():
        return True, None
    value = reader.hash64()
    return value is not None, value


def _map_event(reader: _Reader) -> tuple[Any, ...] | None:
    """A map event in the common shape: a tag, its fields in any order, no multimodal infos, no locality (nil
    only), each known key once. Else None, and the general decoder decides (it also words the errors)."""
    pairs = reader.map_header()
    if pairs < 0:
        return None
    tag = hashes = parent = parent_old = tokens = lora_id = medium = lora_name = cache_salt = None
    block_size = -1
    seen = 0  # a bit per known key: one named twice is left to the general decoder (whose dict keeps the last)
    for _i in range(pairs):
        key = reader.string()
        if key is None:
            return None
        bit = _KEY_BITS.get(key, 0)
        if bit == 1:
            tag = reader.string()
            ok = tag is not None
        elif bit == 2:
            hashes = reader.hashes()
            ok = hashes is not None
        elif bit == 4:
            ok, parent = _optional_hash(reader)
        elif bit == 8:
            ok, parent_old = _optional_hash(reader)
        elif bit == 16:
            tokens = reader.tokens()
            ok = tokens is not None
        elif bit == 32:
            block_size = reader.u32()
            ok = block_size >= 0
        elif bit == 64:
            ok, lora_id = reader.optional_int()
        elif bit == 128:
            ok, medium = reader.optional_str()
        elif bit == 256:
            ok, lora_name = reader.optional_str()
        elif bit == 512:
            ok, cache_salt = reader.optional_str()
        elif bit == 1024 or bit == 2048:
            ok = reader.nil()  # a remote block's locality, or multimodal hashes: the general decoder's cases
        else:  # a field the decoders do not use: stepped over, checked as msgpack would
            ok = reader.utf8_ok() and reader.skip(0)
        if not ok or seen & bit:
            return None
        seen |= bit
    if tag == _STORED:
        if hashes is None or tokens is None or block_size < 0:
            return None
        chosen = parent if seen & 4 else parent_old  # parent_block_hash wins when both are named
        return (STORED, hashes, chosen, tokens, block_size, lora_id, medium, lora_name, cache_salt)
    if tag == _REMOVED:
        if hashes is None:
            return None
        return (REMOVED, hashes, medium)
    if tag == _CLEARED:
        return (CLEARED,)
    return None
