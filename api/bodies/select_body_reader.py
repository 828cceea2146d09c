# cython: annotation_typing=False, boundscheck=False, wraparound=False
"""A direct reader for the common shape of a ``/select`` body, compiled (README "Compiled hot paths").

A prompt's ``token_ids`` are most of a ``/select`` body (1,024 tokens: ~11 KB of digits). Read through
``orjson.loads``, each becomes a Python int only to be checked as a u32, copied into a tuple and packed into
4 bytes again for hashing: ~60 us of the service's CPU per selection. This reader walks the body's bytes once
and writes the token ids straight into an ``array("I")``, which ``hashing`` packs without a conversion.

It takes only a JSON object whose values are strings without escapes, ``null``, ``true``, ``false``, integers
from 0 to 10**18 - 1 and, as ``token_ids`` only, one array of integers from 0 to 2**32 - 1. Anything else (an
escape, a float, a negative or larger number, a nested object, another array, invalid UTF-8, invalid JSON)
returns None, and the route parses the body the general way, which also words the errors. So it never decides
what is valid: when it answers, the fields are exactly what ``orjson.loads`` gives, ``token_ids`` as an
``array("I")`` instead of a list; the tests hold it to orjson. A repeated key also returns None: the general
way refuses a repeated field, as 1.6.1 does (``api/http/json_keys.py``).

Compiled, it runs in C (``select_body_reader.pxd``); as plain Python it is correct but much slower than
orjson, so the routes use it only when compiled (``COMPILED``).
"""

from __future__ import annotations

from array import array
from typing import Any

COMPILED = not __file__.endswith(".py")  # an extension module's file is the .so
# Whether this module's own C helpers (``select_body_reader.pxd``) exist: fixed at import, whatever a test then sets
# ``COMPILED`` to (the routes' switch) to drive the pure module through them.
_NATIVE = COMPILED

_U32_END = 1 << 32
_U32 = array("I")  # compiled: the template of new arrays (``_new_u32``)
_FAILED = object()  # a value the reader does not take
_TOKEN_IDS = "token_ids"


