"""HTTP/1.x server protocol, sans I/O: bytes in, events out; responses in, bytes out (h11's shape).

No sockets, timers or tasks: ``api/http/h1_connection.py`` is the trio shell that reads the socket, feeds
``receive_data``, runs the app on the events and writes what ``response_head``/``response_body`` return.

Request heads are cut at their blank line and parsed by httptools (llhttp, in C; strict: bare LF, bad
header names, bad or repeated ``Content-Length`` are refused); the framing rules are RFC 9112's, applied
here so that every request meets the same ones:

* the whole head (request line and headers) is at most ``max_head_bytes``: 431 past it;
* ``Transfer-Encoding`` with ``Content-Length`` is refused with 400 (request smuggling, RFC 9112 6.1),
  a transfer coding other than a single ``chunked`` with 501 (400 where chunked is not the final one);
  either way the connection closes after the answer;
* chunk sizes are 1-16 hex digits (a size that does not fit 64 bits is 400 at once), chunk lines and
  trailers are bounded like a head;
* HTTP/1.0 requests are answered and the connection closed (bytes pipelined behind them are ignored);
  versions other than 1.0 and 1.1 get 505;
* ``Expect: 100-continue`` is reported with the head (the shell answers 100 when the app first reads);
* a GET asking to upgrade to ``websocket`` is reported as such (the shell serves WebSockets); an ``h2c``
  upgrade or the HTTP/2 preface hands the connection over (``HandOver``), from the request's first byte.

Every refusal is an ``Refusal`` event with a status and a message, answered as ``{"error": message}``.
"""

from __future__ import annotations

import re
from typing import Final
from urllib.parse import urlsplit

import attrs
import httptools
import orjson

HEAD_END: Final = b"\r\n\r\n"
PREFACE: Final = b"PRI * HTTP/2.0\r\n"
MAX_CHUNK_SIZE_DIGITS: Final = 16  # a chunk size of 64 bits at most
_TRANSFER_ENCODING = re.compile(rb"(?im)^transfer-encoding[ \t]*:[ \t]*([^\r\n]*)")
# h11's grammar for what it sends (RFC 9110 token; a field value without controls or surrounding whitespace).
_TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+")
_DIGITS = re.compile(rb"[0-9]+")
_FIELD_VALUE = re.compile(rb"(?:[\x21-\x7e\x80-\xff](?:[\t\x20-\x7e\x80-\xff]*[\x21-\x7e\x80-\xff])?)?")
_HEX = re.compile(rb"[0-9a-fA-F]+")
_BARE_BLANK_LINE = re.compile(rb"(?<!\r)\n\r?\n|\r\n\n")  # a blank line that is not CRLF CRLF


@attrs.define(slots=True)
class RequestHead:
    """A request's head, as the app will see it (header names lower-cased, values stripped)."""

    method: bytes
    path: bytes  # origin-form path (an absolute-form target's path part)
    query: bytes
    http_version: str  # "1.1" or "1.0"
    headers: list[tuple[bytes, bytes]]
    keep_alive: bool  # the client allows another request on this connection
    expect_continue: bool
    websocket: bool  # a GET asking to upgrade to WebSocket


class Data:
    """A piece of the request's body (a plain class: one is made per body read, on the hot path)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __eq__(self, other: object) -> bool:
        return type(other) is Data and other.data == self.data

    def __hash__(self) -> int:
        return hash(self.data)

    def __repr__(self) -> str:
        return f"Data({self.data!r})"


class EndOfMessage:
    """The request's body is complete."""


END_OF_MESSAGE: Final = EndOfMessage()


@attrs.frozen
class Refusal:
    """The client broke the protocol: answer ``status`` with ``{"error": message}``, then close."""

    status: int
    message: str


@attrs.frozen
class HandOver:
    """HTTP/2 (the preface, or an ``h2c`` upgrade): the connection's bytes from that request's first byte."""

    data: bytes


class NeedData:
    """Nothing more until more bytes arrive (or the end of the stream)."""


NEED_DATA: Final = NeedData()


class Closed:
    """The client ended its side between requests (or within one: then a ``Refusal`` came first)."""


CLOSED: Final = Closed()

Event = RequestHead | Data | EndOfMessage | Refusal | HandOver | NeedData | Closed


