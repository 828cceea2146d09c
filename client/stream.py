"""The trio client of the command stream (``GET /ws/commands``): the core every flavour runs on.

Commands issued while a message is being sent are coalesced into the next message (at most
MAX_PER_MESSAGE each), so a busy caller sends few large messages and an idle one a message per
command: batching follows the load without a timer. Each message is sent ``"ordered": false``: its
commands come from independent callers, and a caller that needs one command after another awaits
the first (the service then orders them by its reply). Results come back matched by id, in any order.

Bounds: at most ``max_in_flight`` commands waiting for a result; beyond it a caller waits for room
(policy: block the caller), so the client never exceeds the service's window (``MAX_IN_FLIGHT`` of
``api/streams/command_stream.py``, which would otherwise stop reading: the same effect, later).
"""

from __future__ import annotations

import contextlib
import math
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import msgpack
import orjson
import outcome
import trio
from trio_websocket import ConnectionClosed, HandshakeError, WebSocketConnection, wrap_client_stream

from kvrouter.client.compact import ADD, PATHS, ROUTE, SUBPROTOCOL, array_header, int64s
from kvrouter.client.operations import NO_BODY, Op, Operations, StreamClosed, _created, result_of_parts

T = TypeVar("T")
STREAM_PATH = "/ws/commands"
MAX_PER_MESSAGE = 1000  # the service's MAX_BATCH_COMMANDS
MAX_IN_FLIGHT = 4096  # the service's MAX_IN_FLIGHT per connection
MAX_MESSAGE_BYTES = 1 << 20  # the service's MAX_MESSAGE_BYTES: a larger message closes the stream (1009)
MESSAGE_HEAD = b'{"ordered":false,"commands":['
COMPACT_HEAD = b"\x92\xc2"  # msgpack: [false, <the commands' array>]
MESSAGE_OVERHEAD = len(MESSAGE_HEAD) + 2  # a message's bytes besides its commands (the compact one has fewer)
MAX_REPLY_BYTES = 64 * 1024 * 1024  # one results message (up to 4096 results, each as large as a route answers)
RECEIVE_BYTES = 64 * 1024
CLOSE_SECONDS = 2.0  # the closing handshake waits at most this long for the service's answer
# Connecting (TCP and the upgrade) takes at most this long by default: a port that accepts connections but never
# answers an HTTP upgrade (a hung process, a worker's ZMQ KV-event port) would otherwise hold the caller for ever.
CONNECT_SECONDS = 10.0
# A stream with nothing to send pings this often: the service closes a connection silent for its
# --http-body-timeout-secs (30 s by default).
PING_SECONDS = 10.0


@contextlib.asynccontextmanager
async def open_websocket(
    url: str,
    *,
    token: str | None = None,
    max_message_size: int = MAX_REPLY_BYTES,
    receive_buffer: int | None = None,
    subprotocols: list[str] | None = None,
    connect_timeout: float | None = CONNECT_SECONDS,
) -> AsyncIterator[WebSocketConnection]:
    """A WebSocket client connection to ``url`` (``ws://host:port/path[?query]``) whose TCP socket is closed on
    exit, however the connection ended (trio-websocket 0.12's ``open_websocket_url`` leaves it open when the
    service closes first). ``receive_buffer``: the socket's SO_RCVBUF (tests of slow readers); ``subprotocols``:
    the WebSocket subprotocols offered (the one the service chose is ``connection.subprotocol``). A refused
    upgrade raises trio-websocket's ``ConnectionRejected``; a refused connection ``OSError``, and one not upgraded
    within ``connect_timeout`` seconds (None: no bound) ``TimeoutError``."""
    parts = urlsplit(url)
    if parts.scheme != "ws" or parts.hostname is None:
        raise ValueError(f"{url!r} is not a ws://host:port/path URL (kvrouter serves plain HTTP)")
    check_token(token)
    port = parts.port or 80
    resource = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    headers = [(b"authorization", b"Bearer " + token.encode())] if token is not None else None
    deadline = math.inf if connect_timeout is None else trio.current_time() + connect_timeout
    with trio.move_on_at(deadline) as connecting:
        if receive_buffer is None:
            stream = await trio.open_tcp_stream(parts.hostname, port)
        else:
            sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
            await sock.connect((parts.hostname, port))
            stream = trio.SocketStream(sock)
    if connecting.cancelled_caught:
        raise _too_slow(url, connect_timeout)
    rejected: list[HandshakeError] = []
    timed_out = False
    try:
        async with trio.open_nursery() as nursery:
            with trio.move_on_at(deadline) as upgrading:
                connection = await wrap_client_stream(
                    nursery,
                    stream,
                    f"{parts.hostname}:{port}",
                    resource,
                    subprotocols=subprotocols,
                    extra_headers=headers,
                    max_message_size=max_message_size,
                    receive_buffer_size=RECEIVE_BYTES,
                )
            if upgrading.cancelled_caught:
                timed_out = True  # raised below, on its own rather than in the nursery's group
                nursery.cancel_scope.cancel()
            else:
                try:
                    yield connection
                finally:
                    with trio.move_on_after(CLOSE_SECONDS) as closing:
                        closing.shield = True
                        await connection.aclose()
                    nursery.cancel_scope.cancel()
    except* HandshakeError as refusals:
        rejected.extend(refusals.exceptions)  # type: ignore[arg-type]
    finally:
        await trio.aclose_forcefully(stream)
    if rejected:
        raise rejected[0]  # on its own, not in the nursery's group
    if timed_out:
        raise _too_slow(url, connect_timeout)


