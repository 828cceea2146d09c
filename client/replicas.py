"""A client of several replicas (the members of a cluster): one command stream at a time, to one of them, and the
next replica of the list when that one is gone or refuses a command without applying it.

``ReplicaClient.connect([url, ...], token=...)`` takes the replicas' URLs in the order to try them. It holds one
``StreamClient`` (the stream in use); every operation of ``Operations`` goes through it. What it does on failure:

* **connecting**: a replica that refuses the connection, does not answer the upgrade within ``connect_timeout``,
  or refuses the stream is skipped for the next URL; when every URL was tried, ``NoReplica`` (a ``StreamClosed``)
  names each with its reason;
* **not applied**: a command answered 503 with a message saying it was not applied (the replica could not route
  it: its lease lapsed, its scope's owner had died and nobody had claimed it yet, the owner refused the
  connection) is sent again through the next replica, each replica in turn, with a pause after each round (50 ms
  doubling to 1 s), for at most ``retry_seconds``; after that the last refusal is raised (``CommandError``);
* **the stream closed**: commands sent later go to a new stream on the next replica that accepts. A command that
  was waiting for its result on the closed stream has an unknown outcome: a read (``GET``) is sent again; a write
  raises ``OutcomeUnknown`` (a ``StreamClosed``) and is never sent again by the client;
* **unknown outcomes** are raised, never retried: ``OutcomeUnknown`` above, and a 504 (the service's reply
  deadline passed, a forwarded command whose owner did not answer, a journal that failed mid-write), each a
  ``CommandError``. A 503 always means "not applied". The slot tracker's writes are idempotent by request id: a caller
  that must know sends the same command again (``add`` then answers 409 "already exists" if the first landed).

Reads never go behind the client's own writes: each write's answer names the sequence that holds it
(``kvrouter-written``), and a read of ``/loads`` or ``/workers`` names those of its scopes (``read_tokens``), so a
replica answering from a follower copy answers only from a copy that holds them.

Switching replicas does not cut the commands in flight on the stream left behind: it is closed once they are
answered (at most ``DRAIN_SECONDS``). Reads of a 503 for any reason are retried like a command not applied (a read
changes nothing).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final, TypeVar

import trio
from trio_websocket import ConnectionClosed

from kvrouter.client.operations import Op, Operations, Reply, StreamClosed, result_of
from kvrouter.client.read_tokens import WrittenTokens
from kvrouter.client.stream import CONNECT_SECONDS, MAX_IN_FLIGHT, StreamClient, stream_url

T = TypeVar("T")
log = logging.getLogger("kvrouter.client")

RETRY_SECONDS: Final = 10.0  # how long a command refused "not applied" is sent again, replica after replica
FIRST_PAUSE_SECONDS: Final = 0.05  # after each round of the replicas, doubling
MAX_PAUSE_SECONDS: Final = 1.0
DRAIN_SECONDS: Final = 30.0  # a stream left behind is closed once its commands are answered, or after this


class NoReplica(StreamClosed):
    """No replica of the list accepted the command stream (each URL named with its reason)."""


class OutcomeUnknown(StreamClosed):
    """A write was sent, and its stream closed before its result came: it may or may not have been applied."""


def replica_urls(urls: str | Sequence[str]) -> tuple[str, ...]:
    """The URLs to try, in order: a list, or one string of comma-separated URLs. Each is checked as
    ``StreamClient.connect`` checks it (a ``ValueError`` naming it); none at all is a ``ValueError`` too."""
    found = tuple(url.strip() for url in (urls.split(",") if isinstance(urls, str) else urls) if url.strip())
    if not found:
        raise ValueError("give at least one replica URL (http://host:port)")
    for url in found:
        stream_url(url)
    return found


def not_applied(reply: Reply) -> bool:
    """A 503 whose message says the command was not applied (safe to send again anywhere)."""
    message = reply.body.get("error") if isinstance(reply.body, dict) else None
    return (
        reply.status == 503
        and isinstance(message, str)
        and "not applied" in message
        and "outcome is unknown" not in message
    )


def send_again(op: Op[Any], reply: Reply) -> bool:
    """Whether ``reply`` to ``op`` lets the client send ``op`` to another replica: not applied, or a read's 503."""
    return not_applied(reply) or (reply.status == 503 and op.method == "GET")


class _Held:
    """One stream and how many commands wait on it (a stream left behind closes once they are answered)."""

    def __init__(self, url: str, stream: StreamClient) -> None:
        self.url = url
        self.stream = stream
        self.in_flight = 0
        self.idle = trio.Event()
        self.idle.set()
        self.released = trio.Event()

    def enter(self) -> None:
        self.in_flight += 1
        if self.in_flight == 1:
            self.idle = trio.Event()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()


