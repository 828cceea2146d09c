"""The command stream: ``GET /ws/commands`` upgraded to a WebSocket, many commands per message, pipelined.

A client message (text or binary) is a JSON object::

    {"commands": [{"id": 1, "method": "POST", "path": "/add", "body": {...}}, ...], "ordered": false}

Each command is a command of ``api/streams/command_runner.py`` with an ``id`` (an integer or a string, echoed back).
The service answers with messages ``{"results": [{"id": 1, "status": 201, "body": {...}}, ...]}``: each
result as soon as its command is durable, results that finish together in one message, in any order
(match them by id). ``"ordered"`` (default true): the message's commands are
applied in order with the connection's earlier ordered commands, by the rules of ``POST /batch`` (a slot
tracker write lets the next command start once it is submitted; any other command waits for every earlier one);
false: they start at once, unordered among themselves and with the rest (independent commands, e.g.
from concurrent callers: a client that needs one before another waits for its result). Except that the
slot tracker's writes (the compact format's hot writes) of unordered messages go in groups, one at a time
per connection: a group is applied once the one before it is durable and answered, and takes the messages
that came meanwhile; a message that is all the service has in flight is split in two groups, so that its
client works on the first group's results while the service applies the second (``run_hot``).

Bounds (per connection): at most MAX_IN_FLIGHT commands received and not yet answered. Policy when
full: the service stops reading the socket (the next message is read once its commands fit), so a
client sending faster than the service answers is slowed by TCP, not buffered. Unsent results are bounded
in bytes, per connection and over every connection (``api/streams/answer_budget.py``): past the budget the service
stops reading the socket and starting reads until the client takes its results. A message over
MAX_MESSAGE_BYTES (hypercorn's ``websocket_max_message_size``, set in ``api/http/server.py``) or holding
more than MAX_BATCH_COMMANDS commands closes the connection with 1009; a message that is not such an
object, or a command without a valid id, closes it with 1007 (the reason says what was wrong).
The compact format (``kvrouter/client/compact.py``: msgpack, positional commands, binary frames) is used
instead when the client offers the WebSocket subprotocol ``kvrouter.commands.msgpack.v1`` at the upgrade;
its messages obey the same bounds and close codes, and a text frame closes it with 1003.
Commands in flight when the connection goes are abandoned (one not yet decided is never applied;
one decided is durable as usual). When the service stops (SIGTERM), it stops reading, answers the
commands in flight, and closes with 1001. The token is checked at the upgrade, as for any route.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import msgpack
import orjson
import trio

from kvrouter.actors.core.limits import MAX_TEXT_BYTES, text_too_long
from kvrouter.api.bodies.write_bodies import add_fields, ref_fields
from kvrouter.api.http import JSON, HttpError, Request, Response, Route, error_response, release
from kvrouter.api.http.json_keys import RepeatedKeys, find_repeated
from kvrouter.api.routes.operations import route
from kvrouter.api.streams.answer_budget import (
    DEFAULT_BUDGETS,
    RESULT_OVERHEAD,
    AnswerBudgets,
    AnswerMetrics,
    StreamOutput,
    Unsent,
)
from kvrouter.api.streams.command_runner import (
    MAX_BATCH_COMMANDS,
    CommandRunner,
    Deliver,
    Item,
    Ready,
    StreamGate,
    _Running,
    render,
)
from kvrouter.api.streams.ws_direct import DirectSocket, binary_frame, direct_socket
from kvrouter.client.compact import ADD, FIELDS, PATHS, ROUTE, SUBPROTOCOL, from_int64s, json_body

log = logging.getLogger("kvrouter.api")

STREAM_PATH = "/ws/commands"
MAX_MESSAGE_BYTES = 1 << 20
MAX_IN_FLIGHT = 4096
# A results message holds at most this many bytes, unless it is one result larger than that (policy: halve it).
MAX_RESULTS_BYTES = MAX_MESSAGE_BYTES
# An unordered message of at least twice this many hot writes, when it is all the service's streams have in
# flight, is applied (and answered) in two halves (see ``CommandStream.run_hot``).
SPLIT_MIN_COMMANDS = 64
# The most hot writes of one connection applied as one group (messages that arrived while the group before
# was applied are taken together, up to this).
MAX_HOT_GROUP = 2048
CLOSE_TOO_BIG = 1009
CLOSE_INVALID = 1007
CLOSE_GOING_AWAY = 1001
CLOSE_UNSUPPORTED = 1003
STOPPING = "the service is stopping: reconnect once it is back"
NOT_A_MESSAGE = 'a message is a JSON object {"commands": [...], "ordered": true|false}'
BAD_ID = f"every command needs an `id`: an integer or a string of at most {MAX_TEXT_BYTES} bytes"
NOT_A_COMPACT_MESSAGE = "a message of the compact format is a msgpack array [ordered, [command, ...]]"
TEXT_ON_COMPACT = "this connection speaks the compact format (msgpack): send binary frames"
NOT_A_COMPACT_COMMAND = (
    "a compact command is [id, 0, method, path] or [id, 0, method, path, JSON body as bytes], or a hot write "
    "with its fields in order (see kvrouter/client/compact.py)"
)
PLAIN_GET = "this route speaks WebSocket: open it with a WebSocket upgrade (see the README's command stream)"


class Malformed(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


def parse_message(data: bytes | str) -> tuple[list[Any], list[Any], bool, RepeatedKeys | None]:
    """(ids, commands, ordered, the keys the message repeated) of one client message; raises Malformed."""
    size = len(data) if isinstance(data, bytes) else len(data.encode("utf-8", "surrogatepass"))
    if size > MAX_MESSAGE_BYTES:
        raise Malformed(CLOSE_TOO_BIG, f"a message holds at most {MAX_MESSAGE_BYTES} bytes")
    try:
        message = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise Malformed(CLOSE_INVALID, f"not JSON: {exc}") from None
    if type(message) is not dict or type(message.get("commands")) is not list:
        raise Malformed(CLOSE_INVALID, NOT_A_MESSAGE)
    repeated = find_repeated(data, message)  # None nearly always
    if repeated is not None and repeated.at(()):
        raise Malformed(CLOSE_INVALID, f"{NOT_A_MESSAGE}; this one has `{repeated.at(())[0]}` twice")
    ordered = message.get("ordered", True)
    if type(ordered) is not bool:
        raise Malformed(CLOSE_INVALID, NOT_A_MESSAGE)
    commands = message["commands"]
    if len(commands) > MAX_BATCH_COMMANDS:
        raise Malformed(CLOSE_TOO_BIG, f"a message holds at most {MAX_BATCH_COMMANDS} commands")
    ids = []
    for index, command in enumerate(commands):
        found = command.get("id") if type(command) is dict else None
        if not (type(found) is int or (type(found) is str and not text_too_long(found))):
            raise Malformed(CLOSE_INVALID, BAD_ID)
        if repeated is not None and "id" in repeated.at(("commands", index)):
            raise Malformed(CLOSE_INVALID, f"{BAD_ID}, and only one")
        ids.append(found)
    return ids, commands, ordered, repeated


class CompactReader:
    """Reads the compact format's messages into the runner's items: a well-formed hot write straight into its
    route's plain item (``Ready``: the checks of ``api/bodies/write_bodies.py``, no request, no lookup); anything else
    as the JSON command it stands for, so it gets that command's answer."""

    def __init__(self, runner: CommandRunner) -> None:
        self.runner = runner
        # Per hot write the service has (as a batched route): its command's length, the reader of its fields,
        # the plain item's method name and the route's ``Batched.apply``.
        self.hot: dict[int, tuple[int, Callable[..., Any], str, Any]] = {}
        for code, path in PATHS.items():
            found = runner.resolve_target("POST", path)
            batched = None if isinstance(found, Response) else found[0].batched
            if batched is not None:
                read = add_fields if code == ADD else ref_fields
                self.hot[code] = (2 + len(FIELDS[code]), read, path[1:], batched.apply)

    def parse(self, data: bytes | str) -> tuple[list[Any], list[Item], bool]:
        """(ids, items, ordered) of one message; raises Malformed."""
        if type(data) is not bytes:
            raise Malformed(CLOSE_UNSUPPORTED, TEXT_ON_COMPACT)
        if len(data) > MAX_MESSAGE_BYTES:
            raise Malformed(CLOSE_TOO_BIG, f"a message holds at most {MAX_MESSAGE_BYTES} bytes")
        try:
            message = msgpack.unpackb(data)
        except (ValueError, TypeError) as exc:  # msgpack's errors (and bad UTF-8) are ValueErrors
            # (msgpack's FormatError and StackError say nothing: their name says what was wrong)
            raise Malformed(CLOSE_INVALID, f"not msgpack: {str(exc) or type(exc).__name__}") from None
        if type(message) is not list or len(message) != 2 or type(message[0]) is not bool:
            raise Malformed(CLOSE_INVALID, NOT_A_COMPACT_MESSAGE)
        ordered, commands = message
        if type(commands) is not list:
            raise Malformed(CLOSE_INVALID, NOT_A_COMPACT_MESSAGE)
        if len(commands) > MAX_BATCH_COMMANDS:
            raise Malformed(CLOSE_TOO_BIG, f"a message holds at most {MAX_BATCH_COMMANDS} commands")
        ids: list[Any] = []
        items: list[Item] = []
        hot = self.hot
        for command in commands:  # one pass (nothing runs before the whole message is read)
            if type(command) is not list or not command:
                raise Malformed(CLOSE_INVALID, BAD_ID)
            command_id = command[0]
            if type(command_id) is not int and not (type(command_id) is str and not text_too_long(command_id)):
                raise Malformed(CLOSE_INVALID, BAD_ID)
            ids.append(command_id)
            size = len(command)
            code = command[1] if size > 1 else None
            fast = hot.get(code) if type(code) is int else None
            if fast is not None and size == fast[0]:
                plain = fast[1](*command[2:])
                if plain is not None:
                    items.append(Ready(fast[3], [fast[2], *plain]))
                    continue
            items.append(self.item(command))
        return ids, items, ordered

    def item(self, command: list[Any]) -> Item:
        code = command[1] if len(command) > 1 else None
        if type(code) is not int:
            return error_response(400, NOT_A_COMPACT_COMMAND)
        if code == ROUTE and len(command) in (4, 5):
            if len(command) == 4:
                return self.runner.resolve_target(command[2], command[3])
            if type(command[4]) is not bytes:
                return error_response(400, NOT_A_COMPACT_COMMAND)
            return self.runner.resolve_target(command[2], command[3], body=command[4])
        names = FIELDS.get(code)
        if names is None or len(command) != 2 + len(names):
            return error_response(400, NOT_A_COMPACT_COMMAND)
        fields = command[2:]
        hot = self.hot.get(code)
        if hot is not None:
            plain = hot[1](*fields)
            if plain is not None:
                return Ready(hot[3], [hot[2], *plain])
        # Not plainly valid (or no such route here): the JSON command it stands for, answered as that is.
        if code == ADD and type(fields[5]) is bytes:
            hashes = from_int64s(fields[5], signed=True)
            if hashes is None:
                return error_response(400, NOT_A_COMPACT_COMMAND)
            fields[5] = list(hashes)
        try:
            body = orjson.loads(orjson.dumps(json_body(code, fields)))
        except TypeError:  # a value JSON cannot carry (bytes, an extension type)
            return error_response(400, NOT_A_COMPACT_COMMAND)
        return self.runner.resolve_target("POST", PATHS[code], parsed=body)


