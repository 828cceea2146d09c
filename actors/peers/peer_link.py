"""One replica peer, inbound: a SUB connected to the peer's PUB, its connection watched, its traffic limited.

libzmq reconnects a dropped TCP connection by itself, but not after a protocol error: a frame over
ZMQ_MAXMSGSIZE or a failed handshake (a CURVE key the peer does not accept, or a peer without CURVE)
ends that connection for good, reported only to a socket monitor. So a monitor watches the SUB, and
when no handshake succeeds within ``reconnect_after`` of a loss (doubling up to ``RECONNECT_AFTER_MAX``)
the link reconnects itself. Each outage is logged once, at warning, with what the operator should check.

Two tasks: the reader owns the SUB (receives, applies the rate limit, reconnects when asked), the
watcher owns the monitor. The watcher asks for a reconnection by cancelling the reader's receive.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

import attrs
import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from kvrouter.actors.peers.peer_limits import PeerLimits, TokenBucket
from kvrouter.actors.transport.zmq_socket import TrioZmqSocket, open_socket

log = logging.getLogger("kvrouter.replica")

RECONNECT_AFTER: Final = 1.0
RECONNECT_AFTER_MAX: Final = 30.0

_HANDSHAKE_FAILED: Final = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_MONITOR_EVENTS: Final = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED | zmq.EVENT_MONITOR_STOPPED
)


@attrs.frozen
class CurveClient:
    """The CURVE options of a SUB: our key pair and the key the peer's PUB must prove (all Z85)."""

    public_key: bytes
    secret_key: bytes
    server_key: bytes


@attrs.define
class LinkStats:
    """Per peer, for logs and tests."""

    received: int = 0  # messages read from the socket
    rate_limited: int = 0  # of which dropped by the rate limit
    connections: int = 0  # handshakes that succeeded
    disconnects: int = 0  # established connections lost (peer gone, or a frame over the size limit)
    handshake_failures: int = 0  # connections that never completed a handshake (keys, mechanism)
    reconnects: int = 0  # times the link reconnected by itself


OnMessage = Callable[[list[bytes]], Awaitable[None]]


