"""The sans-I/O HTTP/1 protocol's head checks, against their plain definitions."""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvrouter.api.http import h1_protocol
from kvrouter.api.http.h1_protocol import (
    MAX_CHECKED_HEADERS,
    H1Protocol,
    Refusal,
    RequestHead,
    ResponseFraming,
    _bare_blank_line,
    response_head,
)

# The definition the fast check must agree with: a blank line that is not CRLF CRLF.
BARE_BLANK_LINE = re.compile(rb"(?<!\r)\n\r?\n|\r\n\n")

head_bytes = st.lists(st.sampled_from([b"\r", b"\n", b"\r\n", b"a", b":", b" ", b"\r\n\r\n"]), max_size=24).map(
    b"".join
)


@given(head_bytes, st.integers(0, 30), st.integers(0, 30))
@example(b"x\r\n\nHost: a", 0, 11)
@example(b"\r\n\n", 1, 3)  # the CR before the window's first LF is outside it
@example(b"GET / HTTP/1.1\nHost: a\n\n", 0, 24)
def test_the_fast_bare_blank_line_check_agrees_with_the_regex(buffer: bytes, start: int, end: int) -> None:
    assert _bare_blank_line(buffer, start, end) == (BARE_BLANK_LINE.search(buffer, start, end) is not None)


def test_a_head_with_a_bare_lf_blank_line_is_refused_and_an_ordinary_one_is_not() -> None:
    ordinary = H1Protocol(16384)
    ordinary.receive_data(b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n")
    assert isinstance(ordinary.next_event(), RequestHead)
    smuggling = H1Protocol(16384)
    smuggling.receive_data(b"GET /health HTTP/1.1\r\nHost: a\n\nGET /x HTTP/1.1\r\nHost: a\r\n\r\n")
    refused = smuggling.next_event()
    assert isinstance(refused, Refusal) and refused.status == 400


def test_response_heads_are_the_same_whether_their_header_lines_were_remembered_or_not() -> None:
    # A header pair checked once is remembered (at most MAX_CHECKED_HEADERS of them); past the bound, new pairs
    # are checked each time. Either way the head's bytes, and its refusals, are the same.
    h1_protocol._checked_headers.clear()
    first = [
        response_head(200, [(b"x-n", b"%d" % n), (b"content-length", b"2")], b"", ResponseFraming())
        for n in range(MAX_CHECKED_HEADERS + 50)
    ]
    assert len(h1_protocol._checked_headers) == MAX_CHECKED_HEADERS
    again = [
        response_head(200, [(b"x-n", b"%d" % n), (b"content-length", b"2")], b"", ResponseFraming())
        for n in range(MAX_CHECKED_HEADERS + 50)
    ]
    assert again == first
    assert first[3] == b"HTTP/1.1 200 \r\nx-n: 3\r\ncontent-length: 2\r\n\r\n"
    for bad in ([(b"x-a", b"1\r\nx-b: 2")], [(b"content-length", b"2"), (b"content-length", b"3")]):
        for _ in range(2):  # (a refused pair is not remembered)
            with pytest.raises(ValueError):
                response_head(200, bad, b"", ResponseFraming())