# The request headers that decide its framing and handling (``H1Protocol._request``); the rest pass through.
_FRAMING_REQUEST_HEADERS: Final = frozenset(
    (b"host", b"content-length", b"transfer-encoding", b"connection", b"upgrade", b"expect")
)


class _Fields:
    """httptools' callbacks for one head."""

    __slots__ = ("complete", "headers", "url")

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.complete = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value.strip(b" \t")))

    def on_headers_complete(self) -> None:
        self.complete = True


def _bare_blank_line(buffer: bytes, start: int, end: int) -> bool:
    """Whether ``buffer[start:end]`` holds a blank line that is not CRLF CRLF. A head whose every LF follows
    a CR has none, and two memchr-speed counts say so; only a head with a bare LF pays for the regex
    (a quarter of the cost of parsing an ordinary request)."""
    if buffer.count(b"\n", start, end) == buffer.count(b"\r\n", start, end):
        return False
    return _BARE_BLANK_LINE.search(buffer, start, end) is not None


class H1Protocol:
    """One connection's HTTP/1.x, server side: ``receive_data`` then ``next_event`` until ``NEED_DATA``.

    Between requests it reports ``RequestHead`` (the body follows as ``Data`` and ``EndOfMessage``), a
    ``Refusal``, a ``HandOver`` or ``CLOSED``; after ``EndOfMessage`` it waits for ``start_next_request``.
    """

    def __init__(self, max_head_bytes: int) -> None:
        self.max_head_bytes = max_head_bytes
        self._buffer = b""
        self._at = 0  # served up to here (pipelined requests are not copied one by one)
        self._eof = False
        self._state = "idle"  # idle | length | chunk-size | chunk-data | chunk-end | trailers | done | error
        self._left = 0  # body bytes (length) or chunk bytes still to come
        self._trailer_bytes = 0

    # -- bytes in --

    def receive_data(self, data: bytes) -> None:
        """Bytes read from the client; ``b""``: the client ended its side."""
        if not data:
            self._eof = True
        elif self._at < len(self._buffer):
            self._buffer = self._buffer[self._at :] + data
            self._at = 0
        else:
            self._buffer, self._at = data, 0

    @property
    def eof(self) -> bool:
        return self._eof

    @property
    def buffered(self) -> int:
        """Bytes received and not yet reported."""
        return len(self._buffer) - self._at

    def unread(self) -> bytes:
        """The bytes received and not yet reported (for a protocol the connection switches to)."""
        return self._buffer[self._at :]

    @property
    def body_left(self) -> int | None:
        """Body bytes still to come of a ``Content-Length`` body (None: chunked or none in progress)."""
        return self._left if self._state == "length" else None

    @property
    def message_complete(self) -> bool:
        """The current request's body has all been reported (or it has none)."""
        return self._state == "done"

    def start_next_request(self) -> None:
        """The response to the request just read has gone out: the next request may be read."""
        if self._state == "done":
            self._state = "idle"

    def skip_body(self) -> bool:
        """Discard the rest of the current body if it has all arrived (the app answered without reading it).
        False: it has not (the connection cannot be reused: the client cannot tell where it would go on)."""
        while self._state != "done":
            event = self.next_event()
            if event is not END_OF_MESSAGE and not isinstance(event, Data):
                return False
        return True

    # -- events out --

    def next_event(self) -> Event:
        state = self._state
        if state == "idle":
            return self._head()
        if state == "length":
            return self._length_body()
        if state in ("done", "error"):
            return NEED_DATA
        return self._chunked_body()

    def _head(self) -> Event:
        buffer, at = self._buffer, self._at
        if at == len(buffer):
            return CLOSED if self._eof else NEED_DATA
        if buffer.startswith(PREFACE[: len(buffer) - at], at):
            if len(buffer) - at < len(PREFACE):
                return self._refuse(400, "the request ended within its head") if self._eof else NEED_DATA
            return self._hand_over()
        end = buffer.find(HEAD_END, at)
        if _bare_blank_line(buffer, at, end if end >= 0 else len(buffer)):
            return self._refuse(400, "invalid HTTP request: lines must end with CRLF")
        if end < 0 or end + 4 - at > self.max_head_bytes:
            if len(buffer) - at > self.max_head_bytes:
                return self._refuse(431, f"the request head is larger than {self.max_head_bytes} bytes")
            if self._eof:
                return self._refuse(400, "the request ended within its head")
            return NEED_DATA
        head = buffer[at : end + 4]
        found = _Fields()
        parser = httptools.HttpRequestParser(found)
        try:
            parser.feed_data(head)
        except httptools.HttpParserUpgrade:
            pass
        except httptools.HttpParserError as exc:
            return self._refuse_head(head, exc)
        if not found.complete:
            return self._refuse(400, "invalid HTTP request: the head does not end where it should")
        return self._request(head, parser, found)

    def _request(self, head: bytes, parser: httptools.HttpRequestParser, found: _Fields) -> Event:
        version = parser.get_http_version()
        if version not in ("1.1", "1.0"):
            return self._refuse(505, f"HTTP/{version} is not supported on this connection; use HTTP/1.1")
        target = found.url
        if not target.startswith(b"/"):
            parts = urlsplit(target) if target.isascii() else None
            if parts is None or parts.scheme not in (b"http", b"https") or not parts.netloc:
                return self._refuse(400, "the request target must be a path (or an absolute http URI)")
            target = (parts.path or b"/") + (b"?" + parts.query if parts.query else b"")
        elif not target.isascii():
            return self._refuse(400, "the request target is not ASCII")
        hosts = length = 0
        lengths: set[bytes] = set()
        chunked = close = upgrade = expect_continue = False
        upgrade_to = b""
        framing_names = _FRAMING_REQUEST_HEADERS
        for name, value in found.headers:
            if name not in framing_names:
                continue  # (most of a request's headers: one set lookup)
            if name == b"host":
                hosts += 1
            elif name == b"content-length":
                if b"," in value:
                    lengths.update(part.strip() for part in value.split(b","))
                else:
                    lengths.add(value)  # (already stripped)
            elif name == b"transfer-encoding":
                chunked = True  # (llhttp refused any coding but a final chunked, and chunked with a length)
            elif name == b"connection":
                tokens = {token.strip().lower() for token in value.split(b",")}
                close = close or b"close" in tokens
                upgrade = upgrade or b"upgrade" in tokens
            elif name == b"upgrade":
                upgrade_to = value.lower()
            elif name == b"expect":
                expect_continue = value.lower() == b"100-continue"
        if hosts > 1 or (hosts == 0 and version == "1.1"):
            return self._refuse(400, "an HTTP/1.1 request needs exactly one Host header")
        if lengths:
            value = lengths.pop()
            if lengths or not value.isdigit() or len(value) > 18:  # (bytes.isdigit: ASCII digits only)
                return self._refuse(400, "the Content-Length header is not one non-negative integer")
            length = int(value)
        if chunked and version == "1.0":
            return self._refuse(400, "an HTTP/1.0 request cannot have a Transfer-Encoding")
        method = parser.get_method()
        if upgrade and upgrade_to == b"h2c":
            return self._hand_over()
        websocket = upgrade and method == b"GET" and upgrade_to == b"websocket"
        self._at += len(head)
        if chunked:
            self._state = "chunk-size"
        elif length:
            self._state, self._left = "length", length
        else:
            self._state = "done"
        path, _, query = target.partition(b"?")
        return RequestHead(
            method=method,
            path=path,
            query=query,
            http_version=version,
            headers=found.headers,
            keep_alive=version == "1.1" and not close and not websocket,
            expect_continue=expect_continue and version == "1.1",
            websocket=websocket,
        )

    def _refuse_head(self, head: bytes, exc: httptools.HttpParserError) -> Refusal:
        """llhttp's refusal as the API's: a transfer coding it does not take is 501 (400 if chunked is there but
        not alone and last, or comes with a Content-Length), anything else 400."""
        message = str(exc)
        codings = b",".join(_TRANSFER_ENCODING.findall(head)).lower()
        if codings and "Content-Length" in message:
            return self._refuse(400, "a request cannot have both Content-Length and Transfer-Encoding")
        if codings and "Transfer-Encoding" in message:
            if b"chunked" in codings:
                return self._refuse(400, "chunked must be the only transfer coding of a request")
            return self._refuse(501, "the only transfer coding accepted is chunked")
        if "HTTP version" in message:
            return self._refuse(505, "only HTTP/1.1 and HTTP/1.0 are served on this connection")
        if isinstance(exc, httptools.HttpParserInvalidMethodError):
            return self._refuse(400, "invalid HTTP request: unknown method")
        return self._refuse(400, f"invalid HTTP request: {message}")

    def _refuse(self, status: int, message: str) -> Refusal:
        self._state = "error"
        return Refusal(status, message)

    def _hand_over(self) -> HandOver:
        data = self.unread()
        self._buffer, self._at, self._state = b"", 0, "error"
        return HandOver(data)

    # -- bodies --

    def _length_body(self) -> Event:
        available = len(self._buffer) - self._at
        if not available:
            return self._refuse(400, "the request ended within its body") if self._eof else NEED_DATA
        take = min(available, self._left)
        piece = self._buffer[self._at : self._at + take]
        self._at += take
        self._left -= take
        if not self._left:
            self._state = "done"
        return Data(piece)

    def _chunked_body(self) -> Event:
        while True:
            state = self._state
            if state == "chunk-data":
                if self._at == len(self._buffer):
                    break
                take = min(len(self._buffer) - self._at, self._left)
                piece = self._buffer[self._at : self._at + take]
                self._at += take
                self._left -= take
                if not self._left:
                    self._state = "chunk-end"
                return Data(piece)
            end = self._buffer.find(b"\r\n", self._at)
            if end < 0:
                if len(self._buffer) - self._at > self.max_head_bytes:
                    return self._refuse(400, "a chunk line or trailer is too long")
                break
            line = self._buffer[self._at : end]
            self._at = end + 2
            if state == "chunk-end":
                if line:
                    return self._refuse(400, "a chunk's data does not end with CRLF")
                self._state = "chunk-size"
            elif state == "chunk-size":
                size = line.split(b";", 1)[0].rstrip(b" \t")
                if not _HEX.fullmatch(size) or len(size.lstrip(b"0")) > MAX_CHUNK_SIZE_DIGITS:
                    return self._refuse(400, "a chunk size is not a hexadecimal number of at most 64 bits")
                self._left = int(size, 16)
                self._state = "chunk-data" if self._left else "trailers"
            else:  # trailers: read and dropped, bounded like a head
                self._trailer_bytes += len(line) + 2
                if self._trailer_bytes > self.max_head_bytes:
                    return self._refuse(431, "the request's trailers are too large")
                if not line:
                    self._state = "done"
                    self._trailer_bytes = 0
                    return END_OF_MESSAGE
        return self._refuse(400, "the request ended within its body") if self._eof else NEED_DATA


