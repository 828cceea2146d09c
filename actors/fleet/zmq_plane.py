"""Dynamo's ZMQ event plane: one SUB socket per ``kv-events`` channel a discovered worker names, handed to
``EventPlaneIngest``.

Each publisher binds a PUB socket per topic and writes its address in its event channel record; kvrouter connects a
SUB there (one reader task per endpoint, following discovery) and reads four-frame messages
(``dynamo_events.decode_zmq_message``). ZMQ keeps nothing for a subscriber that is away or joins late, and PUB
drops at its high-water mark: both show as sequence gaps, counted per worker. libzmq reconnects a dropped connection
by itself; the endpoint's host is resolved here, never in libzmq's shared I/O thread.

Backpressure: a reader awaits the ingest of what it took before it reads again (policy: block); the SUB pipe then
fills to ``RCVHWM`` and the publisher's PUB drops, which the sequence numbers reveal.
"""

from __future__ import annotations

import logging
from typing import Final

import trio
import zmq

from kvrouter.actors.fleet.dynamo_events import Envelope, EnvelopeError, decode_zmq_message
from kvrouter.actors.fleet.event_ingest import EventPlaneIngest
from kvrouter.actors.peers.endpoints import EndpointError, ResolveError, parse_connect_endpoint, resolve
from kvrouter.actors.transport.zmq_socket import open_socket

log = logging.getLogger("kvrouter.event_plane")

RCVHWM: Final = 1000  # messages queued per channel while the ingest is busy
GROUP_MAX: Final = 256  # messages taken from the socket per hand-over
MAX_MESSAGE_BYTES: Final = 32 * 1024 * 1024  # as the engine listeners' cap (actors/kv_listener.py)
RECONNECT_IVL_MS: Final = 100
RESOLVE_RETRY_SECONDS: Final = 2.0


class ZmqPlane:
    def __init__(self, ingest: EventPlaneIngest) -> None:
        self._ingest = ingest
        self._nursery: trio.Nursery | None = None
        self._readers: dict[str, trio.CancelScope] = {}
        self.unreadable = 0
        self.problems: dict[str, str] = {}  # endpoint -> why it is not read (resolution)

    async def run(self, *, task_status: trio.TaskStatus[ZmqPlane] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started(self)
            await trio.sleep_forever()

    def reading(self, endpoint: str) -> bool:
        """Whether ``endpoint`` is read now: a reader follows it and its host resolved (libzmq keeps the connection,
        reconnecting by itself, so a publisher that is gone but still discovered counts as read)."""
        return endpoint in self._readers and endpoint not in self.problems

    def follow(self, endpoints: set[str]) -> None:
        """Read exactly these endpoints (discovered channels): start new readers, stop the others."""
        assert self._nursery is not None, "ZmqPlane.run has not started"
        for endpoint in [e for e in self._readers if e not in endpoints]:
            self._readers.pop(endpoint).cancel()
            self.problems.pop(endpoint, None)
        for endpoint in sorted(endpoints - self._readers.keys()):
            scope = trio.CancelScope()
            self._readers[endpoint] = scope
            self._nursery.start_soon(self._read, endpoint, scope)

    async def _read(self, endpoint: str, scope: trio.CancelScope) -> None:
        with scope:
            while True:
                try:
                    resolved = await resolve(parse_connect_endpoint(endpoint))
                    break
                except (EndpointError, ResolveError) as exc:
                    if endpoint not in self.problems:
                        log.warning("event plane: cannot read %s: %s", endpoint, exc)
                    self.problems[endpoint] = str(exc)
                    await trio.sleep(RESOLVE_RETRY_SECONDS)
            self.problems.pop(endpoint, None)
            options: dict[int, int | bytes] = {
                zmq.MAXMSGSIZE: MAX_MESSAGE_BYTES,
                zmq.RECONNECT_IVL: RECONNECT_IVL_MS,
                zmq.IPV6: int(resolved.ipv6),
            }
            with open_socket(zmq.SUB, rcvhwm=RCVHWM, options=options) as sub:
                sub.socket.setsockopt(zmq.SUBSCRIBE, b"")
                sub.socket.connect(resolved.endpoint)
                log.info("event plane: reading %s", endpoint)
                while True:
                    group = [await sub.recv_multipart()]
                    while len(group) < GROUP_MAX and (frames := sub.try_recv_multipart()) is not None:
                        group.append(frames)
                    await self._ingest.ingest(self._envelopes(group))

    def _envelopes(self, group: list[list[bytes]]) -> list[Envelope]:
        envelopes = []
        for frames in group:
            try:
                envelopes.append(decode_zmq_message(frames))
            except EnvelopeError as exc:
                self.unreadable += 1
                self._ingest.unreadable += 1
                log.debug("event plane: message skipped: %s", exc)
        return envelopes
