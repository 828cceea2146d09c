"""One NATS connection on one asyncio thread, shared by every JetStream user of a process that opens it.

A cluster replica serves up to ``MAX_OWNED_SCOPES`` scopes, each with a journal of its own, plus its subject check
and its follower copies. Each of them used to open its own connection on its own asyncio thread; now the replica
opens ``NatsSessions`` at start (one session per NATS server, on one thread; each scope's journal on the session
its log name hashes to) and each of them builds its ``JetStreamLink`` (or ``Subjects``) on one: a JetStream
context of its own over the one connection (nothing but a prefix and a timeout), and no close of its own. Closing
the session (once, at the replica's stop) closes the connection and stops the thread. A single node's journal
(``--journal jetstream``) opens a private session and closes it with the journal.

Why sharing is safe: nats-py multiplexes requests on one connection (each request has a reply token of its own on
the connection's response inbox), and every call made here keeps its state per call (a read's pull consumer and
its inbox subscription, a snapshot's object chunks) or per link (its subject, its fence), never per connection.
The many scopes' publishes run concurrently on the one loop; each scope still crosses to it once per group commit.

Bounded (``open_nats``): the connection buffers at most ``PENDING_BYTES`` of outgoing commands while it reconnects
(a publish past that fails at once, and its journal stops as on any failed publish); while connected, a publish
that finds more than that waiting forces a flush bounded by ``REQUEST_TIMEOUT_SECONDS``. The flusher's queue holds at
most ``FLUSHER_QUEUE`` waiting publishes (a full queue makes the next publisher wait). Each scope has at most one
publish in flight (its group commit), so the buffer holds at most ``PENDING_BYTES`` plus one message per scope.
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from kvrouter.journal.asyncio_thread import AsyncioThread
from kvrouter.journal.jetstream_link import REQUEST_TIMEOUT_SECONDS, connect_bound, connect_journal

T = TypeVar("T")


class NatsSession:
    """``NatsSession.open(servers, name)`` (or ``open_blocking``); ``call`` to run on its loop; ``aclose`` once."""

    def __init__(self, thread: AsyncioThread, nc: Any, servers: tuple[str, ...], owns_thread: bool = True) -> None:
        self.thread = thread
        self.nc = nc  # the connection: only ever used on ``thread``'s loop
        self.servers = servers
        self._owns_thread = owns_thread  # False: a ``NatsSessions`` pool's, which stops the thread itself
        # Requests the journals on it made to check that an append is on the chain (``jetstream_link``): one per
        # group commit that found another subject's message between its fence and its own; the replica's figure.
        self.chain_requests = 0

    @classmethod
    def open_blocking(cls, servers: tuple[str, ...], name: str, thread_name: str | None = None) -> NatsSession:
        """Start the thread and connect (bounded), or raise ``JournalUnreachable`` naming the servers.

        ``name`` is the connection's name as nats-server shows it (``/connz``); blocking: startup, or a worker
        thread."""
        thread = AsyncioThread(thread_name or name)
        thread.start_blocking()
        try:
            nc = thread.call_blocking(connect_journal, servers, name, timeout=connect_bound(servers) + 1)
        except BaseException:
            thread.stop_blocking()
            raise
        return cls(thread, nc, servers)

    @classmethod
    async def open(cls, servers: tuple[str, ...], name: str, thread_name: str | None = None) -> NatsSession:
        """``open_blocking`` from trio (in a worker thread: it blocks at most the connect bound)."""
        return await trio.to_thread.run_sync(cls.open_blocking, servers, name, thread_name)

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``fn(*args)`` on the session's loop (``AsyncioThread.call``)."""
        return await self.thread.call(fn, *args)

    def call_blocking(self, fn: Callable[..., Awaitable[T]], *args: Any, timeout: float) -> T:
        return self.thread.call_blocking(fn, *args, timeout=timeout)

    async def aclose(self) -> None:
        """Close the connection (bounded) and stop the thread (if it is the session's own). Idempotent."""
        if self._owns_thread:
            await self.thread.stop(before=self._close)
        else:
            with contextlib.suppress(Exception):  # best effort: the pool stops the thread all the same
                await self.thread.call(self._close)

    def close_blocking(self) -> None:
        """``aclose`` for synchronous callers (a journal whose open failed, in a worker thread)."""
        with contextlib.suppress(Exception):  # best effort: the thread stops all the same
            self.thread.call_blocking(self._close, timeout=REQUEST_TIMEOUT_SECONDS + 1)
        if self._owns_thread:
            self.thread.stop_blocking()

    async def _close(self) -> None:
        await asyncio.wait_for(self.nc.close(), REQUEST_TIMEOUT_SECONDS)


class NatsSessions:
    """A replica's NATS connections: one per server named (``--nats-server``), each preferring its own server and
    falling back on the others in order, all on one asyncio thread. A scope's journal uses the connection its log
    name hashes to (``for_log``), so the scopes spread over the servers as when each scope had a connection of its
    own to a random server: a NATS node cut off from the JetStream majority stops the scopes going through it, not
    all of the replica's. The subject check and the follower links use ``readers`` (by the replica's name).

    ``NatsSessions.open(servers, name)``; ``aclose`` once (every connection, then the thread)."""

    def __init__(self, thread: AsyncioThread, sessions: list[NatsSession], name: str = "") -> None:
        self.thread = thread
        self.sessions = sessions
        self.first = sessions[0]
        # The replica-wide readers' connection (the subject check, the follower rounds): chosen by the replica's
        # name, so the replicas of a cluster spread them over the servers rather than all asking the first.
        self.readers = self.for_log(name)

    @property
    def servers(self) -> tuple[str, ...]:
        return self.first.servers

    @property
    def chain_requests(self) -> int:
        return sum(session.chain_requests for session in self.sessions)

    def for_log(self, log: str) -> NatsSession:
        """The connection of the journal ``log`` (a stable choice: the same on every run and replica)."""
        return self.sessions[zlib.crc32(log.encode()) % len(self.sessions)]

    @classmethod
    def open_blocking(cls, servers: tuple[str, ...], name: str, thread_name: str | None = None) -> NatsSessions:
        """Start the thread and open one connection per server (each bounded), or raise ``JournalUnreachable``
        naming the servers (nothing left open)."""
        thread = AsyncioThread(thread_name or name)
        thread.start_blocking()
        sessions: list[NatsSession] = []
        try:
            for index in range(len(servers)):
                preferred = servers[index:] + servers[:index]
                bound = connect_bound(preferred) + 1
                nc = thread.call_blocking(connect_journal, preferred, name, True, timeout=bound)
                sessions.append(NatsSession(thread, nc, preferred, owns_thread=False))
        except BaseException:
            for session in sessions:
                session.close_blocking()
            thread.stop_blocking()
            raise
        return cls(thread, sessions, name)

    @classmethod
    async def open(cls, servers: tuple[str, ...], name: str, thread_name: str | None = None) -> NatsSessions:
        return await trio.to_thread.run_sync(cls.open_blocking, servers, name, thread_name)

    async def aclose(self) -> None:
        async def close_all() -> None:
            for session in self.sessions:
                with contextlib.suppress(Exception):
                    await session._close()

        await self.thread.stop(before=close_all)