def render_compact(command_id: Any, response: Response) -> list[Any]:
    """A result of the compact format: [id, status, body] (+ headers), the body as the route's JSON bytes."""
    body = response.body
    shown: Any = None
    if body:
        shown = bytes(body) if response.content_type == JSON else bytes(body).decode("utf-8", "replace")
    if response.headers:
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in response.headers}
        return [command_id, response.status, shown, headers]
    return [command_id, response.status, shown]


class InFlight:
    """Commands received and not yet answered by every stream of one service (the streams' windows add to it)."""

    __slots__ = ("used",)

    def __init__(self) -> None:
        self.used = 0


class _Window:
    """Commands received and not yet answered; a message is read only once its commands fit."""

    def __init__(self, limit: int, everywhere: InFlight | None = None) -> None:
        self.limit = limit
        self.used = 0
        self.everywhere = InFlight() if everywhere is None else everywhere
        self._freed = trio.Event()

    def fits(self, count: int) -> bool:
        return self.used + count <= self.limit

    async def wait_for_room(self) -> None:
        """Until at least one command's room is free (the next message may need more: see ``take``)."""
        while self.used >= self.limit:
            self._freed = trio.Event()
            await self._freed.wait()

    async def take(self, count: int) -> None:
        while not self.fits(count):
            self._freed = trio.Event()
            await self._freed.wait()
        self.used += count
        self.everywhere.used += count

    async def drained(self) -> None:
        """Until every command taken has been answered."""
        while self.used:
            self._freed = trio.Event()
            await self._freed.wait()

    def give_back(self, count: int) -> None:
        self.used -= count
        self.everywhere.used -= count
        self._freed.set()


