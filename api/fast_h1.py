"""Plain HTTP/1.1 requests served without hypercorn's per-request machinery; hypercorn for everything else.

Under hypercorn 0.18 a small request costs ~250 µs of CPU here before the app runs (h11's parse and
serialise in Python, a stream, event and task per request, the ASGI plumbing between them), against the
reference's ~30 µs for its whole ``/health``. ``FastH1Connection`` serves the common case itself: a
keep-alive HTTP/1.1 request with a ``Content-Length`` body or none, parsed by httptools (llhttp, in C),
the app called inline in the connection's task (ASGI ``receive`` reads the body straight from the socket,
``send`` writes head and body in one write).

Everything else goes to hypercorn, from the first byte of the request that is not plain: the bytes read so
far are handed back (``_Stream.replay``) and hypercorn's connection serves the rest of the connection as
before, with its exact behaviour — WebSocket and h2c upgrades, the HTTP/2 preface, chunked bodies,
``Expect: 100-continue``, ``Connection`` headers other than ``keep-alive``, HTTP/1.0, absolute-form
targets, missing or repeated ``Host``, heads over ``h11_max_incomplete_size`` and anything llhttp refuses
(hypercorn then answers it as it always has). Requests are cut at the head's end (``\\r\\n\\r\\n``) and the
body's declared length before llhttp sees them, so a request's first byte is always known and the parser
only ever holds one head.

What a client sees is what hypercorn would send (tests/api/test_fast_h1.py compares the bytes): h11's
status line and header order, hypercorn's ``date`` and ``server`` headers, ``Connection: close`` while
draining, a 500 with ``Connection: close`` if the app fails before answering, chunked framing for a body
of unknown length. The timers are hypercorn's too: a head must be complete ``keep_alive_timeout`` after
the connection opened or the last response went out, any read waits at most ``read_timeout``, and a
server that is terminating closes idle connections (``close_if_idle``) and every connection after its
current response.
"""

from __future__ import annotations

import errno
import math
import os
import re
from collections.abc import Callable
from time import time
from typing import Any
from urllib.parse import unquote

import httptools
import trio
from hypercorn.config import Config
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.utils import parse_socket_addr

MAX_RECV = 64 * 1024  # bytes per read, as hypercorn's
YIELD_EVERY = 16  # requests answered from bytes already read before the task yields to the scheduler
PLAIN_METHODS = frozenset({b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"PATCH", b"OPTIONS"})
HEAD_END = b"\r\n\r\n"
# Where h11 ends a head (the first blank line, CRLF or bare LF), and the request line of a plain request.
_BLANK_LINE = re.compile(rb"\n\r?\n")
_REQUEST_LINE = re.compile(rb"[A-Z]+ /[\x21-\x7e]* HTTP/1\.1\r\n")
# Request headers that hypercorn acts on (framing, upgrades, 100-continue): such a request is not plain.
NOT_PLAIN_HEADERS = frozenset({b"transfer-encoding", b"upgrade", b"expect", b"http2-settings"})
CONNECTION_CLOSE = (b"connection", b"close")
# h11's grammar for what it will send (RFC 9110 token; a field value without CR, LF, NUL or other controls
# and without surrounding whitespace): a header h11 would refuse to send is refused here too.
_TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+")
_DIGITS = re.compile(rb"[0-9]+")
_FIELD_VALUE = re.compile(rb"(?:[\x21-\x7e\x80-\xff](?:[\t\x20-\x7e\x80-\xff]*[\x21-\x7e\x80-\xff])?)?")

Replay = bytes  # what a connection hands to hypercorn: the unserved bytes, from a request's first byte


class _Head:
    """llhttp's callbacks for one request head (httptools' protocol object). It is fed the bytes up to the
    first blank line; if llhttp saw a head end elsewhere (more than one message, or body bytes), the head is
    not plain."""

    __slots__ = ("complete", "headers", "messages", "saw_body", "url")

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.complete = False
        self.messages = 0
        self.saw_body = False

    def on_message_begin(self) -> None:
        self.messages += 1

    def on_body(self, body: bytes) -> None:
        self.saw_body = True

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value.strip(b" \t")))

    def on_headers_complete(self) -> None:
        self.complete = True