class ReplicaClient(Operations):
    """Open with ``async with ReplicaClient.connect(urls, token=...) as client``; then as ``StreamClient``."""

    def __init__(self, urls: tuple[str, ...], nursery: trio.Nursery, options: dict[str, Any], retry: float) -> None:
        self.urls = urls
        self.retry_seconds = retry
        self._nursery = nursery
        self._options = options
        self._next = 0  # the index of the URL to try first
        self._held: _Held | None = None
        self._switching = trio.Lock()
        self.connects = 0  # streams opened (the first, then one per switch)
        self.sent_again = 0  # commands sent again through another replica
        self.written = WrittenTokens()  # the tokens of this client's writes, sent with its reads

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(
        cls,
        urls: str | Sequence[str],
        *,
        token: str | None = None,
        max_in_flight: int = MAX_IN_FLIGHT,
        compact: bool = True,
        connect_timeout: float | None = CONNECT_SECONDS,
        retry_seconds: float = RETRY_SECONDS,
    ) -> AsyncIterator[ReplicaClient]:
        """Connect to the first replica of ``urls`` that accepts (``NoReplica`` if none does)."""
        found = replica_urls(urls)
        options: dict[str, Any] = {
            "token": token, "max_in_flight": max_in_flight, "compact": compact, "connect_timeout": connect_timeout,
        }  # fmt: skip
        raised: list[BaseException] = []  # by the caller's block: re-raised as it is, not in a nursery's group
        async with trio.open_nursery() as nursery:
            client = cls(found, nursery, options, retry_seconds)
            try:
                await client._in_use(None)
                yield client
            except BaseException as exc:
                raised.append(exc)
            finally:
                nursery.cancel_scope.cancel()
        if raised:
            raise raised[0]

    @property
    def url(self) -> str | None:
        """The URL of the replica in use (None between a stream's end and the next command)."""
        return self._held.url if self._held is not None else None

    @property
    def format(self) -> str:
        """The format the stream in use speaks (as ``StreamClient.format``)."""
        return self._held.stream.format if self._held is not None else "json"

    async def _hold(self, url: str, *, task_status: trio.TaskStatus[_Held]) -> None:
        """One stream, open until released and its commands answered (or ``DRAIN_SECONDS`` passed)."""
        held: _Held | None = None
        try:
            async with StreamClient.connect(url, **self._options) as stream:
                held = _Held(url, stream)
                task_status.started(held)
                await held.released.wait()
                with trio.move_on_after(DRAIN_SECONDS):
                    await held.idle.wait()
        except (OSError, ConnectionClosed, StreamClosed) as exc:
            if held is None:
                raise  # not connected: ``start`` raises it to ``_in_use``
            log.debug("the command stream to %s ended: %s", url, exc)

    async def _in_use(self, failed: _Held | None) -> _Held:
        """The stream in use; a new one to the next replica that accepts when there is none, or it is ``failed``
        (refused a command not applied, or closed)."""
        async with self._switching:
            held = self._held
            if held is not None and held is not failed and not held.stream.closed:
                return held
            if held is not None:
                held.released.set()
                self._held = None
                self._next = (self.urls.index(held.url) + 1) % len(self.urls)
            reasons = []
            for k in range(len(self.urls)):
                index = (self._next + k) % len(self.urls)
                try:
                    self._held = await self._nursery.start(self._hold, self.urls[index])
                except (OSError, StreamClosed) as exc:  # TimeoutError is an OSError
                    reasons.append(f"{self.urls[index]}: {exc or type(exc).__name__}")
                    continue
                self._next = index
                self.connects += 1
                return self._held
            raise NoReplica("no replica accepted the command stream (" + "; ".join(reasons) + ")")

    async def perform(self, op: Op[T]) -> T:
        """Send ``op`` through the replica in use, and again through the next while it is refused "not applied"
        (or, a read, while its stream closes or it is answered 503), for at most ``retry_seconds``."""
        raw = op.every_reply(self.written.read_path(op.method, op.path))
        deadline = trio.current_time() + self.retry_seconds
        pause = FIRST_PAUSE_SECONDS
        failed: _Held | None = None
        attempt = 0
        while True:
            attempt += 1
            held = await self._in_use(failed)
            held.enter()
            try:
                reply = await held.stream.perform(raw)
            except StreamClosed as exc:
                if op.method != "GET" or trio.current_time() >= deadline:
                    raise OutcomeUnknown(f"{held.url}: {exc}; the command's outcome is unknown") from None
                failed = held
                continue
            finally:
                held.leave()
            self.written.note(reply.headers)
            if not send_again(op, reply) or trio.current_time() >= deadline:
                return result_of(op, reply)
            failed = held
            self.sent_again += 1
            if attempt % len(self.urls) == 0:
                await trio.sleep(min(pause, max(0.0, deadline - trio.current_time())))
                pause = min(pause * 2, MAX_PAUSE_SECONDS)