class CommandStream:
    """One connection: reads messages while there is room, runs their commands, sends their results."""

    def __init__(
        self,
        runner: CommandRunner,
        send: Any,
        limit: int = MAX_IN_FLIGHT,
        stopping: trio.Event | None = None,
        *,
        compact: bool = False,
        everywhere: InFlight | None = None,
        direct: DirectSocket | None = None,
        output: StreamOutput | None = None,
    ) -> None:
        self.runner = runner
        self.send = send
        # The connection's socket, where the compact format's results are written as frames without going through
        # hypercorn's WebSocket stream (``api/streams/ws_direct.py``); None: every message the ASGI way.
        self.direct = direct if compact else None
        self.written_directly = 0  # result messages written to the socket directly (for tests)
        self.stopping = stopping
        self.window = _Window(limit, everywhere)
        self.compact = CompactReader(runner) if compact else None
        self.outgoing: list[Any] = []  # rendered results: JSON bytes, or compact results (lists)
        self.outgoing_bytes = 0  # their size (``api/streams/answer_budget.py``: counted in ``output``)
        # Unsent result bytes against the connection's and the service's budgets (``api/streams/answer_budget.py``).
        if output is None:
            output = StreamOutput(DEFAULT_BUDGETS.stream_unsent_bytes, Unsent(DEFAULT_BUDGETS.unsent_bytes))
        self.output = output
        self.gate = StreamGate(self.output)
        self.ready = trio.Event()
        self.ordered_work: deque[tuple[list[Any], list[Item]]] = deque()
        self.ordered_ready = trio.Event()
        # Unordered messages of hot writes, waiting for the group before them to be durable (see run_hot).
        # (ids, items, apply, whether it takes the messages after it into its group)
        self.hot_work: deque[tuple[list[Any], list[Item], Any, bool]] = deque()
        self.hot_ready = trio.Event()

    def deliver(self, command_id: Any, response: Response) -> None:
        if self.compact is not None:
            self.outgoing.append(render_compact(command_id, response))
            size = len(response.body) + RESULT_OVERHEAD
        else:
            result = b'{"id":%s,%s' % (orjson.dumps(command_id), render(response)[1:])
            self.outgoing.append(result)
            size = len(result)
        self.outgoing_bytes += size
        self.output.add(size)
        self.ready.set()

    async def send_results_until_gone(self, connection: trio.CancelScope) -> None:
        """``send_results`` until the socket breaks under a direct write (the client reset the connection, or took
        nothing for --http-write-timeout-secs and the server closed it): the client is gone, as when it
        disconnects, so the connection's work ends (``connection``) quietly. (Sent the ASGI way, hypercorn
        itself takes such a failure as the end of the connection; raised from here it was logged as an
        "Error in ASGI Framework" with a traceback, for every client that went away while answers were
        written.)"""
        try:
            await self.send_results()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.debug("command stream: the client is gone (%s)", exc)
            connection.cancel()

    async def send_results(self) -> None:
        """One message with every result ready; results that finish while it is sent go in the next. Their bytes
        leave the connection's unsent count once written (``output``)."""
        while True:
            await self.ready.wait()
            self.ready = trio.Event()
            batch, self.outgoing = self.outgoing, []
            size, self.outgoing_bytes = self.outgoing_bytes, 0
            if size <= MAX_RESULTS_BYTES:
                await self._send_batch(batch)
                self.output.sent(size)
                continue
            for piece, piece_size in self._pieces(batch):  # released as each is written
                await self._send_batch(piece)
                self.output.sent(piece_size)
                size -= piece_size
            self.output.sent(size)  # (what the pieces' sizes left over: none unless estimates differ)

    def _pieces(self, batch: list[Any]) -> list[tuple[list[Any], int]]:
        """``batch`` cut into runs of results of at most MAX_RESULTS_BYTES together (by their counted sizes),
        so a large batch is neither joined whole nor halved over and over."""
        compact = self.compact is not None
        pieces: list[tuple[list[Any], int]] = []
        piece: list[Any] = []
        piece_size = 0
        for result in batch:
            size = len(result[2] or b"") + RESULT_OVERHEAD if compact else len(result)
            if piece and piece_size + size > MAX_RESULTS_BYTES:
                pieces.append((piece, piece_size))
                piece, piece_size = [], 0
            piece.append(result)
            piece_size += size
        if piece:
            pieces.append((piece, piece_size))
        return pieces

    async def _send_batch(self, batch: list[Any]) -> None:
        """``batch``'s results in one message, or in halves while a message would pass MAX_RESULTS_BYTES (a
        result larger than that goes alone): many large answers finishing together (reads of a big service)
        made one message of all of them, which a client's own bound (kvrouter.client's 64 MiB, 1 MiB in many
        WebSocket libraries) refused by closing the stream, failing every command waiting on it."""
        if self.compact is not None:
            payload = msgpack.packb(batch)
            if len(payload) > MAX_RESULTS_BYTES and len(batch) > 1:
                await self._send_batch(batch[: len(batch) // 2])
                await self._send_batch(batch[len(batch) // 2 :])
                return
            await self._send_compact(payload)
        else:
            text = b'{"results":[' + b",".join(batch) + b"]}"
            if len(text) > MAX_RESULTS_BYTES and len(batch) > 1:
                await self._send_batch(batch[: len(batch) // 2])
                await self._send_batch(batch[len(batch) // 2 :])
                return
            await self.send({"type": "websocket.send", "text": text.decode()})
        self.window.give_back(len(batch))

    async def _send_compact(self, payload: bytes) -> None:
        """One binary message: straight to the socket when it takes it now (~100 us of hypercorn's WebSocket
        stream, wsproto's framing and its send lock saved per message), else the ASGI way. A frame the socket
        took in part is finished here, before anything else is sent on the connection (the ASGI way too would
        write that rest first: ``api/http/server.py``'s stream keeps the order of its writes)."""
        direct = self.direct
        if direct is not None and direct.write(binary_frame(payload)):
            self.written_directly += 1
            if direct.unsent:
                await direct.flush()
            return
        await self.send({"type": "websocket.send", "bytes": payload})

    async def run_ordered(self) -> None:
        """The connection's ordered commands, one sequence across messages."""
        running = _Running()
        async with trio.open_nursery() as nursery:
            while True:
                while not self.ordered_work:
                    self.ordered_ready = trio.Event()
                    await self.ordered_ready.wait()
                ids, items = self.ordered_work.popleft()
                await self.runner.run_ordered(items, _by_id(ids, self.deliver), nursery, running, self.gate)

    async def run_unordered(self, ids: list[Any], items: list[Item]) -> None:
        await self.runner.run(items, _by_id(ids, self.deliver), ordered=False, gate=self.gate)

    async def run_hot(self) -> None:
        """The connection's unordered hot writes, one group at a time: a group is applied once the group before
        it is durable and answered, and takes every message that arrived meanwhile.

        So the service never applies writes whose answers would then wait for their turn to end: a group's
        answers go back the moment its fsync is done, and its client works on them (and sends the next
        commands) while the service applies the next group. A message that is all the service has in
        flight (its client waits for the whole of it) is split in two groups (``_read``), so there is always
        a next group: client and service overlap instead of taking turns. Applying groups as they arrived
        instead let a group's answers wait for the next group's actor turn (a message's writes are applied
        in one turn), and two messages read back to back shared one turn, one fsync and one reply: the
        client's callers then moved in one lockstep convoy, and each side waited while the other worked."""
        work = self.hot_work
        while True:
            while not work:
                self.hot_ready = trio.Event()
                await self.hot_ready.wait()
            ids, items, apply, takes_more = work.popleft()
            while takes_more and work and work[0][2] is apply and len(items) + len(work[0][1]) <= MAX_HOT_GROUP:
                more_ids, more_items, _, takes_more = work.popleft()
                ids, items = ids + more_ids, items + more_items
            await self._apply_hot(ids, items, apply)
            # The answers out before the next group's actor turn: ``send_results`` runs in the next scheduling
            # batch, and the next group's writes reach their actor (posted below) a batch after that.
            await trio.lowlevel.checkpoint()

    async def _apply_hot(self, ids: list[Any], items: list[Item], apply: Any) -> None:
        """One ``Batched.apply`` call for hot writes of one route table (what ``runner.run`` would make for
        them), the results rendered straight into the outgoing message."""
        try:
            responses = await apply([item.prepared for item in items])  # type: ignore[union-attr]
        except Exception as exc:  # a bug below (``Batched.apply`` answers the service's failures itself)
            log.exception("unhandled error in a batch of %d commands", len(items))
            release(exc)
            responses = [error_response(500, "internal error")] * len(items)
        outgoing = self.outgoing  # (``Ready`` items come only from the compact format)
        # Most answers are the same few responses (a write's 201 or 200): each rendered once per group.
        # (Keyed by identity: every response is alive in ``responses`` meanwhile.)
        rendered: dict[int, list[Any]] = {}
        size = RESULT_OVERHEAD * len(responses)
        for command_id, response in zip(ids, responses, strict=True):
            result = rendered.get(id(response))
            if result is None:
                result = rendered[id(response)] = render_compact(None, response)
            result = result.copy()
            result[0] = command_id
            outgoing.append(result)
            size += len(response.body)
        self.outgoing_bytes += size
        self.output.add(size)
        self.ready.set()

    async def serve(self, receive: Any) -> None:
        """Read and dispatch messages until the client goes, breaks the protocol, or the service stops (then
        the commands in flight are answered first, and the connection closes with 1001)."""
        try:
            await self._serve(receive)
        finally:
            self.output.close()  # what it had unsent leaves the service-wide count with it

    async def _serve(self, receive: Any) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.send_results_until_gone, nursery.cancel_scope)
            nursery.start_soon(self.run_ordered)
            nursery.start_soon(self.run_hot)
            with trio.CancelScope() as reading:
                if self.stopping is not None:
                    nursery.start_soon(_cancel_when_set, self.stopping, reading)
                closing = await self._read(receive, nursery)
            if reading.cancelled_caught:
                await self.window.drained()
                closing = (CLOSE_GOING_AWAY, STOPPING)
            if closing is not None:
                await self.send({"type": "websocket.close", "code": closing[0], "reason": closing[1][:120]})
            nursery.cancel_scope.cancel()

    async def _read(self, receive: Any, nursery: trio.Nursery) -> tuple[int, str] | None:
        """Messages until the client disconnects (None) or sends a malformed one (the close code and reason)."""
        while True:
            await self.window.wait_for_room()
            await self.output.wait_for_room()  # backpressure: its client has not taken enough of its results
            message = await receive()
            if message["type"] != "websocket.receive":
                return None  # websocket.disconnect
            data = message.get("bytes")
            if data is None:
                data = message.get("text", "")
            try:
                if self.compact is not None:
                    ids, items, ordered = self.compact.parse(data)
                else:
                    ids, commands, ordered, repeated = parse_message(data)
                    if repeated is None:
                        items = [self.runner.resolve(command) for command in commands]
                    else:
                        items = [
                            self.runner.resolve(command, repeated.under(("commands", index)))
                            for index, command in enumerate(commands)
                        ]
            except Malformed as bad:
                return bad.code, bad.reason
            await self.window.take(len(items))
            if ordered:
                self.ordered_work.append((ids, items))
                self.ordered_ready.set()
            elif (apply := _one_apply(items)) is None:
                nursery.start_soon(self.run_unordered, ids, items)
            else:
                if len(items) >= 2 * SPLIT_MIN_COMMANDS and self.window.everywhere.used == len(items):
                    # Everything the service has in flight: its client waits for all of it, and answering it in
                    # one piece would leave the client idle while the service works and the other way round. In
                    # two groups, the first one's answers are worked on while the second is applied. (While other
                    # connections have commands in flight, the service has their work to overlap with.)
                    half = len(items) // 2
                    self.hot_work.append((ids[:half], items[:half], apply, False))
                    ids, items = ids[half:], items[half:]
                self.hot_work.append((ids, items, apply, True))
                self.hot_ready.set()


def _one_apply(items: list[Item]) -> Any:
    """The ``Batched.apply`` of every item when all are ``Ready`` for the same one, else None."""
    if not items or type(items[0]) is not Ready:
        return None
    apply = items[0].apply
    for item in items:
        if type(item) is not Ready or item.apply is not apply:
            return None
    return apply


def _by_id(ids: list[Any], deliver: Callable[[Any, Response], None]) -> Deliver:
    """``deliver`` by command id, for the runner's deliver by index."""
    return lambda index, response: deliver(ids[index], response)


async def _cancel_when_set(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


def stream_route(
    runner: CommandRunner,
    limit: int = MAX_IN_FLIGHT,
    *,
    budgets: AnswerBudgets = DEFAULT_BUDGETS,
    metrics: AnswerMetrics | None = None,
) -> Route:
    """``GET /ws/commands``: the stream behind a WebSocket upgrade; a plain GET answers 426. Unsent results are
    bounded by ``budgets`` (``api/streams/answer_budget.py``)."""
    everywhere = InFlight()
    unsent = Unsent(budgets.unsent_bytes, metrics)

    async def plain(request: Request) -> Response:
        raise HttpError(426, PLAIN_GET, ((b"upgrade", b"websocket"),))

    async def websocket(scope: dict[str, Any], receive: Any, send: Any, stopping: trio.Event | None) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        compact = SUBPROTOCOL in scope.get("subprotocols", ())
        accept: dict[str, Any] = {"type": "websocket.accept"}
        if compact:
            accept["subprotocol"] = SUBPROTOCOL
        await send(accept)
        direct = direct_socket(scope, send) if compact else None
        output = StreamOutput(budgets.stream_unsent_bytes, unsent)
        stream = CommandStream(
            runner, send, limit, stopping, compact=compact, everywhere=everywhere, direct=direct, output=output
        )
        await stream.serve(receive)

    return route("command_stream", plain, websocket=websocket)