class ResponseHeaders:
    """hypercorn's ``config.response_headers("h11")`` (``date``, ``server``) as header lines, made once a
    second: the date is formatted to the second, so the bytes are those of making them per response."""

    def __init__(self, config: Config) -> None:
        self._config = config
        self._second = -1
        self._lines = b""

    def lines(self) -> bytes:
        second = int(time())
        if second != self._second:
            self._lines = b"".join(b"%s: %s\r\n" % pair for pair in self._config.response_headers("h11"))
            self._second = second
        return self._lines


class FastH1Connection:
    """One connection's plain HTTP/1.1 requests (see the module doc).

    ``serve`` returns when the connection is over (None) or with the bytes hypercorn is to go on from.
    """

    def __init__(
        self,
        stream: Any,
        app: Callable[..., Any],
        config: Config,
        context: WorkerContext,
        response_headers: ResponseHeaders,
    ) -> None:
        self._stream = stream  # kvrouter's connection stream (api/server.py ``_Stream``)
        self._fd = stream.socket.fileno()
        self._app = app
        self._config = config
        self._context = context
        self._response_headers = response_headers
        self._buffer = b""  # read; served up to ``_at`` (an offset: pipelined requests are not copied one by one)
        self._at = 0
        self._eof = False
        self._idle = True  # between requests (a terminating server may close the connection now)
        self._wait: trio.CancelScope | None = None  # the read in progress, while idle
        sock = stream.socket
        self._client = parse_socket_addr(sock.family, sock.getpeername())
        self._server = parse_socket_addr(sock.family, sock.getsockname())
        # The request being answered.
        self._requests = 0  # requests on this connection so far (hypercorn's keep_alive_requests)
        self._body_left = 0  # bytes of its body the app has not received yet
        self._body_delivered = False  # the app has had the whole body (more_body false)
        self._started = False  # the response's head is decided
        self._finished = False  # the whole response went out
        self._must_close = False  # close after this response
        self._chunked = False
        self._suppress_body = False
        self._method = b""
        self._head = b""  # the response head, held for its body (``send_whole``)
        self._holding_head = False
        self._length_left = 0  # body bytes the response's content-length still announces
        self._broken = False  # a write failed (or hypercorn would have refused the request): send nothing more
        self._read_over = False  # the client's side ended, or fell silent, during this request: close after it
        self._waited = False  # the last reads waited for the socket (a scheduling point)

    # -- reading --

    async def _read(self, deadline: float) -> bool:
        """Append what the socket has to the buffer, waiting until ``deadline`` (and at most the read timeout)
        for it. False: nothing more will come (end of stream, a broken connection, or time is up)."""
        if self._eof:
            return False
        while True:
            try:
                data = os.read(self._fd, MAX_RECV)
            except BlockingIOError:
                pass
            except OSError as exc:
                if exc.errno != errno.EINTR:
                    self._eof = True
                    return False
                continue
            else:
                if not data:
                    self._eof = True
                    return False
                self._buffer = self._buffer[self._at :] + data if self._at < len(self._buffer) else data
                self._at = 0
                return True
            read_timeout = self._config.read_timeout
            if read_timeout:
                deadline = min(deadline, trio.current_time() + read_timeout)
            self._waited = True
            with trio.CancelScope(deadline=deadline) as wait:
                self._wait = wait
                try:
                    await trio.lowlevel.wait_readable(self._fd)
                except (trio.ClosedResourceError, trio.BrokenResourceError, OSError):
                    self._eof = True
                    return False
                finally:
                    self._wait = None
            if wait.cancelled_caught:
                return False

    def _read_ready(self) -> None:
        """Append what the socket has now, without waiting."""
        if self._eof:
            return
        try:
            data = os.read(self._fd, MAX_RECV)
        except OSError:
            return  # nothing yet (or broken: the next read or write finds out)
        if not data:
            self._eof = True
        else:
            self._buffer = self._buffer[self._at :] + data if self._at < len(self._buffer) else data
            self._at = 0

    def _unserved(self) -> bytes:
        return self._buffer[self._at :]

    def _could_be_plain(self) -> bool:
        """Whether the unserved bytes can still become a plain request (else hypercorn answers them now)."""
        line_end = self._buffer.find(b"\n", self._at)
        if line_end < 0:
            return self._at == len(self._buffer) or 65 <= self._buffer[self._at] <= 90  # an upper-case method
        return _REQUEST_LINE.match(self._buffer, self._at) is not None

    def close_if_idle(self) -> None:
        """The server is terminating: stop waiting for a next request (a request being read or answered
        finishes first)."""
        if self._idle and self._wait is not None:
            self._wait.cancel()

    # -- the connection --

    async def serve(self) -> Replay | None:
        answered_without_waiting = 0
        terminated = self._context.terminated
        limit = self._config.h11_max_incomplete_size
        while True:
            self._idle = True
            if terminated.is_set():
                return None
            idle_deadline = trio.current_time() + self._config.keep_alive_timeout
            while (blank_line := _BLANK_LINE.search(self._buffer, self._at)) is None:
                if len(self._buffer) - self._at > limit or not self._could_be_plain():
                    return self._unserved()  # hypercorn refuses an oversized head (431), or a bad request line
                self._waited = False
                if not await self._read(idle_deadline):
                    if self._eof and self._at < len(self._buffer):
                        return self._unserved()  # a partial request, then the end: hypercorn answers it
                    return None
                if self._waited:
                    answered_without_waiting = 0
            self._idle = False
            head_end = blank_line.end()
            if (
                head_end - self._at > limit
                or self._buffer[head_end - 4 : head_end] != HEAD_END
                or head_end - 4 < self._at
                or _REQUEST_LINE.match(self._buffer, self._at) is None
            ):
                return self._unserved()
            scope = self._parse(self._buffer[self._at : head_end])
            if scope is None:
                return self._unserved()  # not plain: hypercorn serves it, and the rest of the connection
            self._at = head_end
            if not await self._answer(scope):
                return None
            # Requests answered from bytes already read, by an app that need not wait either, would keep every
            # other task waiting: give way every few (a real wait for the socket counts as one).
            answered_without_waiting += 1
            if answered_without_waiting >= YIELD_EVERY:
                answered_without_waiting = 0
                await trio.lowlevel.checkpoint()

    def _parse(self, head: bytes) -> dict[str, Any] | None:
        """The ASGI scope of a plain request head (as hypercorn makes it), else None. Sets the body's length."""
        found = _Head()
        parser = httptools.HttpRequestParser(found)
        try:
            parser.feed_data(head)
        except httptools.HttpParserUpgrade:
            return None
        except httptools.HttpParserError:
            return None
        method = parser.get_method()
        url = found.url
        if (
            not found.complete
            or found.messages != 1
            or found.saw_body
            or method not in PLAIN_METHODS
            or parser.get_http_version() != "1.1"
            or not url.startswith(b"/")
            or not url.isascii()
        ):
            return None
        hosts = 0
        length = -1
        for name, value in found.headers:
            if name == b"host":
                hosts += 1
            elif name == b"content-length":
                if length >= 0 or not value.isdigit():
                    return None
                length = int(value)
            elif name in NOT_PLAIN_HEADERS or (name == b"connection" and value.lower() != b"keep-alive"):
                return None
        if hosts != 1:
            return None
        self._body_left = max(length, 0)
        self._method = method
        path, _, query = url.partition(b"?")
        return {
            "type": "http",
            "http_version": "1.1",
            "asgi": {"spec_version": "2.1", "version": "3.0"},
            "method": method.decode(),
            "scheme": "http",
            "path": unquote(path.decode("ascii")),
            "raw_path": path,
            "query_string": query,
            "root_path": self._config.root_path,
            "headers": found.headers,
            "client": self._client,
            "server": self._server,
            "state": {},
            "extensions": {},
        }

    async def _answer(self, scope: dict[str, Any]) -> bool:
        """Run the app on one request. True: the connection stays open for the next."""
        self._started = self._finished = self._must_close = self._chunked = self._broken = False
        self._body_delivered = self._read_over = False
        self._requests += 1
        self._head = b""
        self._length_left = 0
        self._suppress_body = self._method == b"HEAD"
        try:
            await self._app(scope, self._receive, self._send)
        except Exception:
            await self._config.log.exception("Error in ASGI Framework")
        if self._broken:
            return False
        if not self._started:
            await self._write(self._error_response(500, from_the_app=True))
            return False
        if not self._finished or self._must_close or self._read_over:
            return False  # (a response cut short: the client cannot tell where it ends)
        if self._body_left:
            # Answered without reading the body: as under hypercorn (whose reader takes it meanwhile), the
            # connection goes on if the body has arrived, and skips it.
            self._read_ready()
            if len(self._buffer) - self._at < self._body_left:
                return False
            self._at += self._body_left
            self._body_left = 0
        return True

    async def _receive(self) -> dict[str, Any]:
        """The next piece of the request body (ASGI ``http.request``; one, empty, if it has none), then
        ``http.disconnect`` once the response has gone out or the client's side ends (as hypercorn: a client
        that ends its side within a body gets h11's 400, silence for the read timeout ends the reading; the
        app's answer then still goes out, and the connection closes after it)."""
        if self._body_delivered:
            if self._finished or self._broken or self._read_over:
                return {"type": "http.disconnect"}
            # The app waits for the client to go away: read (and keep, up to the head limit) what it sends.
            while len(self._buffer) - self._at <= self._config.h11_max_incomplete_size:
                if not await self._read(math.inf):
                    self._read_over = True
                    return {"type": "http.disconnect"}
            await trio.sleep_forever()
        if self._body_left and self._at >= len(self._buffer) and not await self._read(math.inf):
            self._read_over = True
            if self._eof and not self._started:
                await self._write(self._error_response(400, from_the_app=False))
                self._broken = True  # (hypercorn sends nothing of the app's after h11's refusal)
            return {"type": "http.disconnect"}
        piece = self._buffer[self._at : self._at + self._body_left]
        self._at += len(piece)
        self._body_left -= len(piece)
        self._body_delivered = self._body_left == 0
        return {"type": "http.request", "body": piece, "more_body": not self._body_delivered}

    async def send_whole(self, start: dict[str, Any], body: dict[str, Any]) -> None:
        """``start`` and its final ``body``, as one write (``hypercorn_adapter.send_whole_response``)."""
        self._holding_head = True
        try:
            await self._send(start)
            await self._send(body)
        finally:
            self._holding_head = False
            if self._head:
                head, self._head = self._head, b""
                await self._write(head)

    async def _send(self, message: dict[str, Any]) -> None:
        """ASGI ``send``, as hypercorn's: the head goes out at once (unless a whole response is being sent),
        body bytes as they come, framed as the head says; bytes beyond a declared length are refused."""
        kind = message["type"]
        if self._broken or self._finished:
            return
        if kind == "http.response.start":
            if self._started:
                return
            head = self._response_head(int(message["status"]), message.get("headers", ()))
            self._started = True  # (a head that cannot be sent leaves the request unanswered: a 500)
            if self._holding_head:
                self._head = head
            else:
                await self._write(head)
        elif kind == "http.response.body" and self._started:
            body = bytes(message.get("body", b""))
            more = message.get("more_body", False)
            if self._suppress_body:
                body = b""
            elif self._chunked:
                if body:
                    body = b"%x\r\n%s\r\n" % (len(body), body)
                if not more:
                    body += b"0\r\n\r\n"
            else:
                self._length_left -= len(body)
                if self._length_left < 0 or (not more and self._length_left > 0):
                    # As h11: bytes beyond the length are refused unsent, a body that ends short is sent and
                    # then refused; either way the connection closes (the client cannot tell where it ends).
                    self._finished = self._must_close = True
                    sent = self._head + (body if self._length_left >= 0 else b"")
                    self._head = b""
                    if sent:
                        await self._write(sent)
                    raise ValueError(
                        f"a response body {'over' if self._length_left < 0 else 'under'}ran its content-length"
                    )
            if not more:
                self._finished = True
            if self._head:
                body = self._head + body
                self._head = b""
            if body:
                await self._write(body)

    def _response_head(self, status: int, app_headers: Any) -> bytes:
        """h11's bytes for hypercorn's response head, refused (ValueError) where h11 refuses it: the status line,
        ``Host`` first, the app's headers (stripped, in order; repeated equal lengths merged), ``date`` and
        ``server``, ``Connection: close`` once this connection has had its requests (while draining: every
        response), and chunked framing when no length is given or chunked is asked for."""
        if not 200 <= status < 1000:
            raise ValueError(f"cannot send status {status}: a response's status is 200-999")
        host: list[bytes] = []
        lines: list[bytes] = []
        length: bytes | None = None
        chunked_asked = False
        for raw_name, raw_value in app_headers:
            name, value = bytes(raw_name).strip(), bytes(raw_value).strip()
            if not _TOKEN.fullmatch(name) or not _FIELD_VALUE.fullmatch(value):
                raise ValueError(f"cannot send the response header {name!r}: {value!r}")
            lowered = name.lower()
            if lowered == b"content-length":
                lengths = {part.strip() for part in value.split(b",")}
                value = lengths.pop()
                if lengths or not _DIGITS.fullmatch(value) or (length is not None and value != length):
                    raise ValueError(f"cannot send conflicting or bad content-length headers ({value!r})")
                if length is not None:
                    continue
                length = value
            elif lowered == b"transfer-encoding":
                value = value.lower()
                if chunked_asked or value != b"chunked":
                    raise ValueError("a response's only transfer-encoding is one chunked")
                chunked_asked = True
            elif lowered == b"connection" and b"close" in (token.strip() for token in value.lower().split(b",")):
                self._must_close = True
            (host if lowered == b"host" else lines).append(b"%s: %s\r\n" % (name, value))
        lines.append(self._response_headers.lines())
        if self._requests >= self._config.keep_alive_max_requests:
            lines.append(b"connection: close\r\n")
            self._must_close = True
        if status in (204, 304):
            self._suppress_body = True
        elif chunked_asked or length is None:
            # h11 frames a body of unknown length in chunks (a HEAD's headers say so too, with no body).
            if length is not None or chunked_asked:
                lines = [
                    line for line in lines if not line.lower().startswith((b"content-length:", b"transfer-encoding:"))
                ]
            lines.append(b"Transfer-Encoding: chunked\r\n")
            self._chunked = not self._suppress_body
        else:
            self._length_left = int(length)
        return b"".join([b"HTTP/1.1 %d \r\n" % status, *host, *lines, b"\r\n"])

    def _error_response(self, status: int, *, from_the_app: bool) -> bytes:
        """hypercorn's answer when the app fails before answering (``from_the_app``: through the response path,
        so ``Connection: close`` is added again while draining) or when h11 refuses the request."""
        draining = from_the_app and self._requests >= self._config.keep_alive_max_requests
        return b"HTTP/1.1 %d \r\ncontent-length: 0\r\nconnection: close\r\n%s%s\r\n" % (
            status,
            self._response_headers.lines(),
            b"connection: close\r\n" if draining else b"",
        )

    async def _write(self, data: bytes) -> None:
        try:
            await self._stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._broken = True