class PeerLink:
    """Create with ``open`` (connects at once, so zmq refusing the endpoint fails the caller), then ``run``."""

    def __init__(
        self,
        endpoint: str,
        sub: TrioZmqSocket,
        monitor: TrioZmqSocket,
        limits: PeerLimits,
        *,
        secure: bool,
        reconnect_after: float = RECONNECT_AFTER,
    ) -> None:
        self.endpoint = endpoint
        self.stats = LinkStats()
        self._sub = sub
        self._monitor = monitor
        self._limits = limits
        self._secure = secure
        self._reconnect_after = reconnect_after
        self._reconnect_due = False
        self._recv_scope = trio.CancelScope()
        self._outage_logged = False
        self._rate_logged = False

    @classmethod
    def open(
        cls,
        endpoint: str,
        topics: Sequence[bytes],
        limits: PeerLimits,
        hwm: int,
        curve: CurveClient | None = None,
        *,
        reconnect_after: float = RECONNECT_AFTER,
    ) -> PeerLink:
        """A SUB subscribed to each of ``topics`` and connected to ``endpoint``, with its monitor.

        Raises zmq.ZMQError if zmq refuses the endpoint (nothing is left open).
        """
        options: dict[int, int | bytes] = {zmq.MAXMSGSIZE: limits.max_message_bytes}
        if curve is not None:
            options |= {
                zmq.CURVE_PUBLICKEY: curve.public_key,
                zmq.CURVE_SECRETKEY: curve.secret_key,
                zmq.CURVE_SERVERKEY: curve.server_key,
            }
        sub = open_socket(zmq.SUB, sndhwm=hwm, rcvhwm=hwm, options=options)
        monitor: TrioZmqSocket | None = None
        try:
            monitor = TrioZmqSocket(sub.socket.get_monitor_socket(_MONITOR_EVENTS))
            monitor.socket.setsockopt(zmq.LINGER, 0)
            for topic in topics:
                sub.socket.setsockopt(zmq.SUBSCRIBE, topic)
            sub.socket.connect(endpoint)
        except BaseException:
            _close(sub, monitor)
            raise
        return cls(endpoint, sub, monitor, limits, secure=curve is not None, reconnect_after=reconnect_after)

    async def run(self, on_message: OnMessage, on_rate_limited: Callable[[], None] = lambda: None) -> None:
        """Deliver the peer's messages within the limits until cancelled (``on_rate_limited`` is called for
        each message dropped for rate); closes the sockets on the way out."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch)
                await self._read(on_message, on_rate_limited)
        finally:
            _close(self._sub, self._monitor)

    def close(self) -> None:
        """For a link that was opened but never run."""
        _close(self._sub, self._monitor)

    # -- the reader ---------------------------------------------------------------------------------

    async def _read(self, on_message: OnMessage, on_rate_limited: Callable[[], None]) -> None:
        bucket = TokenBucket(self._limits.rate, self._limits.bucket_size, trio.current_time())
        while True:
            if self._reconnect_due:
                self._reconnect()
            with trio.CancelScope() as self._recv_scope:
                frames = await self._sub.recv_multipart()
            if self._recv_scope.cancelled_caught:
                continue
            self.stats.received += 1
            if not bucket.take(trio.current_time()):
                self.stats.rate_limited += 1
                on_rate_limited()
                if not self._rate_logged:
                    self._rate_logged = True
                    log.warning(
                        "replica peer %s sends more than %g messages/s: the excess is dropped (logged once)",
                        self.endpoint,
                        self._limits.rate,
                    )
                await trio.sleep(bucket.wait_time(trio.current_time()))
                continue
            await on_message(frames)

    def _reconnect(self) -> None:
        self._reconnect_due = False
        self.stats.reconnects += 1
        with contextlib.suppress(zmq.ZMQError):  # ENOENT: libzmq already forgot the connection
            self._sub.socket.disconnect(self.endpoint)
        try:
            self._sub.socket.connect(self.endpoint)
        except zmq.ZMQError as exc:  # accepted once, so unlikely; keep trying on the next pause
            log.warning("replica peer %s: reconnecting failed: %s", self.endpoint, exc)

    # -- the watcher --------------------------------------------------------------------------------

    async def _watch(self) -> None:
        """Track the connection; after a loss with no new handshake for a while, have the reader reconnect."""
        pause = self._reconnect_after
        down = False
        while True:
            with trio.move_on_after(pause if down else float("inf")) as waited:
                event = parse_monitor_message(await self._monitor.recv_multipart())
            if waited.cancelled_caught:  # still down: libzmq is not retrying (protocol error), so we do
                self._reconnect_due = True
                self._recv_scope.cancel()
                pause = min(pause * 2, RECONNECT_AFTER_MAX)
                continue
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.stats.connections += 1
                if self._outage_logged:
                    log.info("replica peer %s: connected again", self.endpoint)
                else:
                    log.info("replica peer %s: connected%s", self.endpoint, " (CURVE)" if self._secure else "")
                self._outage_logged = False
                self._rate_logged = False
                down, pause = False, self._reconnect_after
            elif kind == zmq.EVENT_DISCONNECTED or kind & _HANDSHAKE_FAILED:
                failed = kind != zmq.EVENT_DISCONNECTED
                if failed:
                    self.stats.handshake_failures += 1
                else:
                    self.stats.disconnects += 1
                self._report_outage(failed, kind)
                down = True
            elif kind == zmq.EVENT_MONITOR_STOPPED:
                return

    def _report_outage(self, handshake_failed: bool, kind: int) -> None:
        log.debug("replica peer %s: monitor event %s", self.endpoint, zmq.Event(kind).name)
        if self._outage_logged:
            return
        self._outage_logged = True
        if handshake_failed and self._secure:
            why = (
                "the CURVE handshake failed: check that its certificate in the peer keys directory is the key it "
                "runs with, that it runs with CURVE, and that it trusts our public key"
            )
        elif handshake_failed:
            why = "the handshake failed: is it a kvrouter or 1.6.1 replica PUB, without CURVE?"
        else:
            why = f"the connection was lost (peer gone, or it sent a frame over {self._limits.max_message_bytes} bytes)"
        log.warning("replica peer %s: %s; retrying (logged once until it connects)", self.endpoint, why)


def _close(sub: TrioZmqSocket, monitor: TrioZmqSocket | None) -> None:
    if monitor is not None:
        if not sub.closed:
            with contextlib.suppress(zmq.ZMQError):
                sub.socket.disable_monitor()
        monitor.close()
    sub.close()
