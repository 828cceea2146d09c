"""The sans-I/O HTTP/1 protocol's head checks, against their plain definitions."""

from __future__ import annotations

import re

from hypothesis import example, given
from hypothesis import strategies as st

from kvrouter.api.http.h1_protocol import H1Protocol, Refusal, RequestHead, _bare_blank_line

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
