"""The front side of the process split: stand-ins for the service objects that forward each call to the
actor process over ZMQ ipc, in batches, and hand back its reply.

``RemoteService(link, "service", SelectService)`` has the methods of ``SelectService`` (its public async
ones) with the same arguments and results: the routes cannot tell it from the real object. Each call
is queued on the ``ServiceLink``; its sender task puts everything queued during one loop turn in one
message (PUSH to the actor process), its receiver task matches replies (PULL, bound by this front) to
waiting calls by id. A failure comes back as data and is raised again as the same exception.

Bounds (named policies): at most ``max_in_flight`` calls wait for the actor process per front; one more
is refused at once with ``Overloaded`` (503 with Retry-After, as a full mailbox is). A call unanswered
``give_up_after`` seconds (the actor's own reply deadline plus a margin: the actor process answers 504
itself long before) is failed with ``ReplyTimeout`` by a sweep once a second, so a lost reply can never
hold a request forever.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import outcome
import trio

from kvrouter.actors.mailbox import Overloaded, ReplyTimeout
from kvrouter.actors.transport.zmq_socket import TrioZmqSocket
from kvrouter.api.process.wire import (
    MethodSpec,
    decode_failure,
    decode_result,
    encode_args,
    method_table,
    pack,
    pack_message,
    unpack,
)

log = logging.getLogger("kvrouter.fronts")

DEFAULT_MAX_IN_FLIGHT = 4096
SWEEP_SECONDS = 1.0
MAX_BATCH_CALLS = 1024  # calls per message: a message stays far below the actor process's RCVHWM budget


class _Waiting:
    __slots__ = ("call_id", "expires", "task")

    def __init__(self, call_id: int, task: trio.lowlevel.Task, expires: float) -> None:
        self.call_id = call_id
        self.task = task
        self.expires = expires


class ServiceLink:
    """One front's connection to the actor process (see the module doc)."""

    def __init__(
        self,
        push: TrioZmqSocket,
        pull: TrioZmqSocket,
        *,
        front: int,
        incarnation: int,
        give_up_after: float,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    ) -> None:
        self._push = push
        self._pull = pull
        self._front = front
        self._incarnation = incarnation
        self._give_up_after = give_up_after
        self._max_in_flight = max_in_flight
        self._ids = itertools.count(1)
        self._waiting: dict[int, _Waiting] = {}  # in call order, so the sweep stops at the first live one
        self._outbox: list[bytes] = []  # packed calls
        self._queued = trio.Event()
        self.sent_messages = 0
        self.sent_calls = 0

    @property
    def in_flight(self) -> int:
        return len(self._waiting)

    async def call(self, target: str, spec: MethodSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if len(self._waiting) >= self._max_in_flight:
            raise Overloaded(f"this front already has {self._max_in_flight} requests waiting for the actor process")
        call_id = next(self._ids)
        packed = pack([call_id, target, spec.name, encode_args(spec, args, kwargs)])
        waiting = _Waiting(call_id, trio.lowlevel.current_task(), trio.current_time() + self._give_up_after)
        self._waiting[call_id] = waiting
        self._outbox.append(packed)
        self._queued.set()

        def abort(_: Any) -> trio.lowlevel.Abort:
            self._waiting.pop(call_id, None)  # a reply that still comes is dropped
            return trio.lowlevel.Abort.SUCCEEDED

        ok, payload = await trio.lowlevel.wait_task_rescheduled(abort)
        if not ok:
            raise decode_failure(payload)
        return decode_result(spec, payload)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Send, receive and sweep until cancelled; the link's sockets close when it ends."""
        with self._push, self._pull:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._send_batches)
                nursery.start_soon(self._receive_replies)
                nursery.start_soon(self._sweep)
                task_status.started()

    async def _send_batches(self) -> None:
        while True:
            await self._queued.wait()
            self._queued = trio.Event()
            batch, self._outbox = self._outbox, []
            for start in range(0, len(batch), MAX_BATCH_CALLS):
                part = batch[start : start + MAX_BATCH_CALLS]
                await self._push.send_multipart([pack_message(self._front, self._incarnation, items=part)])
                self.sent_messages += 1
                self.sent_calls += len(part)

    async def _receive_replies(self) -> None:
        while True:
            [frame] = await self._pull.recv_multipart()
            incarnation, replies = unpack(frame)
            if incarnation != self._incarnation:
                continue  # meant for this front's previous process
            for call_id, ok, payload in replies:
                waiting = self._waiting.pop(call_id, None)
                if waiting is not None:
                    trio.lowlevel.reschedule(waiting.task, outcome.Value((ok, payload)))

    async def _sweep(self) -> None:
        while True:
            await trio.sleep(SWEEP_SECONDS)
            now = trio.current_time()
            expired = []
            for waiting in self._waiting.values():
                if waiting.expires > now:
                    break
                expired.append(waiting)
            for waiting in expired:
                del self._waiting[waiting.call_id]
                late = ReplyTimeout(f"front-{self._front}-{waiting.call_id}", self._give_up_after)
                trio.lowlevel.reschedule(waiting.task, outcome.Error(late))


class RemoteService:
    """A service object's stand-in: its public async methods, forwarded over ``link``."""

    def __init__(self, link: ServiceLink, target: str, service_class: type) -> None:
        self._link = link
        self._target = target
        self._methods = method_table(service_class)
        self.__name__ = f"Remote{service_class.__name__}"

    def __getattr__(self, name: str) -> Callable[..., Any]:
        spec = self._methods.get(name)
        if spec is None:
            raise AttributeError(f"{self.__name__} has no remote method {name!r}")
        link, target = self._link, self._target

        async def forward(*args: Any, **kwargs: Any) -> Any:
            return await link.call(target, spec, args, kwargs)

        forward.__name__ = name
        self.__dict__[name] = forward  # built once per method
        return forward
