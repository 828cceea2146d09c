"""The actor process's side of the split: calls from the fronts run on the real service objects.

One PULL socket (bound in the runtime directory) receives every front's batches; each call becomes a task
that decodes its arguments, awaits the service method (a write returns once it is durable, as in one
process) and queues its reply for its front. One sender task per front puts every reply queued during
one loop turn in one message (PUSH, connected to the front's own PULL). A front that died and came back
binds the same path: replies meant for its previous process carry that process's incarnation and are
dropped there.

Bounds: each front keeps at most its ``max_in_flight`` calls outstanding, so the calls running here and
the replies queued per front are bounded by that (twice it, briefly, across a front's restart).
"""

from __future__ import annotations

import logging
from typing import Any

import trio
import zmq

from kvrouter.actors.peers.zmq_socket import TrioZmqSocket, open_socket
from kvrouter.api.service_wire import (
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

SOCKET_HWM = 10_000  # messages per pipe; each front has at most its max_in_flight calls outstanding


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
                    for call_id, target, method, args in calls:
                        await nursery.start(self._call, front, incarnation, call_id, target, method, args)
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

    async def _send_replies(self, front: _Front) -> None:
        while True:
            await front.queued.wait()
            front.queued = trio.Event()
            batches, front.replies = front.replies, {}
            for incarnation, replies in batches.items():
                await front.socket.send_multipart([pack_message(incarnation, items=replies)])
