"""The actor process's side of the split: calls from the fronts run on the real service objects.

One PULL socket (bound in the runtime directory) receives every front's batches; each call becomes a task
that decodes its arguments, awaits the service method (a write returns once it is durable, as in one
process) and queues its reply for its front, except the slot tracker's writes: consecutive ones of a
message go to ``SlotService.apply_writes`` together, in one task (one mailbox post per scope, one wake-up
when all are durable), each answered as its own call. One sender task per front puts every reply queued during
one loop turn in one message (PUSH, connected to the front's own PULL). A front that died and came back
binds the same path: replies meant for its previous process carry that process's incarnation and are
dropped there.

Bounds: each front keeps at most its ``max_in_flight`` calls outstanding, so the calls running here and
the replies queued per front are bounded by that (twice it, briefly, across a front's restart).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio
import zmq

from kvrouter.actors.transport.zmq_socket import TrioZmqSocket, open_socket
from kvrouter.api.process.wire import (
    INTERNAL,
    MethodSpec,
    decode_args,
    encode_failure,
    encode_result,
    method_table,
    pack,
    pack_message,
    unpack,
)

log = logging.getLogger("kvrouter.fronts")

WRITES_TARGET = "service"  # the service object, as the fronts name it
SOCKET_HWM = 10_000  # messages per pipe; each front has at most its max_in_flight calls outstanding


async def _no_writes(writes: list[Any]) -> list[Any]:
    raise AssertionError("a service object without apply_writes has no batched writes")


class _Front:
    """The reply path to one front process."""

    def __init__(self, socket: TrioZmqSocket) -> None:
        self.socket = socket
        self.replies: dict[int, list[bytes]] = {}  # incarnation -> packed replies queued for it
        self.queued = trio.Event()


class Dispatcher:
    def __init__(self, targets: dict[str, object], endpoint: str, front_endpoint: str) -> None:
        """``targets``: the service objects by name; ``endpoint``: where fronts send calls;
        ``front_endpoint``: the reply endpoint of front ``i`` is ``front_endpoint.format(i)``."""
        self._targets = targets
        self._tables: dict[str, dict[str, MethodSpec]] = {
            name: method_table(type(target)) for name, target in targets.items()
        }
        self._endpoint = endpoint
        self._front_endpoint = front_endpoint
        self._fronts: dict[int, _Front] = {}
        # The calls of WRITES_TARGET that go through its apply_writes in batches (the slot tracker's writes).
        writer = targets.get(WRITES_TARGET)
        self._batched_writes: frozenset[str] = getattr(writer, "BATCHED_WRITES", frozenset())
        self._apply_writes: Callable[[list[Any]], Awaitable[list[Any]]] = getattr(writer, "apply_writes", _no_writes)
        self.received_messages = 0
        self.received_calls = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        pull = open_socket(zmq.PULL, rcvhwm=SOCKET_HWM, sndhwm=SOCKET_HWM)
        try:
            pull.socket.bind(self._endpoint)
            async with trio.open_nursery() as nursery:
                task_status.started()
                while True:
                    [frame] = await pull.recv_multipart()
                    front_index, incarnation, calls = unpack(frame)
                    front = self._front(front_index, nursery)
                    self.received_messages += 1
                    self.received_calls += len(calls)
                    # start (not start_soon): each call runs to its first wait before the next starts, so
                    # the calls of one message reach their scopes' mailboxes in the order the front sent them
                    # (trio runs a batch of new tasks in either order; a pipelined /batch relies on this).
                    writes: list[tuple[int, list[Any]]] = []
                    for call_id, target, method, args in calls:
                        if target == WRITES_TARGET and method in self._batched_writes:
                            writes.append((call_id, [method, *args[0], *args[1:]]))
                            continue
                        if writes:
                            await nursery.start(self._writes, front, incarnation, writes)
                            writes = []
                        await nursery.start(self._call, front, incarnation, call_id, target, method, args)
                    if writes:
                        await nursery.start(self._writes, front, incarnation, writes)
        finally:
            pull.close()
            for front in self._fronts.values():
                front.socket.close()

    def _front(self, index: int, nursery: trio.Nursery) -> _Front:
        front = self._fronts.get(index)
        if front is None:
            push = open_socket(zmq.PUSH, rcvhwm=SOCKET_HWM, sndhwm=SOCKET_HWM)
            push.socket.connect(self._front_endpoint.format(index))
            front = self._fronts[index] = _Front(push)
            nursery.start_soon(self._send_replies, front)
        return front

    async def _call(
        self,
        front: _Front,
        incarnation: int,
        call_id: int,
        target: str,
        method: str,
        args: Any,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        task_status.started()
        try:
            spec = self._tables[target][method]
            result = await getattr(self._targets[target], method)(*decode_args(spec, args))
            reply = pack([call_id, True, encode_result(spec, result)])
        except Exception as exc:
            failure = encode_failure(exc)
            if failure[0] == INTERNAL:
                log.exception("a forwarded call %s.%s failed", target, method)
            reply = pack([call_id, False, failure])
        front.replies.setdefault(incarnation, []).append(reply)
        front.queued.set()

    async def _writes(
        self,
        front: _Front,
        incarnation: int,
        writes: list[tuple[int, list[Any]]],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Consecutive slot tracker writes of one message as one ``apply_writes`` call (one task, one mailbox
        post per scope), each answered as its own call would be: its result, or its failure as data."""
        task_status.started()
        try:
            outcomes = await self._apply_writes([item for _, item in writes])
            replies = [
                pack([call_id, True, outcome] if type(outcome) is bool else [call_id, False, outcome])
                for (call_id, _), outcome in zip(writes, outcomes, strict=True)
            ]
        except Exception as exc:
            failure = encode_failure(exc)
            if failure[0] == INTERNAL:
                log.exception("%d forwarded writes failed", len(writes))
            replies = [pack([call_id, False, failure]) for call_id, _ in writes]
        front.replies.setdefault(incarnation, []).extend(replies)
        front.queued.set()

    async def _send_replies(self, front: _Front) -> None:
        while True:
            await front.queued.wait()
            front.queued = trio.Event()
            batches, front.replies = front.replies, {}
            for incarnation, replies in batches.items():
                await front.socket.send_multipart([pack_message(incarnation, items=replies)])
