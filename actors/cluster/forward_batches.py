"""Forwarded writes go to their owner in batches (one ``POST /batch``), several batches in flight per owner.

A replica that does not own a scope forwards its writes to the owner. Sent one HTTP request per write, the hop
costs a request on both replicas per command; here the writes bound for one owner share requests:

* a **group** is the writes that arrive together: one client request, or one scope's writes of one ``/batch`` or
  command-stream message. A group stays in one batch, in its order, so the owner applies them in that order (its
  ``/batch`` runs consecutive writes of a scope as one ``apply_writes``). A group larger than a batch is cut into
  batches sent one after another, each once the one before was answered.
* a **lane** per owner queues the groups waiting to go. Its sender takes as many whole groups as fit one batch
  (``max_commands`` writes, ``max_bytes`` of body) and posts them; up to ``max_in_flight`` batches go at once
  (pipelined). Groups that arrive while every slot is busy wait and leave together in the next batch, so a
  replica under load sends few, large batches and an idle one sends each write at once, with no timer.
* **answers** are mapped back to each write: the owner's result for it (status, body, headers), exactly what the
  write's own route would have answered; a batch refused whole (not 200) gives each write that answer; a batch
  whose answer was lost gives each write the caller's ``OwnerUnreachable`` (unknown outcome, or not applied when
  the connection was refused).

A replica of the selection service sends its batches ``ordered=False`` (``POST /batch?ordered=false``): each of
its groups is one client's request, and the owner starts them all at once, as it would have served them arriving
alone (a slot tracker's groups go in order: its writes are pipelined there, and a group's order matters).

Bounds: per owner, at most ``max_queued_commands`` writes and ``max_queued_bytes`` of bodies wait to be sent.
Overflow policy ``refuse-new``: a group that does not fit is refused at once with ``OwnerUnreachable`` (not
applied; the caller answers 503), and nothing already queued is dropped. A caller cancelled while its group
still waits takes the group out of the queue (never sent, never applied).
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final

import attrs
import orjson
import trio

from kvrouter.actors.cluster.forwarder import WRITTEN_HEADER, OwnerUnreachable, Relayed
from kvrouter.actors.metric_families import Family, counter, gauge

MAX_BATCH_COMMANDS: Final = 1000  # the owner's POST /batch takes at most this many commands
# An unordered batch (the selection service's) carries at most this many: its reads' answers may be large (a
# /potential_loads of a large fleet), and the owner's answer to one batch is bounded (64 MiB, the forwarder's).
MAX_UNORDERED_BATCH_COMMANDS: Final = 64
MAX_BATCH_BYTES: Final = 1024 * 1024  # within every service's body limit (the slot tracker's is 2 MiB)
MAX_IN_FLIGHT: Final = 4  # batches posted to one owner at once
MAX_QUEUED_COMMANDS: Final = 4096  # per owner, waiting for a slot
MAX_QUEUED_BYTES: Final = 8 * 1024 * 1024
OVERFLOW_POLICY: Final = "refuse-new"
BATCH_PATH: Final = "/batch"
UNORDERED_QUERY: Final = b"ordered=false"

JSON: Final = b"application/json"


# ``ClusterSlotService.relay``: one request to ``owner`` (method, path, query, body) and its answer.
Relay = Callable[[str, str, str, bytes, bytes], Awaitable[Relayed]]
Outcome = Relayed | OwnerUnreachable


def command(method: str, path: str, body: bytes) -> bytes:
    """One command of a ``POST /batch`` body, as JSON bytes (``body``: a JSON document, or empty: none)."""
    if not body:
        return b'{"method":%s,"path":%s}' % (orjson.dumps(method), orjson.dumps(path))
    return b'{"method":%s,"path":%s,"body":%s}' % (orjson.dumps(method), orjson.dumps(path), body)


class _Group:
    __slots__ = ("commands", "done", "outcomes", "size")

    def __init__(self, commands: Sequence[bytes]) -> None:
        self.commands = commands
        self.size = sum(len(one) + 1 for one in commands)
        self.outcomes: list[Outcome] = []
        self.done = trio.Event()


class _Lane:
    """The groups waiting for one owner and the batches in flight to it."""

    __slots__ = ("in_flight", "pending", "queued_bytes", "queued_commands", "wake")

    def __init__(self) -> None:
        self.pending: collections.deque[_Group] = collections.deque()
        self.queued_commands = 0
        self.queued_bytes = 0
        self.in_flight = 0
        self.wake = trio.Event()

    def push(self, group: _Group) -> None:
        self.pending.append(group)
        self.queued_commands += len(group.commands)
        self.queued_bytes += group.size
        self.wake.set()

    def remove(self, group: _Group) -> None:
        self.pending.remove(group)
        self.queued_commands -= len(group.commands)
        self.queued_bytes -= group.size

    def take(self, max_commands: int, max_bytes: int) -> list[_Group]:
        """Whole groups from the front, as many as fit one batch (always at least one)."""
        taken: list[_Group] = []
        commands = size = 0
        while self.pending:
            group = self.pending[0]
            if taken and (commands + len(group.commands) > max_commands or size + group.size > max_bytes):
                break
            self.remove(group)
            taken.append(group)
            commands += len(group.commands)
            size += group.size
        return taken


@attrs.define
class BatchFigures:
    batches: int = 0  # POST /batch requests sent
    commands: int = 0  # writes they carried
    refused: int = 0  # writes refused by the overflow policy
    lost: int = 0  # writes whose batch got no answer (or a malformed one)


class ForwardBatches:
    def __init__(
        self,
        relay: Relay,
        *,
        max_commands: int = MAX_BATCH_COMMANDS,
        max_bytes: int = MAX_BATCH_BYTES,
        max_in_flight: int = MAX_IN_FLIGHT,
        max_queued_commands: int = MAX_QUEUED_COMMANDS,
        max_queued_bytes: int = MAX_QUEUED_BYTES,
        ordered: bool = True,
    ) -> None:
        self._relay = relay
        self.ordered = ordered  # False: the owner starts a batch's commands at once (independent groups of one)
        self._query = b"" if ordered else UNORDERED_QUERY
        self.max_commands = max_commands if ordered else min(max_commands, MAX_UNORDERED_BATCH_COMMANDS)
        self.max_bytes = max_bytes
        self.max_in_flight = max_in_flight
        self.max_queued_commands = max_queued_commands
        self.max_queued_bytes = max_queued_bytes
        self._lanes: dict[str, _Lane] = {}
        self._nursery: trio.Nursery | None = None
        self.figures = BatchFigures()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the senders' tasks until cancelled (the replica's nursery runs this)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def send(self, owner: str, commands: Sequence[bytes]) -> list[Outcome]:
        """Each command's outcome at ``owner``, in order (see the module doc: one group, or batches in turn)."""
        outcomes: list[Outcome] = []
        start = 0
        while start < len(commands):
            end, size = start, 0
            while end < len(commands) and end - start < self.max_commands:
                size += len(commands[end]) + 1
                if end > start and size > self.max_bytes:
                    break
                end += 1
            outcomes.extend(await self._send_group(owner, _Group(commands[start:end])))
            start = end
        return outcomes

    async def _send_group(self, owner: str, group: _Group) -> list[Outcome]:
        lane = self._lanes.get(owner)
        if lane is None:
            lane = self._lanes[owner] = _Lane()
            assert self._nursery is not None, "ForwardBatches.run is not running"
            self._nursery.start_soon(self._sender, owner, lane)
        if lane.pending and (
            lane.queued_commands + len(group.commands) > self.max_queued_commands
            or lane.queued_bytes + group.size > self.max_queued_bytes
        ):
            self.figures.refused += len(group.commands)
            refusal = OwnerUnreachable(
                f"{len(group.commands)} write(s) for {owner} found its forwarding queue full "
                f"({lane.queued_commands} writes, {lane.queued_bytes} bytes waiting)",
                unknown=False,
            )
            return [refusal] * len(group.commands)
        lane.push(group)
        try:
            await group.done.wait()
        except trio.Cancelled:
            if group in lane.pending:  # not sent: it never reaches the owner
                lane.remove(group)
            raise
        return group.outcomes

    async def _sender(self, owner: str, lane: _Lane) -> None:
        """Post the lane's groups, ``max_in_flight`` batches at a time; end (and forget the lane) once idle."""
        async with trio.open_nursery() as batches:
            while True:
                await trio.lowlevel.checkpoint()  # writes made runnable in this turn join the batch
                if lane.pending and lane.in_flight < self.max_in_flight:
                    groups = lane.take(self.max_commands, self.max_bytes)
                    lane.in_flight += 1
                    batches.start_soon(self._post, owner, lane, groups)
                    continue
                if not lane.pending and lane.in_flight == 0:
                    del self._lanes[owner]
                    return
                lane.wake = trio.Event()
                await lane.wake.wait()

    async def _post(self, owner: str, lane: _Lane, groups: list[_Group]) -> None:
        commands = [one for group in groups for one in group.commands]
        self.figures.batches += 1
        self.figures.commands += len(commands)
        try:
            outcomes = await self._answers(owner, commands)
        finally:
            lane.in_flight -= 1
            lane.wake.set()
        start = 0
        for group in groups:
            group.outcomes = outcomes[start : start + len(group.commands)]
            start += len(group.commands)
            group.done.set()

    async def _answers(self, owner: str, commands: list[bytes]) -> list[Outcome]:
        body = b"[" + b",".join(commands) + b"]"
        try:
            relayed = await self._relay(owner, "POST", BATCH_PATH, self._query, body)
        except OwnerUnreachable as exc:
            if exc.unknown:
                self.figures.lost += len(commands)
            return [exc] * len(commands)
        if relayed.status != 200:
            if len(commands) > 1 and relayed.status in (400, 413, 422):
                # The batch itself was refused (unreadable, too large): not any one command's fault, none applied.
                refused = OwnerUnreachable(
                    f"{owner} refused a batch of {len(commands)} forwarded commands "
                    f"(HTTP {relayed.status}: {relayed.body[:200].decode('utf-8', 'replace')})",
                    unknown=False,
                )
                return [refused] * len(commands)
            return [relayed] * len(commands)  # refused whole (401, 503 ...): each command gets that answer
        results = _results(relayed.body, len(commands))
        if results is None:
            self.figures.lost += len(commands)
            lost = OwnerUnreachable(f"{owner} answered a batch of {len(commands)} writes unreadably", unknown=True)
            return [lost] * len(commands)
        return [_relayed(result) for result in results]

    def queued(self) -> int:
        return sum(lane.queued_commands for lane in self._lanes.values())

    def families(self) -> list[Family]:
        figures = self.figures
        return [
            counter(
                "kvrouter_cluster_forward_batches", "Batches of forwarded writes sent", (), {(): float(figures.batches)}
            ),
            counter(
                "kvrouter_cluster_forward_batched_writes",
                "Commands (writes, selections) forwarded in those batches",
                (),
                {(): float(figures.commands)},
            ),
            counter(
                "kvrouter_cluster_forward_refused_writes",
                f"Writes refused because their owner's forwarding queue was full ({OVERFLOW_POLICY})",
                (),
                {(): float(figures.refused)},
            ),
            gauge(
                "kvrouter_cluster_forward_queued_writes",
                "Writes waiting to be forwarded",
                (),
                {(): float(self.queued())},
            ),
        ]


def _results(body: bytes, count: int) -> list[dict[str, Any]] | None:
    """The owner's ``/batch`` results, if they are ``count`` result objects."""
    try:
        results = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if type(results) is not list or len(results) != count:
        return None
    if not all(type(result) is dict and type(result.get("status")) is int for result in results):
        return None
    return results


def _relayed(result: dict[str, Any]) -> Relayed:
    """One command's result as the answer its own route would have sent (its ``kvrouter-written`` token apart)."""
    status, value = result["status"], result.get("body")
    named = result.get("headers")
    headers: dict[str, Any] = named if type(named) is dict else {}
    written = headers.get(WRITTEN_HEADER)
    others = tuple(
        (str(name).encode("latin-1"), str(header).encode("latin-1"))
        for name, header in headers.items()
        if name != WRITTEN_HEADER
    )
    token = written if type(written) is str else None
    if value is None:
        return Relayed(status, b"", None, token, others)
    if type(value) is str:
        return Relayed(status, value.encode(), b"text/plain; charset=utf-8", token, others)
    return Relayed(status, orjson.dumps(value), JSON, token, others)
