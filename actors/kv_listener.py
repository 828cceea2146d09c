"""KvListener: the shell task that hears one worker rank's KV events over ZMQ (spec §4).

Live traffic is ``[topic, seq (8 BE), payload]`` on a SUB socket. The listener keeps a watermark
(the last seq handed to ``on_batch``) and repairs the stream before handing anything on:

* ``seq == last + 1``: deliver.
* ``seq <= last``: stale duplicate, skip (counted) -- unless the publisher restarted, see below.
* ``seq > last + 1``: a gap. Ask the replay endpoint for ``[last + 1, seq)`` (DEALER to the
  publisher's ROUTER, ``[b"", start (8 BE)]``; 3- or 4-frame replies; end marker seq 2**64-1 with an
  empty payload), deliver what comes back in order, then deliver the live batch. An incomplete
  replay (timeout, evicted start, holes, early end) is logged and counted, not fatal: zmq is a
  transport, and the indexer tolerates a missed batch better than a stalled worker.
* Nothing heard yet counts as ``last = -1``, so the first batch with seq > 0 replays from 0: that is
  how batches published before we connected (a late listener, or a publisher that bound after
  registration) are recovered. ``resume_from(seq)`` sets the watermark from a journal instead.

Publisher restarts. The wire carries no stream epoch, so a restart shows up only as the seq going
back. A PUB never re-sends a batch, and a connecting SUB keeps one inbound pipe across reconnects
(old backlog first, then the new connection's traffic), so after a (re)connection the first batch
that does not continue the watermark decides: at or below it, the publisher's counter restarted.
We treat as a new stream (1) seq 0 after any watermark >= 0, and (2) a seq <= last that is the first
batch heard after start (e.g. resumed at 100, the restarted publisher is at 3), or the first
non-contiguous batch after a disconnect seen by the socket monitor (contiguous ones may be the old
backlog still draining). Any other seq <= last is a stale duplicate. A new stream resets the
watermark to -1 (so a first seq > 0 replays from 0 against the new publisher's buffer) and awaits
``on_restart`` first, where the consumer should drop what it knew about this rank (its GPU cache is
gone). Ambiguous and not handled: a restarted publisher that is already past our old watermark
when we reconnect looks like a gap, and its replay fills it.

Backpressure: ``on_batch`` is awaited inline, so while the consumer is busy we stop reading; the SUB
pipe fills to RCVHWM, then the publisher's PUB drops, and we see a gap that replay repairs.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Final, Literal

import attrs
import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from kvrouter.actors.peers.zmq_socket import TrioZmqSocket, open_socket

log = logging.getLogger("kvrouter.kv_listener")

END_SEQ: Final = 0xFFFF_FFFF_FFFF_FFFF
_END_MARKER: Final = END_SEQ.to_bytes(8, "big")  # only valid on replay streams; live, it would be a 2**64 gap

# Reconnect every 50 ms (+ zmq's random jitter of up to one interval), never backing off: a
# publisher that binds after registration, or restarts, is heard within ~100 ms. A refused
# connect to a local or LAN port costs next to nothing.
RECONNECT_IVL_MS: Final = 50
# ZMTP heartbeats so a publisher host that vanished without a FIN is noticed (and reconnected to)
# within seconds instead of never. Side effect: a consumer stalled for longer than the timeout with
# a full SUB pipe also gets disconnected; the pipe's backlog survives, and the gap is replayed.
HEARTBEAT_IVL_MS: Final = 1_000
HEARTBEAT_TIMEOUT_MS: Final = 3_000
# Live batches queued in the SUB pipe while the consumer is busy. Overflow policy: block (we stop
# reading); the backlog then waits in the publisher's PUB pipe (vLLM's HWM is 100,000), and only
# past that does the PUB drop, leaving a gap that replay repairs. Kept small because this queue's
# memory is ours: at 1,000 per rank, 16 ranks of 64-block batches raised the service's RSS per
# indexed block from ~330 to ~440 bytes during a 1M-block ingest, and ingest was no faster.
LIVE_RCVHWM: Final = 100
# Replies queued on the replay DEALER; same policy (the publisher's ROUTER waits or drops).
REPLAY_RCVHWM: Final = 1_000
# A replay stream that stays silent this long is abandoned as incomplete (per reply, not overall,
# so a long catch-up is fine as long as it keeps moving).
REPLAY_IDLE_TIMEOUT: Final = 1.0

_MONITOR_EVENTS: Final = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_MONITOR_STOPPED
)
_HANDSHAKE_FAILED: Final = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)

ListenerState = Literal["connecting", "active", "failed"]
OnBatch = Callable[[int, bytes], Awaitable[None]]
OnRestart = Callable[[], Awaitable[None]]


@attrs.define
class ListenerStatus:
    """What ``GET /workers`` shows for one rank. Mutated only by the listener; read at any time
    (trio is single-threaded, so a read between awaits is consistent)."""

    endpoint: str
    replay_endpoint: str | None
    state: ListenerState = "connecting"
    last_seq: int | None = None  # the watermark: last seq delivered (or resumed from); None = none yet
    last_error: str | None = None
    batches: int = 0  # delivered to on_batch, live and replayed
    replayed_batches: int = 0  # of which came from the replay endpoint
    gaps: int = 0  # times a seq jumped past last + 1 (each triggers one replay, if configured)
    lost_batches: int = 0  # seqs never delivered: no replay endpoint, or the replay came back short
    stale_dropped: int = 0
    malformed: int = 0  # live messages or replay replies with the wrong shape
    restarts: int = 0  # publisher restarts detected (watermark reset)


class KvListener:
    """Listens to one worker rank's KV-event publisher and hands ordered, gap-repaired batches on."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        on_batch: OnBatch,
        *,
        topic: bytes = b"",
        resume_from: int | None = None,
        on_restart: OnRestart | None = None,
        replay_timeout: float = REPLAY_IDLE_TIMEOUT,
        catch_up_on_connect: bool = True,
    ) -> None:
        self.status = ListenerStatus(endpoint=endpoint, replay_endpoint=replay_endpoint, last_seq=resume_from)
        self._on_batch = on_batch
        self._on_restart = on_restart
        self._topic = topic
        self._replay_timeout = replay_timeout
        # While set, a seq <= last means the publisher restarted (see the module docstring).
        # "start": a new socket has no backlog, so the first batch settles it. "disconnect": the old
        # connection's backlog may still be draining, so the first batch that is not last + 1 does.
        self._restart_check: Literal["start", "disconnect"] | None = "start"
        # Set by the connection watcher on every (re)connection; the listen loop then replays
        # whatever the publisher buffered after our watermark.
        self._catch_up_on_connect = catch_up_on_connect
        self._catch_up_due = False
        self._recv_scope = trio.CancelScope()

    def resume_from(self, seq: int | None) -> None:
        """Continue after ``seq`` (a journaled watermark): the next expected batch is seq + 1.

        Call it before ``run`` or from the consumer between batches; it only moves the watermark.
        """
        self.status.last_seq = seq

    async def run(self, *, task_status: trio.TaskStatus[ListenerStatus] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect and listen until cancelled. Started means the SUB is connecting (not yet heard).

        A bad endpoint leaves ``state == "failed"`` with ``last_error`` and returns instead of raising:
        one misconfigured worker must not take the service down.
        """
        options: dict[int, int | bytes] = {
            zmq.SUBSCRIBE: self._topic,
            zmq.RECONNECT_IVL: RECONNECT_IVL_MS,
            zmq.RECONNECT_IVL_MAX: 0,  # 0 = no exponential backoff
            zmq.HEARTBEAT_IVL: HEARTBEAT_IVL_MS,
            zmq.HEARTBEAT_TIMEOUT: HEARTBEAT_TIMEOUT_MS,
        }
        with open_socket(zmq.SUB, sndhwm=100, rcvhwm=LIVE_RCVHWM, options=options) as sub:
            monitor = TrioZmqSocket(sub.socket.get_monitor_socket(_MONITOR_EVENTS))
            try:
                monitor.socket.setsockopt(zmq.LINGER, 0)
                try:
                    sub.socket.connect(self.status.endpoint)
                except zmq.ZMQError as exc:
                    self._fail(f"cannot connect to {self.status.endpoint}: {exc}")
                    task_status.started(self.status)
                    return
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._watch_connection, monitor)
                    task_status.started(self.status)
                    await self._listen(sub)
            finally:
                sub.socket.disable_monitor()
                monitor.close()

    def _fail(self, error: str) -> None:
        log.error("kv listener %s: %s", self.status.endpoint, error)
        self.status.state = "failed"
        self.status.last_error = error

    async def _watch_connection(self, monitor: TrioZmqSocket) -> None:
        """Owns the monitor socket: turns connection events into ``state`` and restart detection."""
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.status.state = "active"
                log.info("kv listener %s: connected", self.status.endpoint)
                if self.status.replay_endpoint is not None and self._catch_up_on_connect:
                    # Batches published before this connection never reach the SUB: ask for them
                    # now instead of waiting for the next live batch to reveal the gap.
                    self._catch_up_due = True
                    self._recv_scope.cancel()
            elif kind == zmq.EVENT_DISCONNECTED:
                self.status.state = "connecting"
                self._restart_check = "disconnect"
                log.warning("kv listener %s: disconnected, reconnecting", self.status.endpoint)
            elif kind & _HANDSHAKE_FAILED:
                self.status.last_error = f"handshake failed ({kind:#x}, errno {event['value']})"
                log.warning("kv listener %s: %s", self.status.endpoint, self.status.last_error)
            elif kind == zmq.EVENT_MONITOR_STOPPED:
                return

    async def _listen(self, sub: TrioZmqSocket) -> None:
        """Owns the SUB socket (and, while a replay runs, a DEALER): strictly one batch at a time."""
        while True:
            if self._catch_up_due:
                self._catch_up_due = False
                last = -1 if self.status.last_seq is None else self.status.last_seq
                await self._fill_gap(last + 1, None)
            self._recv_scope = trio.CancelScope()
            frames = None
            with self._recv_scope:
                frames = await sub.recv_multipart()
            if frames is None:
                continue  # woken for a catch-up
            if len(frames) != 3 or len(frames[1]) != 8 or frames[1] == _END_MARKER:
                self.status.malformed += 1
                log.debug("kv listener %s: ignored a %d-frame message", self.status.endpoint, len(frames))
                continue
            await self._accept_live(int.from_bytes(frames[1], "big"), frames[2])

    async def _accept_live(self, seq: int, payload: bytes) -> None:
        status = self.status
        last = -1 if status.last_seq is None else status.last_seq
        if seq == last + 1:  # the common case
            if self._restart_check == "start":
                self._restart_check = None
            await self._deliver(seq, payload, replayed=False)
            return
        check, self._restart_check = self._restart_check, None
        if seq <= last and (seq == 0 or check is not None):
            log.warning("kv listener %s: publisher restarted (seq %d after %d)", status.endpoint, seq, last)
            status.restarts += 1
            status.last_seq, last = None, -1
            if self._on_restart is not None:
                await self._on_restart()
        if seq <= last:
            status.stale_dropped += 1
            return
        if seq > last + 1:
            status.gaps += 1
            await self._fill_gap(last + 1, seq)
        await self._deliver(seq, payload, replayed=False)

    async def _deliver(self, seq: int, payload: bytes, *, replayed: bool) -> None:
        await self._on_batch(seq, payload)
        self.status.last_seq = seq
        self.status.batches += 1
        if replayed:
            self.status.replayed_batches += 1

    async def _fill_gap(self, start: int, end: int | None) -> None:
        """Deliver what the replay endpoint has of ``[start, end)``; count and log the rest as lost.

        ``end=None`` is a catch-up after a (re)connection: take everything buffered from ``start``
        until the end marker; nothing is known to be missing, so nothing is counted as lost.
        """
        replay_endpoint = self.status.replay_endpoint
        if replay_endpoint is None:
            if end is not None:
                self._lost(start, end, "no replay endpoint")
            return
        next_seq, problem = start, "ended early"
        with open_socket(zmq.DEALER, sndhwm=16, rcvhwm=REPLAY_RCVHWM) as dealer:
            try:
                dealer.socket.connect(replay_endpoint)
            except zmq.ZMQError as exc:
                if end is not None:
                    self._lost(start, end, f"cannot connect to {replay_endpoint}: {exc}")
                return
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while end is None or next_seq < end:
                frames: list[bytes] | None = None
                with trio.move_on_after(self._replay_timeout):
                    frames = await dealer.recv_multipart()
                if frames is None:
                    problem = f"timed out after {self._replay_timeout}s"
                    break
                reply = _parse_reply(frames)
                if reply is None:
                    self.status.malformed += 1
                    continue
                seq, payload = reply
                if seq == END_SEQ or not payload:
                    break
                if seq < next_seq:
                    continue  # before what we asked for: nothing to do with it
                if end is not None and seq >= end:
                    problem = f"buffer jumped to {seq}"
                    break
                if seq > next_seq:
                    if end is None and next_seq == start and start > 0:
                        # The publisher's buffer starts after our watermark (or it restarted): the
                        # live stream settles which, as for any first batch.
                        break
                    self._lost(next_seq, seq, "replay not contiguous")
                await self._deliver(seq, payload, replayed=True)
                next_seq = seq + 1
        # Leaving the block closed the DEALER (linger 0): replies past ``end`` are simply dropped,
        # since the live socket is delivering those.
        if end is not None and next_seq < end:
            self._lost(next_seq, end, f"replay incomplete ({problem})")

    def _lost(self, start: int, end: int, why: str) -> None:
        self.status.lost_batches += end - start
        self.status.last_error = f"batches {start}..{end - 1} lost: {why}"
        log.warning("kv listener %s: %s", self.status.endpoint, self.status.last_error)


def _parse_reply(frames: list[bytes]) -> tuple[int, bytes] | None:
    """``[b"", seq, payload]`` or ``[b"", topic, seq, payload]`` -> (seq, payload); else None."""
    if len(frames) == 3:
        delimiter, seq, payload = frames
    elif len(frames) == 4:
        delimiter, _topic, seq, payload = frames
    else:
        return None
    if delimiter != b"" or len(seq) != 8:
        return None
    return int.from_bytes(seq, "big"), payload