class _Scanner:
    """A cursor over one body. Methods return a sentinel (-1 / None / ``_FAILED``) where the bytes are not what
    the common shape has; the caller then gives up on the whole body."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.buf = data
        self.pos = 0
        self.end = len(data)

    def skip_ws(self) -> None:
        """Past JSON whitespace (space, tab, line feed, carriage return)."""
        buf, pos, end = self.buf, self.pos, self.end
        while pos < end:
            b = buf[pos]
            if b != 32 and b != 10 and b != 13 and b != 9:
                break
            pos += 1
        self.pos = pos

    def peek(self) -> int:
        """The next byte (not consumed), or -1 at the end."""
        if self.pos >= self.end:
            return -1
        return self.buf[self.pos]

    def string(self) -> str | None:
        """The string starting at the opening quote, if it has no escape and no control character and is UTF-8."""
        buf, end = self.buf, self.end
        start = self.pos + 1
        pos = start
        while pos < end:
            b = buf[pos]
            if b == 34:  # the closing quote
                self.pos = pos + 1
                try:
                    return self.data[start:pos].decode("utf-8")
                except UnicodeDecodeError:
                    return None
            if b == 92 or b < 32:  # an escape (orjson decodes it), or a control character (invalid JSON)
                return None
            pos += 1
        return None

    def literal(self, word: bytes) -> bool:
        """Consume ``word`` (``null``, ``true``, ``false``) if it is next and not the start of a longer word."""
        size = len(word)
        if self.pos + size > self.end or self.data[self.pos : self.pos + size] != word:
            return False
        self.pos += size
        return self.pos >= self.end or not _word_byte(self.buf[self.pos])

    def number(self) -> int:
        """A non-negative integer below 10**18 in JSON's form (no leading zero, no fraction or exponent), or -1."""
        buf, pos, end = self.buf, self.pos, self.end
        value = 0
        digits = 0
        while pos < end:
            b = buf[pos]
            if b < 48 or b > 57:
                break
            if digits == 18:
                return -1
            value = value * 10 + (b - 48)
            digits += 1
            pos += 1
        if digits == 0 or (digits > 1 and buf[self.pos] == 48):
            return -1
        if pos < end and _number_tail(buf[pos]):
            return -1
        self.pos = pos
        return value

    def tokens(self) -> array[int] | None:
        """The array starting at ``[`` as u32s, if every element is an integer in [0, 2**32) in JSON's form."""
        close = self.data.find(b"]", self.pos + 1)
        if close < 0:
            return None
        # Room for as many elements as there can be (each takes two bytes, but the last); cut to size after.
        room = (close - self.pos) // 2 + 1
        packed = _new_u32(room) if _NATIVE else array("I", bytes(4 * room))  # type: ignore[name-defined]  # noqa: F821
        count = self.fill(packed, close)
        if count < 0:
            return None
        del packed[count:]  # (``fill``'s typed view of it is released: it may change size)
        self.pos = close + 1
        return packed

    def fill(self, view: array[int], close: int) -> int:
        """Write the elements before ``close`` (the array's ``]``) into ``view``; how many, or -1."""
        p = self.data  # compiled: a C pointer to the bytes, read at C speed
        pos = self.pos + 1
        count = 0
        while True:
            while pos < close and (p[pos] == 32 or p[pos] == 10 or p[pos] == 13 or p[pos] == 9):
                pos += 1
            if pos == close and count == 0:  # [] (with blanks or not): no element
                return 0
            start = pos
            if _NATIVE:
                pos += _digit_run(p, pos, close)  # type: ignore[name-defined]  # noqa: F821
            else:
                while pos < close and 48 <= p[pos] <= 57:
                    pos += 1
            size = pos - start
            if size == 0 or size > 10 or (size > 1 and p[start] == 48):
                return -1
            if _NATIVE:
                value = _digits_value(p, start, size, self.end)  # type: ignore[name-defined]  # noqa: F821
            else:
                value = 0
                for k in range(start, pos):
                    value = value * 10 + (p[k] - 48)
            if value >= _U32_END:
                return -1
            view[count] = value
            count += 1
            while pos < close and (p[pos] == 32 or p[pos] == 10 or p[pos] == 13 or p[pos] == 9):
                pos += 1
            if pos == close:
                return count
            if p[pos] != 44:  # a comma after each element but the last
                return -1
            pos += 1

    def value(self, key: str) -> Any:
        """The value at the cursor, or ``_FAILED``."""
        b = self.peek()
        if b == 34:  # "
            text = self.string()
            return _FAILED if text is None else text
        if b == 91:  # [
            if key != _TOKEN_IDS:
                return _FAILED
            tokens = self.tokens()
            return _FAILED if tokens is None else tokens
        if b == 110:  # n
            return None if self.literal(b"null") else _FAILED
        if b == 116:  # t
            return True if self.literal(b"true") else _FAILED
        if b == 102:  # f
            return False if self.literal(b"false") else _FAILED
        if 48 <= b <= 57:
            number = self.number()
            return _FAILED if number < 0 else number
        return _FAILED


def _word_byte(b: int) -> bool:
    """Whether ``b`` may continue a bare word or number (so ``nullx`` or ``1a`` is not ``null`` or ``1``)."""
    return 48 <= b <= 57 or 65 <= b <= 90 or 97 <= b <= 122 or b == 95 or b == 46 or b == 45 or b == 43 or b >= 128


def _number_tail(b: int) -> bool:
    """Whether ``b`` after an integer's digits makes it something this reader does not take (a fraction, an
    exponent, or a malformed number)."""
    return b == 46 or b == 101 or b == 69 or _word_byte(b)


def read_select_body(data: bytes) -> dict[str, Any] | None:
    """The fields of a body of the common shape (see the module's docstring), or None."""
    if type(data) is not bytes:
        return None
    scanner = _Scanner(data)
    scanner.skip_ws()
    if scanner.peek() != 123:  # {
        return None
    scanner.pos += 1
    fields: dict[str, Any] = {}
    scanner.skip_ws()
    if scanner.peek() == 125:  # }
        scanner.pos += 1
    else:
        while True:
            if scanner.peek() != 34:
                return None
            key = scanner.string()
            if key is None:
                return None
            scanner.skip_ws()
            if scanner.peek() != 58:  # :
                return None
            scanner.pos += 1
            scanner.skip_ws()
            value = scanner.value(key)
            if value is _FAILED or key in fields:  # (a repeated key: the general way refuses or keeps the last)
                return None
            fields[key] = value
            scanner.skip_ws()
            b = scanner.peek()
            scanner.pos += 1
            if b == 125:
                break
            if b != 44:
                return None
            scanner.skip_ws()
    scanner.skip_ws()
    if scanner.pos != scanner.end:
        return None
    return fields