def _too_slow(url: str, seconds: float | None) -> TimeoutError:
    return TimeoutError(f"{url}: no answer to the WebSocket upgrade within {seconds:g} s (is it a kvrouter service?)")


URL_FORMS = "http://host:port (the service's URL) or ws://host:port[/ws/commands]"


def check_token(token: str | None) -> None:
    """Refuse a token that cannot go in the upgrade's ``Authorization`` header (a CR, LF or another control
    character, or surrounding whitespace) with a ``ValueError`` naming it, before anything is sent (h11 would
    refuse it mid-connect, as an exception group). The token itself is not shown: it is a secret."""
    if token is None:
        return
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in token) or token != token.strip(" \t"):
        raise ValueError(
            "token: an auth token must not contain CR, LF or other control characters, nor begin or end with "
            "whitespace (it is sent in the Authorization header; was it read from a file with its newline?)"
        )


def stream_url(base_url: str) -> str:
    """``http://host:port`` (the service's URL) -> ``ws://host:port/ws/commands``; a ``ValueError`` saying the
    accepted forms for anything else (``host:port`` without a scheme, ``https://``, ``wss://``)."""
    parts = urlsplit(base_url)
    if parts.scheme in ("https", "wss"):
        raise ValueError(
            f"{base_url!r}: {parts.scheme}:// is not supported (kvrouter serves plain HTTP); give {URL_FORMS}"
        )
    if parts.scheme not in ("http", "ws") or not parts.hostname:
        raise ValueError(f"{base_url!r} is not a URL the client connects to: give {URL_FORMS}")
    url = base_url.rstrip("/")
    if url.startswith("http"):
        url = "ws" + url[4:]
    return url if url.endswith(STREAM_PATH) else url + STREAM_PATH


