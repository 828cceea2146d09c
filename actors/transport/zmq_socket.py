"""A single-owner trio adapter for one pyzmq socket (docs/architecture/index.md#zeromq-under-trio).

There is no maintained trio binding for pyzmq, and ``zmq.asyncio`` is asyncio-only, so we own this
small adapter. The rules it relies on:

* ``sock.FD`` is edge-triggered and signals *any* change of the ``zmq.EVENTS`` cache (read and write
  readiness both show up as "readable"). Any call on the socket (send, recv, getsockopt, even
  setsockopt) can consume that edge. So we never park on the FD without first asking
  ``get(zmq.EVENTS)``: if the wanted flag is already set, the edge may be gone and waiting would hang.
* Every operation uses ``zmq.NOBLOCK``; ``zmq.Again`` is the only signal to wait.
* One task owns the socket: ``trio.lowlevel.wait_readable`` raises ``BusyResourceError`` if two
  tasks park on one fd, and a second task's recv/send can eat the owner's wakeup. Sequential use by
  several tasks is safe (we re-check EVENTS before every wait); concurrent use is not.
* Belt and braces: every wait is capped by a safety timeout, after which EVENTS is re-checked, so a
  missed edge costs at most that long instead of a hang.
* ``close()`` calls ``notify_closing`` before closing, so a task parked on the FD gets
  ``trio.ClosedResourceError`` instead of waiting on a recycled fd number.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Final, cast, final

import trio
import zmq

from kvrouter.actors.transport.socket_budget import ZMQ_MAX_SOCKETS

# How long a parked task trusts the FD edge before re-checking EVENTS by itself: the most a missed edge
# (which the single-owner rule above should make impossible) can delay a socket. Every parked socket
# wakes this often, and a KV listener parks two (SUB and monitor): at 0.5 s, 1,024 idle listeners cost
# 27% of a core in wakeups and 4,096 saturated the event loop (benchmarks/socket_scale_bench.py); at
# 5 s, 12% for 1,024 (8 points of which are libzmq's heartbeats).
SAFETY_TIMEOUT: Final = 5.0

_NOBLOCK: Final = int(zmq.NOBLOCK)

# Default high-water marks (messages per peer pipe). Explicit on every socket (TIGER_STYLE: no
# library defaults); callers that care pass their own.
DEFAULT_HWM: Final = 1000


_sized_context: zmq.Context[zmq.Socket[bytes]] | None = None


def zmq_context() -> zmq.Context[zmq.Socket[bytes]]:
    """The process-wide context: one I/O thread serves every socket, and inproc needs one context.

    Sized for the largest supported cluster (``ZMQ_MAX_SOCKETS``, see socket_budget) instead of
    libzmq's default of 1,023 sockets. libzmq fixes the limit when the context makes its first
    socket, so every socket must come from here (``open_socket``), the first one included.

    Never terminate it while sockets are open (``term()`` would block on them); sockets here are
    closed with linger 0, and pyzmq terminates the singleton at interpreter exit.
    """
    global _sized_context
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    if context is not _sized_context:
        context.set(zmq.MAX_SOCKETS, ZMQ_MAX_SOCKETS)
        _sized_context = context
    return context


def open_socket(
    socket_type: int,
    *,
    sndhwm: int = DEFAULT_HWM,
    rcvhwm: int = DEFAULT_HWM,
    linger_ms: int = 0,
    options: Mapping[int, int | bytes] | None = None,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
    safety_timeout: float = SAFETY_TIMEOUT,
) -> TrioZmqSocket:
    """Create a socket with HWMs and LINGER set explicitly, plus any extra ``options``.

    Options are applied before the caller binds or connects, which is when most of them take effect.
    """
    sock = (context or zmq_context()).socket(socket_type)
    try:
        sock.setsockopt(zmq.LINGER, linger_ms)
        sock.setsockopt(zmq.SNDHWM, sndhwm)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        for option, value in (options or {}).items():
            sock.setsockopt(option, value)
    except BaseException:
        sock.close(linger=0)
        raise
    return TrioZmqSocket(sock, safety_timeout=safety_timeout)


def _int_option(sock: zmq.Socket[bytes], option: int) -> int:
    """An integer socket option (FD, EVENTS, ...): pyzmq types every ``getsockopt`` as ``int | bytes``."""
    return cast(int, sock.getsockopt(option))


@final
class TrioZmqSocket:
    """One zmq socket driven from trio. Use it from one task at a time (see the module docstring)."""

    __slots__ = ("_closed", "_fd", "_safety_timeout", "_sock")

    def __init__(self, sock: zmq.Socket[bytes], *, safety_timeout: float = SAFETY_TIMEOUT) -> None:
        self._sock = sock
        self._fd = _int_option(sock, zmq.FD)
        self._safety_timeout = safety_timeout
        self._closed = False

    @property
    def socket(self) -> zmq.Socket[bytes]:
        """The raw socket, for bind/connect/setsockopt by the owner task (never blocking calls)."""
        return self._sock

    @property
    def closed(self) -> bool:
        return self._closed

    def events(self) -> int:
        """``zmq.EVENTS`` now (POLLIN/POLLOUT bits); reading it also re-arms the FD's edge."""
        return _int_option(self._sock, zmq.EVENTS)

    def try_recv_multipart(self) -> list[bytes] | None:
        """One whole message if one is queued, else None. Multipart messages arrive atomically.

        Each frame is taken as a ``zmq.Frame``, whose ``more`` flag pyzmq reads in C while receiving it: pyzmq's
        ``recv_multipart`` asks for RCVMORE through ``getsockopt`` instead, which resolves the option by name
        (~1.7 us a frame). A 3-frame KV batch is read in ~4.7 us instead of ~7.6 (main thread CPU), with every
        frame's RCVMORE still read, so a message keeps its exact frame count.
        """
        if self._closed:
            raise trio.ClosedResourceError("zmq socket was closed")
        recv = self._sock.recv
        try:
            frame = recv(_NOBLOCK, copy=False)
        except zmq.Again:
            return None
        frames = [frame.bytes]
        while frame.more:
            frame = recv(_NOBLOCK, copy=False)  # never Again: the rest of a message is queued with its first frame
            frames.append(frame.bytes)
        return frames

    def try_send_multipart(self, frames: Sequence[bytes]) -> bool:
        """Queue one message without waiting; False if the socket would block (HWM, no peer)."""
        if self._closed:
            raise trio.ClosedResourceError("zmq socket was closed")
        try:
            self._sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    async def recv_multipart(self) -> list[bytes]:
        """Receive one message, parking on the FD only while nothing is queued.

        Cancellation is safe: a message is either returned or left in the socket's queue.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        while (frames := self.try_recv_multipart()) is None:
            await self._wait(zmq.POLLIN)
        await trio.lowlevel.cancel_shielded_checkpoint()
        return frames

    async def send_multipart(self, frames: Sequence[bytes]) -> None:
        """Send one message, waiting while the socket reports it would block."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while not self.try_send_multipart(frames):
            await self._wait(zmq.POLLOUT)
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def _wait(self, flag: int) -> None:
        """Return once ``flag`` may be ready: EVENTS says so, the FD fired, or the safety timeout passed.

        Reading EVENTS first processes pending commands and re-arms the edge, so if the flag is absent
        now, the next change is guaranteed to make the FD readable.
        """
        if self.events() & flag:
            # Ready already (a message raced in after Again): yield once so a socket that keeps
            # claiming readiness can never spin the loop.
            await trio.lowlevel.checkpoint()
            return
        with trio.move_on_after(self._safety_timeout):
            await trio.lowlevel.wait_readable(self._fd)  # ClosedResourceError if close() runs meanwhile

    def close(self, linger_ms: int = 0) -> None:
        """Wake any task parked on the FD (ClosedResourceError), then close. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(RuntimeError):  # outside trio.run nobody can be parked on the fd
            trio.lowlevel.notify_closing(self._fd)
        self._sock.close(linger=linger_ms)

    def __enter__(self) -> TrioZmqSocket:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