class ResponseFraming:
    """How one response's body goes on the wire, decided from its head (``response_head``)."""

    __slots__ = ("chunked", "close", "length_left", "no_body")

    def __init__(self) -> None:
        self.chunked = False
        self.close = False  # the connection closes after this response
        self.length_left = -1  # content-length bytes still to send (-1: none declared)
        self.no_body = False  # HEAD, 204, 304: nothing after the head


# Headers an app sends again and again (``content-type: application/json``) are checked once: the line made from
# a (name, value) pair as sent, with its lower-cased name, is remembered. Bounded: past MAX_CHECKED_HEADERS
# distinct pairs, new ones are checked every time and not remembered. The framing headers are never remembered
# (their values differ per response, and they set the framing).
MAX_CHECKED_HEADERS: Final = 256
_FRAMING_HEADERS: Final = frozenset((b"content-length", b"transfer-encoding", b"connection", b"host"))
_checked_headers: dict[tuple[bytes, bytes], bytes] = {}


def _header_line(raw_name: object, raw_value: object) -> tuple[bytes, bytes, bytes]:
    """``(lower-cased name, value, line)`` of one app header, stripped and checked as h11 checks what it sends."""
    name, value = bytes(raw_name).strip(), bytes(raw_value).strip()  # type: ignore[call-overload]
    if not _TOKEN.fullmatch(name) or not _FIELD_VALUE.fullmatch(value):
        raise ValueError(f"cannot send the response header {name!r}: {value!r}")
    lowered = name.lower()
    line = b"%s: %s\r\n" % (name, value)
    if lowered not in _FRAMING_HEADERS and len(_checked_headers) < MAX_CHECKED_HEADERS:
        _checked_headers[(bytes(raw_name), bytes(raw_value))] = line  # type: ignore[call-overload]
    return lowered, value, line