class StreamClient(Operations):
    """Open with ``async with StreamClient.connect(url, token=...) as client``; every operation of
    ``Operations`` is then an ``await client.add(...)`` etc. Safe to use from many tasks at once.

    The connection speaks the compact format (``client/compact.py``) when the service offers it, else JSON
    (``compact=False`` asks for JSON); ``client.format`` says which."""

    def __init__(self, websocket: WebSocketConnection, max_in_flight: int = MAX_IN_FLIGHT) -> None:
        self._websocket = websocket
        self._room = trio.Semaphore(max_in_flight)
        self._next_id = 0
        # The caller task waiting for each command's result: woken by ``trio.lowlevel.reschedule`` with the
        # result (or the failure that closed the stream), one wake-up per command and nothing allocated.
        self._waiting: dict[int, trio.lowlevel.Task] = {}
        self._outgoing: list[bytes] = []
        self._wake = trio.Event()
        self._closed: BaseException | None = None
        self.compact = websocket.subprotocol == SUBPROTOCOL
        self.format = "msgpack" if self.compact else "json"
        self._packer = msgpack.Packer()
        self.messages_sent = 0  # how many messages carried the commands (batching under load shows here)
        self._last_sent = trio.current_time()

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(
        cls,
        url: str,
        *,
        token: str | None = None,
        max_in_flight: int = MAX_IN_FLIGHT,
        compact: bool = True,
        connect_timeout: float | None = CONNECT_SECONDS,
    ) -> AsyncIterator[StreamClient]:
        """Connect to a service (``http://host:port`` or the full ``ws://`` stream URL); a refused upgrade
        (401 without the right token) raises ``StreamClosed`` with the service's message, a connection not
        upgraded within ``connect_timeout`` seconds (None: no bound) ``TimeoutError``."""
        raised: list[BaseException] = []  # by the caller's block: re-raised as it is, not in a nursery's group
        offered = [SUBPROTOCOL] if compact else None
        check_token(token)
        ws_url = stream_url(url)
        try:
            async with open_websocket(
                ws_url, token=token, subprotocols=offered, connect_timeout=connect_timeout
            ) as websocket:
                client = cls(websocket, max_in_flight)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(client._send_messages)
                    nursery.start_soon(client._receive_results)
                    nursery.start_soon(client._keep_alive)
                    try:
                        yield client
                    except BaseException as exc:
                        raised.append(exc)
                    finally:
                        nursery.cancel_scope.cancel()
                        client._fail(StreamClosed("the client was closed"))
        except HandshakeError as refused:
            raise StreamClosed(f"the service refused the command stream: {_refusal(refused)}") from None
        if raised:
            raise raised[0]

    @property
    def closed(self) -> bool:
        """Whether the stream is closed (a command sent now raises ``StreamClosed`` at once, unsent)."""
        return self._closed is not None

    def _encode_write(self, command_id: int, fields: tuple[Any, ...]) -> bytes:
        """A hot write in the compact format (its hashes as int64s bytes where they are plain integers)."""
        if fields[0] == ADD:
            packed = int64s(fields[6])
            if packed is not None:
                return self._packer.pack((command_id, *fields[:6], packed, fields[7]))
        return self._packer.pack((command_id, *fields))

    def _encode(self, command_id: int, op: Op[Any]) -> bytes:
        if self.compact:
            fields = op.compact
            if fields is not None:
                return self._encode_write(command_id, fields)
            body = op.body
            if body is NO_BODY:
                return self._packer.pack((command_id, ROUTE, op.method, op.path))
            return self._packer.pack((command_id, ROUTE, op.method, op.path, orjson.dumps(body)))
        command: dict[str, Any] = {"id": command_id, "method": op.method, "path": op.path}
        body = op.body
        if body is not NO_BODY:
            command["body"] = body
        return orjson.dumps(command)

    async def perform(self, op: Op[T]) -> T:
        """Send ``op`` with the next message and wait for its result (one coroutine per call)."""
        if self._closed is not None:
            raise StreamClosed(str(self._closed))
        reply = await self._round_trip(self._encode, op)
        # ``reply``: the compact result [id, status, body(, headers)], or the same from a JSON result.
        return result_of_parts(op, reply[1], reply[2], reply[3] if len(reply) > 3 else None)

    async def perform_write(self, path: str, command: tuple[Any, ...]) -> Any:
        """``perform`` of a hot write without an ``Op``: one is built only to read a failure (the hot path)."""
        if not self.compact or self._closed is not None:
            return await super().perform_write(path, command)
        reply = await self._round_trip(self._encode_write, command)
        status = reply[1]
        if status < 400:
            return status == 201
        op = Op("POST", path, None, _created, compact=command)
        return result_of_parts(op, status, reply[2], reply[3] if len(reply) > 3 else None)

    async def _round_trip(self, encode: Callable[[int, Any], bytes], what: Any) -> Any:
        """Take room in the window, queue ``encode(id, what)`` for the next message, wait for its reply."""
        try:
            self._room.acquire_nowait()  # room is the common case: no scheduling round for it
        except trio.WouldBlock:
            await self._room.acquire()
        try:
            command_id = self._next_id
            self._next_id += 1
            try:
                encoded = encode(command_id, what)
            except (OverflowError, TypeError) as exc:  # orjson.JSONEncodeError is a TypeError
                raise ValueError(_unencodable(what, exc)) from exc
            if len(encoded) + MESSAGE_OVERHEAD > MAX_MESSAGE_BYTES:
                raise ValueError(_too_big(len(encoded)))
            waiting = self._waiting
            waiting[command_id] = trio.lowlevel.current_task()
            self._outgoing.append(encoded)
            self._wake.set()

            def abort(_: Any) -> trio.lowlevel.Abort:
                waiting.pop(command_id, None)
                return trio.lowlevel.Abort.SUCCEEDED

            reply = await trio.lowlevel.wait_task_rescheduled(abort)
        finally:
            self._room.release()
        if isinstance(reply, BaseException):
            raise StreamClosed(str(reply))
        return reply

    async def _send_messages(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                while self._outgoing:
                    batch = self._take_message()
                    if self.compact:
                        await self._websocket.send_message(COMPACT_HEAD + array_header(len(batch)) + b"".join(batch))
                    else:
                        message = MESSAGE_HEAD + b",".join(batch) + b"]}"
                        await self._websocket.send_message(message.decode())
                    self.messages_sent += 1
                    self._last_sent = trio.current_time()
        except ConnectionClosed as closed:
            self._fail(StreamClosed(_closed_reason(closed)))

    def _take_message(self) -> list[bytes]:
        """The next commands to send: as many as fit one message (MAX_PER_MESSAGE, MAX_MESSAGE_BYTES)."""
        size = MESSAGE_OVERHEAD
        count = 0
        for command in self._outgoing[:MAX_PER_MESSAGE]:
            size += len(command) + 1
            if size > MAX_MESSAGE_BYTES and count:
                break
            count += 1
        batch = self._outgoing[:count]
        del self._outgoing[:count]
        return batch

    async def _receive_results(self) -> None:
        waiting = self._waiting
        reschedule = trio.lowlevel.reschedule
        try:
            while True:
                message = await self._websocket.get_message()
                if self.compact:
                    for result in msgpack.unpackb(message):
                        task = waiting.pop(result[0], None)
                        if task is not None:
                            reschedule(task, outcome.Value(result))  # decoded by its caller (``perform``)
                else:
                    for result in orjson.loads(message)["results"]:
                        task = waiting.pop(result["id"], None)
                        if task is not None:
                            parts = (None, result["status"], result["body"], result.get("headers", {}))
                            reschedule(task, outcome.Value(parts))
        except ConnectionClosed as closed:
            self._fail(StreamClosed(_closed_reason(closed)))

    async def _keep_alive(self) -> None:
        """A heartbeat after PING_SECONDS without a message: an unsolicited pong (RFC 6455 allows it, and it
        needs no answer), which is enough for the service to see the connection is not silent."""
        with contextlib.suppress(ConnectionClosed):
            while True:
                await trio.sleep_until(self._last_sent + PING_SECONDS)
                if trio.current_time() >= self._last_sent + PING_SECONDS:
                    await self._websocket.pong()
                    self._last_sent = trio.current_time()

    def _fail(self, failure: BaseException) -> None:
        """Every waiting caller learns that the stream is gone; later calls raise at once."""
        if self._closed is None:
            self._closed = failure
        tasks = list(self._waiting.values())
        self._waiting.clear()
        for task in tasks:
            trio.lowlevel.reschedule(task, outcome.Value(self._closed))


def _unencodable(what: Any, exc: BaseException) -> str:
    """Why a command cannot be sent: its value out of range (an integer beyond 64 bits: a hash >= 2**64 or
    < -2**63), or of a type neither format carries. Nothing was sent; the stream goes on."""
    path = PATHS[what[0]] if isinstance(what, tuple) else what.path
    return (
        f"the command for {path} cannot be sent ({exc}): an integer (a hash, an id) below -2**63 or from 2**64 on "
        "fits neither format, nor does a value that is not a JSON type; nothing was sent"
    )


def _too_big(size: int) -> str:
    return (
        f"a command of {size} bytes does not fit a stream message ({MAX_MESSAGE_BYTES} bytes): "
        "send it to its HTTP route"
    )


def _closed_reason(closed: ConnectionClosed) -> str:
    reason = closed.reason
    if reason is None:
        return "the command stream closed"
    return f"the command stream closed ({reason.code} {reason.name}: {reason.reason or 'no reason given'})"


def _refusal(refused: HandshakeError) -> str:
    body = getattr(refused, "body", None)
    status = getattr(refused, "status_code", None)
    try:
        message = orjson.loads(body)["error"] if body else None
    except (orjson.JSONDecodeError, TypeError, KeyError):
        message = None
    return f"{status} {message or ''}".strip()