def response_head(
    status: int,
    app_headers: object,
    server_lines: bytes,
    framing: ResponseFraming,
    *,
    http_version: str = "1.1",
    head_request: bool = False,
    close: bool = False,
) -> bytes:
    """h11's bytes for a response head (status line, ``Host`` first, the app's headers stripped and in order,
    repeated equal lengths merged, ``server_lines``), refused with ValueError where h11 refuses it. Sets
    ``framing``: chunked when no length is given (close-delimited for an HTTP/1.0 client), ``close``
    when the app, the client or ``close`` asks for it."""
    if not 200 <= status < 1000:
        raise ValueError(f"cannot send status {status}: a response's status is 200-999")
    host: list[bytes] = []
    lines: list[bytes] = []
    length: bytes | None = None
    chunked_asked = False
    framing.close = close or http_version == "1.0"
    checked = _checked_headers
    for raw_name, raw_value in app_headers:  # type: ignore[attr-defined]
        if raw_name == b"content-length" and type(raw_value) is bytes and raw_value.isdigit() and length is None:
            length = raw_value  # the app's own length, as kvrouter's routes send it
            lines.append(b"content-length: %s\r\n" % raw_value)
            continue
        try:
            line = checked.get((raw_name, raw_value))
        except TypeError:  # a bytearray: checked below
            line = None
        if line is not None:
            lines.append(line)
            continue
        lowered, value, line = _header_line(raw_name, raw_value)
        if lowered == b"content-length":
            lengths = {part.strip() for part in value.split(b",")} if b"," in value else {value}
            value = lengths.pop()
            if lengths or not _DIGITS.fullmatch(value) or (length is not None and value != length):
                raise ValueError(f"cannot send conflicting or bad content-length headers ({value!r})")
            if length is not None:
                continue
            length = value
            line = b"%s: %s\r\n" % (bytes(raw_name).strip(), value)
        elif lowered == b"transfer-encoding":
            value = value.lower()
            if chunked_asked or value != b"chunked":
                raise ValueError("a response's only transfer-encoding is one chunked")
            chunked_asked = True
            line = b"%s: %s\r\n" % (bytes(raw_name).strip(), value)
        elif lowered == b"connection" and b"close" in (token.strip() for token in value.lower().split(b",")):
            framing.close = True
        (host if lowered == b"host" else lines).append(line)
    lines.append(server_lines)
    return _framed_head(status, host, lines, length, chunked_asked, framing, http_version, head_request)


def _framed_head(
    status: int,
    host: list[bytes],
    lines: list[bytes],
    length: bytes | None,
    chunked_asked: bool,
    framing: ResponseFraming,
    http_version: str,
    head_request: bool,
) -> bytes:
    """The head's bytes once its headers are checked: the framing decided (``response_head``)."""
    framing.no_body = head_request or status in (204, 304)
    framing.chunked = False
    framing.length_left = -1
    if status not in (204, 304) and (chunked_asked or length is None):
        if length is not None or chunked_asked:
            lines = [line for line in lines if not line.lower().startswith((b"content-length:", b"transfer-encoding:"))]
        if http_version == "1.0":
            framing.close = True  # an HTTP/1.0 client reads to the end of the connection
        else:
            lines.append(b"Transfer-Encoding: chunked\r\n")
            framing.chunked = not framing.no_body
    elif length is not None:
        framing.length_left = int(length)
    if framing.close and not any(line.lower() == b"connection: close\r\n" for line in lines):
        lines.append(b"connection: close\r\n")
    return b"".join([b"HTTP/1.1 %d \r\n" % status, *host, *lines, b"\r\n"])


def response_body(data: bytes, more: bool, framing: ResponseFraming) -> bytes:
    """A piece of the body, framed; ValueError if it runs over (or, as the last piece, under) its length."""
    if framing.no_body:
        return b""
    if framing.chunked:
        framed = b"%x\r\n%s\r\n" % (len(data), data) if data else b""
        return framed + (b"" if more else b"0\r\n\r\n")
    if framing.length_left >= 0:
        framing.length_left -= len(data)
        if framing.length_left < 0 or (not more and framing.length_left > 0):
            raise ValueError(f"a response body {'over' if framing.length_left < 0 else 'under'}ran its content-length")
    return data


def error_response(status: int, message: str, server_lines: bytes) -> bytes:
    """A refusal's whole response: ``{"error": message}`` and ``Connection: close``."""
    body = orjson.dumps({"error": message})
    return b"HTTP/1.1 %d \r\ncontent-type: application/json\r\ncontent-length: %d\r\n%sconnection: close\r\n\r\n%s" % (
        status,
        len(body),
        server_lines,
        body,
    )
