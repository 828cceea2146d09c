"""KvListener: the shell task that hears one worker rank's KV events over ZMQ (behaviour.md#kv-events).

Live traffic is ``[topic, seq (8 BE), payload]`` on a SUB socket. The listener keeps a watermark
(the last seq handed on) and repairs the stream before handing anything on:

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
* On every (re)connection the listener also asks for everything after its watermark (catch-up),
  so an idle publisher's earlier batches arrive without waiting for its next one. A PUB only starts
  sending to us once it has processed our subscription, which can be after the catch-up answered
  (libzmq's PUB looks at new subscribers at most about once per millisecond of sends): a batch
  published in that window is missed until the next live batch reveals the gap. Without a replay
  endpoint (or when the catch-up fails) a lost connection cannot be repaired, and if no batch
  follows, no gap ever shows the loss: such an outage is counted (``unrepaired_outages``) and shown
  in ``last_error`` instead of passing silently.

Publisher restarts. The wire carries no stream epoch, so a restart shows up only as the seq going
back. A PUB never re-sends a batch, and a connecting SUB keeps one inbound pipe across reconnects
(old backlog first, then the new connection's traffic), so after a (re)connection the first batch
that does not continue the watermark decides: at or below it, the publisher's counter restarted.
We treat as a new stream (1) seq 0 after any watermark >= 0, and (2) a seq <= last that is the first
batch heard after start (e.g. resumed at 100, the restarted publisher is at 3), or the first
non-contiguous batch after a disconnect seen by the socket monitor (contiguous ones may be the old
backlog still draining). Any other seq <= last is a stale duplicate, and so is every live batch up to
the last one a catch-up delivered: the old connection's backlog (libzmq keeps it across its own
reconnects) and what was sent while the catch-up ran come after the catch-up, not before it. A new stream resets the
watermark to -1 (so a first seq > 0 replays from 0 against the new publisher's buffer) and awaits
``on_restart`` first, where the consumer should drop what it knew about this rank (its GPU cache is
gone). Ambiguous and not handled: a restarted publisher that is already past our old watermark
when we reconnect looks like a gap, and its replay fills it.

Connection. The endpoint's host is resolved by us (actors/peers/endpoints.py), never by libzmq's
shared I/O thread; a name that does not resolve is reported in ``last_error`` and logged once, and
retried with backoff. libzmq reconnects a dropped connection by itself, except after a protocol
error: a frame over ``max_message_bytes`` (``MAX_KV_MESSAGE_BYTES``) or a failed handshake ends the
session for good, silently but for the monitor's ``DISCONNECTED``. So when no handshake follows a
disconnect within ``reconnect_after`` (doubling to ``RECONNECT_AFTER_MAX``), the listener resolves
the host again and reconnects itself -- once the old connection's backlog is drained, since
``disconnect`` discards it. That is why the monitor (two inproc PAIR sockets) stays: nothing else
reports a connection lost for good, a reconnection (catch-up, restart detection) or a handshake
failure. Budget: 3 zmq sockets and 4 descriptors per listener, plus a DEALER and 2 descriptors
while a replay runs (see actors/transport/socket_budget.py).

Hand-over in groups: batches go to ``on_batches`` as a list of ``(seq, payload)`` in stream order. What
is already queued on the socket when the listener looks (up to ``GROUP_MAX_BATCHES`` batches or
``GROUP_MAX_BYTES`` of payload) travels as one group, so a flood costs the consumer one hand-over per group
instead of per batch (KvIngest applies a group in runs bounded in blocks, one command and one journal record
each); a lone batch still goes at once, since the group is handed on before the listener waits for anything
(the socket, a replay reply, a restart's ``on_restart``). Between groups the listener yields to the scheduler,
so a flood read without waiting takes one group per scheduling round. ``each_batch`` adapts a consumer that
takes one batch at a time.

Backpressure: ``on_batches`` is awaited inline, so while the consumer is busy we stop reading; the SUB
pipe fills to RCVHWM, then the publisher's PUB drops, and we see a gap that replay repairs.

Logs (logger ``kvrouter.kv_listener``): state changes, connection problems, gaps, replays and lost
ranges, restarts at info or warning; one line per batch only at debug.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Final, Literal

import attrs
import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from kvrouter.actors.peers.endpoints import (
    ConnectTarget,
    EndpointError,
    Resolved,
    ResolveError,
    Resolver,
    parse_connect_endpoint,
    resolve,
)
from kvrouter.actors.transport.socket_budget import replay_limiter
from kvrouter.actors.transport.zmq_socket import TrioZmqSocket, open_socket

log = logging.getLogger("kvrouter.kv_listener")

END_SEQ: Final = 0xFFFF_FFFF_FFFF_FFFF
_END_MARKER: Final = END_SEQ.to_bytes(8, "big")  # only valid on replay streams; live, it would be a 2**64 gap

# Reconnect every 50 ms (+ zmq's random jitter of up to one interval), never backing off: a
# publisher that binds after registration, or restarts, is heard within ~100 ms. A refused
# connect to a local or LAN port costs next to nothing.
RECONNECT_IVL_MS: Final = 50
# TCP keepalive, not ZMTP heartbeats, notices a publisher host that vanished without a FIN (and so
# gets it reconnected): ~10 s of silence, then 3 unanswered probes 2 s apart. The peer's kernel
# answers the probes, so a busy service that stops reading (a full SUB pipe) is never taken for a
# dead link. ZMTP heartbeats were: libzmq cannot read the peer's PONG while the pipe is full, so
# any stall over the timeout (3 s) dropped a healthy connection with what was queued on it, and
# libzmq 4.3.5 then aborted the whole process (``Assertion failed: _input_stopped``, libzmq
# issue 3937) when the new connection's engine was told to resume input it never stopped.
TCP_KEEPALIVE_IDLE_S: Final = 10
TCP_KEEPALIVE_INTVL_S: Final = 2
TCP_KEEPALIVE_CNT: Final = 3
# Live batches queued in the SUB pipe while the consumer is busy. Overflow policy: block (we stop
# reading); the backlog then waits in the publisher's PUB pipe (vLLM's HWM is 100,000), and only
# past that does the PUB drop, leaving a gap that replay repairs. Kept small because this queue's
# memory is ours: at 1,000 per rank, 16 ranks of 64-block batches raised the service's RSS per
# indexed block from ~330 to ~440 bytes during a 1M-block ingest, and ingest was no faster.
# In bytes: at most LIVE_RCVHWM x MAX_KV_MESSAGE_BYTES per listener (batches are ~kB in practice).
LIVE_RCVHWM: Final = 100
# A group handed to ``on_batches`` holds at most this many batches and (but for a single batch) this much
# payload: what a flood queued is taken in a few large hand-overs, and the consumer's memory per group is bounded.
# 16 takes the per-batch cost of the hand-over down to a few percent for engines that publish small batches (one
# per engine step); reading 16 queued messages is ~0.1 ms, one listener's step in a scheduling round. 64 was no
# faster and raised the service's RSS per indexed block by ~15 B in the 1M-block ingest (more decoded at once).
GROUP_MAX_BATCHES: Final = 16
GROUP_MAX_BYTES: Final = 1024 * 1024
# Replies queued on the replay DEALER; same policy (the publisher's ROUTER waits or drops).
REPLAY_RCVHWM: Final = 1_000
# A replay stream that stays silent this long is abandoned as incomplete (per reply, not overall,
# so a long catch-up is fine as long as it keeps moving).
REPLAY_IDLE_TIMEOUT: Final = 1.0
# Largest frame accepted from a publisher (ZMQ_MAXMSGSIZE, live SUB and replay DEALER). A batch is
# one engine step, so it describes at most max_num_batched_tokens (<= max_model_len, ~1M tokens for
# long-context serving with chunked prefill off) and at most a rank's whole KV cache (~0.5-1M tokens
# on an 80 GB GPU). Encoded worst case (sha256 block hashes, one BlockStored per 16-token block,
# token ids above 65,535, every store paired with an eviction) is ~14 bytes per token: ~14 MB per
# 1M tokens. 32 MiB (~2.4M tokens) leaves twice that. A larger frame makes libzmq drop the
# connection before buffering it (a 1 GiB message used to take RSS to 2 GiB); the listener
# reconnects, and the batch is counted lost when its replay stalls on the same cap.
MAX_KV_MESSAGE_BYTES: Final = 32 * 1024 * 1024
# How long libzmq gets to reconnect by itself after a disconnect (it retries every ~50-100 ms)
# before the listener resolves the host again and reconnects itself; doubles while that fails. The
# same backoff paces retries of a name that does not resolve.
RECONNECT_AFTER: Final = 1.0
RECONNECT_AFTER_MAX: Final = 30.0

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

_HANDSHAKE_PROBLEM: Final = (
    "handshake failed: the peer closed the connection or is not a ZMQ PUB "
    "(is the endpoint the worker's KV-events socket, not e.g. its replay ROUTER?)"
)
_HANDSHAKE_AUTH_PROBLEM: Final = "handshake failed: the publisher requires authentication (CURVE/PLAIN), unsupported"
_REPLAYED: Final = {False: "", True: ", replayed"}
# What ``_take_in_order`` returns when the group is full (compared by identity: no message is this list).
_GROUP_FULL: Final[list[bytes]] = []

ListenerState = Literal["connecting", "active", "failed"]
OnBatch = Callable[[int, bytes], Awaitable[None]]
OnBatches = Callable[[list[tuple[int, bytes]]], Awaitable[None]]
OnRestart = Callable[[], Awaitable[None]]


@attrs.define
class ListenerStatus:
    """What ``GET /workers`` shows for one rank. Mutated only by the listener; read at any time
    (trio is single-threaded, so a read between awaits is consistent)."""

    endpoint: str
    replay_endpoint: str | None
    state: ListenerState = "connecting"
    last_seq: int | None = None  # the watermark: last seq delivered (or resumed from); None = none yet
    # The current connection problem (cleared once connected), else the last lost range.
    last_error: str | None = None
    batches: int = 0  # handed on, live and replayed
    replayed_batches: int = 0  # of which came from the replay endpoint
    gaps: int = 0  # times a seq jumped past last + 1 (each triggers one replay, if configured)
    lost_batches: int = 0  # seqs never delivered: no replay endpoint, or the replay came back short
    stale_dropped: int = 0
    malformed: int = 0  # live messages or replay replies with the wrong shape
    restarts: int = 0  # publisher restarts detected (watermark reset)
    disconnects: int = 0  # established connections lost (publisher gone, keepalive timeout, frame over the cap)
    # Outages (a lost connection, or the time before the first one) after which nothing could show
    # that no batch was missed: no replay endpoint to catch up from, or the catch-up failed. Batches
    # published then may be lost uncounted in lost_batches (a later batch reveals the gap, if one
    # comes); last_error says after which seq.
    unrepaired_outages: int = 0


class KvListener:
    """Listens to one worker rank's KV-event publisher and hands ordered, gap-repaired batches on."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        on_batches: OnBatches,
        *,
        topic: bytes = b"",
        resume_from: int | None = None,
        on_restart: OnRestart | None = None,
        replay_timeout: float = REPLAY_IDLE_TIMEOUT,
        catch_up_on_connect: bool = True,
        max_message_bytes: int = MAX_KV_MESSAGE_BYTES,
        reconnect_after: float = RECONNECT_AFTER,
        resolver: Resolver | None = None,
    ) -> None:
        self.status = ListenerStatus(endpoint=endpoint, replay_endpoint=replay_endpoint, last_seq=resume_from)
        self._on_batches = on_batches
        self._group: list[tuple[int, bytes]] = []  # batches taken in order, not yet handed on
        self._group_bytes = 0
        self._on_restart = on_restart
        self._topic = topic
        self._replay_timeout = replay_timeout
        self._max_message_bytes = max_message_bytes
        self._reconnect_after = reconnect_after
        self._resolver = resolver
        # While set, a seq <= last means the publisher restarted (see the module docstring).
        # "start": a new socket has no backlog, so the first batch settles it. "disconnect": the old
        # connection's backlog may still be draining, so the first batch that is not last + 1 does.
        self._restart_check: Literal["start", "disconnect"] | None = "start"
        # Set by the connection watcher on every (re)connection; the listen loop then replays
        # whatever the publisher buffered after our watermark.
        self._catch_up_on_connect = catch_up_on_connect
        self._catch_up_due = False
        # The last seq a catch-up delivered, while live batches up to it may still be queued in the
        # SUB pipe (sent before the catch-up answered): those are duplicates, not a restart.
        self._caught_up_through: int | None = None
        self._recv_scope = trio.CancelScope()
        # Connection bookkeeping shared by the three tasks (see ``run``); ``_changed`` wakes waiters.
        self._link_up = False
        self._ever_connected = False
        self._lost_link = False  # an established connection was lost, and no handshake since
        self._connect_to: Resolved | None = None  # asked for by the keeper, applied by the listen task
        self._connected_to: Resolved | None = None
        self._connection_problem: str | None = None  # shown in last_error and logged once
        self._changed = trio.Event()

    def resume_from(self, seq: int | None) -> None:
        """Continue after ``seq`` (a journaled watermark): the next expected batch is seq + 1.

        Call it before ``run`` or from the consumer's ``on_batches``; it only moves the watermark.
        """
        self.status.last_seq = seq

    async def run(self, *, task_status: trio.TaskStatus[ListenerStatus] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect and listen until cancelled. Started means the sockets exist and connecting has
        begun (resolving the host first, if it is a name); nothing has been heard yet.

        A malformed endpoint, or no zmq socket to be had (descriptors or ZMQ_MAX_SOCKETS exhausted),
        leaves ``state == "failed"`` with ``last_error`` and returns instead of raising: one
        misconfigured worker must not take the service down. Three tasks share the work: the listen
        task owns the SUB (and replay DEALERs), the watcher owns the monitor, and the keeper decides
        when to (re)connect and to which address.
        """
        try:
            target = parse_connect_endpoint(self.status.endpoint)
        except EndpointError as exc:
            self._fail(str(exc))
            task_status.started(self.status)
            return
        options: dict[int, int | bytes] = {
            zmq.SUBSCRIBE: self._topic,
            zmq.RECONNECT_IVL: RECONNECT_IVL_MS,
            zmq.RECONNECT_IVL_MAX: 0,  # 0 = no exponential backoff
            zmq.TCP_KEEPALIVE: 1,
            zmq.TCP_KEEPALIVE_IDLE: TCP_KEEPALIVE_IDLE_S,
            zmq.TCP_KEEPALIVE_INTVL: TCP_KEEPALIVE_INTVL_S,
            zmq.TCP_KEEPALIVE_CNT: TCP_KEEPALIVE_CNT,
            zmq.MAXMSGSIZE: self._max_message_bytes,
        }
        with contextlib.ExitStack() as stack:
            try:
                sub = stack.enter_context(open_socket(zmq.SUB, sndhwm=100, rcvhwm=LIVE_RCVHWM, options=options))
                monitor = TrioZmqSocket(sub.socket.get_monitor_socket(_MONITOR_EVENTS))
            except zmq.ZMQError as exc:
                self._fail(f"cannot open a zmq socket: {exc}")
                task_status.started(self.status)
                return
            stack.callback(monitor.close)
            stack.callback(sub.socket.disable_monitor)
            monitor.socket.setsockopt(zmq.LINGER, 0)
            log.info("kv listener %s: connecting", self.status.endpoint)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_connection, monitor)
                nursery.start_soon(self._keep_connected, target)
                task_status.started(self.status)
                await self._listen(sub)  # returns only once the listener failed for good
                nursery.cancel_scope.cancel()

    def _fail(self, error: str) -> None:
        log.error("kv listener %s: failed: %s", self.status.endpoint, error)
        self.status.state = "failed"
        self.status.last_error = error

    # -- connection: the keeper and the watcher ------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _wait_until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            await self._changed.wait()

    def _report_connection_problem(self, problem: str, level: int = logging.WARNING) -> None:
        """Show ``problem`` in last_error; log it only when it differs from the one already shown."""
        if problem != self._connection_problem:
            log.log(level, "kv listener %s: %s", self.status.endpoint, problem)
        self._connection_problem = problem
        self.status.last_error = problem

    def _clear_connection_problem(self) -> None:
        if self._connection_problem is not None and self.status.last_error == self._connection_problem:
            self.status.last_error = None
        self._connection_problem = None

    async def _keep_connected(self, target: ConnectTarget) -> None:
        """Resolve and connect; whenever no handshake follows within the backoff, do it again."""
        backoff = self._reconnect_after
        while True:
            resolved = await self._resolve(target)
            # Hand the address to the listen task, unless libzmq reconnected by itself meanwhile.
            self._connect_to = resolved
            self._recv_scope.cancel()
            await self._wait_until(lambda: self._connect_to is None or self._link_up)
            self._connect_to = None
            with trio.move_on_after(backoff):
                await self._wait_until(lambda: self._link_up)
            while self._link_up:
                backoff = self._reconnect_after
                await self._wait_until(lambda: not self._link_up)
                with trio.move_on_after(backoff):
                    await self._wait_until(lambda: self._link_up)
            # Texts stay the same from one retry to the next, so each is logged once per outage.
            if self._connection_problem is not None:
                pass  # a more specific one (handshake failed, name does not resolve) stays shown
            elif self._ever_connected:
                self._report_connection_problem(
                    "connection lost and not back; reconnecting (publisher down, or libzmq gave up after a "
                    f"protocol error such as a frame over {_size(self._max_message_bytes)})"
                )
            else:
                self._report_connection_problem(
                    "no connection yet (publisher not running?); retrying", level=logging.INFO
                )
            log.debug("kv listener %s: reconnecting (no handshake within %gs)", self.status.endpoint, backoff)
            backoff = min(backoff * 2, RECONNECT_AFTER_MAX)

    async def _resolve(self, target: ConnectTarget) -> Resolved:
        """The address to connect to; retries (with backoff) while the name does not resolve."""
        backoff = self._reconnect_after
        while True:
            try:
                resolved = await resolve(target, self._resolver)
            except ResolveError as exc:
                self._report_connection_problem(f"{exc} (retrying)")
            else:
                if self._connection_problem is not None and self._connection_problem.startswith("cannot resolve"):
                    log.info("kv listener %s: host resolves now, to %s", self.status.endpoint, resolved.endpoint)
                    self._clear_connection_problem()
                return resolved
            await trio.sleep(backoff)
            backoff = min(backoff * 2, RECONNECT_AFTER_MAX)

    async def _watch_connection(self, monitor: TrioZmqSocket) -> None:
        """Owns the monitor socket: turns connection events into ``state`` and restart detection."""
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                reconnected, self._lost_link = self._lost_link, False
                self._link_up = self._ever_connected = True
                self._notify()
                self.status.state = "active"
                self._clear_connection_problem()
                via = self._connected_to.endpoint if self._connected_to is not None else self.status.endpoint
                suffix = "" if via == self.status.endpoint else f" to {via}"
                log.info("kv listener %s: active (connected%s)", self.status.endpoint, suffix)
                if self.status.replay_endpoint is not None and self._catch_up_on_connect:
                    # Batches published before this connection never reach the SUB: ask for them
                    # now instead of waiting for the next live batch to reveal the gap.
                    self._catch_up_due = True
                    self._recv_scope.cancel()
                elif reconnected:
                    why = "no replay endpoint" if self.status.replay_endpoint is None else "catch-up on connect is off"
                    self._unrepaired(f"reconnected, but cannot catch up ({why})")
            elif kind == zmq.EVENT_DISCONNECTED:
                if self._link_up:
                    self._link_up = False
                    self._notify()
                    self.status.disconnects += 1
                    self._lost_link = True
                    self.status.state = "connecting"
                    self._restart_check = "disconnect"
                    log.warning("kv listener %s: connecting (connection lost)", self.status.endpoint)
                else:
                    # Closed before the handshake completed: e.g. a ROUTER or REP at this port (libzmq
                    # does not retry that; the keeper will).
                    self._report_connection_problem(_HANDSHAKE_PROBLEM)
            elif kind & _HANDSHAKE_FAILED:
                # One text whatever the event: the same peer fails as NO_DETAIL (EPIPE, ECONNRESET) or
                # as a bare DISCONNECTED depending on timing, and the operator should read it once.
                log.debug("kv listener %s: %s, value %d", self.status.endpoint, zmq.Event(kind).name, event["value"])
                auth = kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH
                self._report_connection_problem(_HANDSHAKE_AUTH_PROBLEM if auth else _HANDSHAKE_PROBLEM)
            elif kind == zmq.EVENT_MONITOR_STOPPED:
                return

    def _connect(self, sub: TrioZmqSocket, resolved: Resolved) -> bool:
        """Point the SUB at ``resolved`` (dropping the previous connection); False if zmq refuses."""
        try:
            if self._connected_to is not None:
                with contextlib.suppress(zmq.ZMQError):  # ENOENT: libzmq already forgot it
                    sub.socket.disconnect(self._connected_to.endpoint)
            if resolved.ipv6:
                sub.socket.setsockopt(zmq.IPV6, 1)
            sub.socket.connect(resolved.endpoint)
        except zmq.ZMQError as exc:
            self._fail(f"cannot connect to {resolved.endpoint}: {exc}")
            return False
        log.debug("kv listener %s: connect(%s)", self.status.endpoint, resolved.endpoint)
        self._connected_to = resolved
        self._connect_to = None
        self._notify()
        return True

    # -- the stream: live batches, replays, restarts -------------------------------------------

    async def _listen(self, sub: TrioZmqSocket) -> None:
        """Owns the SUB socket (and, while a replay runs, a DEALER): strictly one batch at a time."""
        while True:
            # A (re)connection waits until the old connection's backlog is read: disconnect drops it.
            pending = self._connect_to
            if pending is not None and not sub.events() & zmq.POLLIN and not self._connect(sub, pending):
                return
            if self._catch_up_due:
                self._catch_up_due = False
                last = -1 if self.status.last_seq is None else self.status.last_seq
                await self._fill_gap(last + 1, None)
            frames = self._take_in_order(sub)
            if frames is _GROUP_FULL:
                await self._hand_on()
                continue
            if frames is None:
                if self._group:
                    # Nothing queued: hand on what was taken before waiting for more, then look at the
                    # connection and catch-up requests again (they may have come while the consumer ran).
                    await self._hand_on()
                    continue
                self._recv_scope = trio.CancelScope()
                with self._recv_scope:
                    frames = await sub.recv_multipart()
                if frames is None:
                    continue  # woken for a catch-up or a (re)connection
            if len(frames) != 3 or len(frames[1]) != 8 or frames[1] == _END_MARKER:
                self.status.malformed += 1
                log.debug("kv listener %s: ignored a %d-frame message", self.status.endpoint, len(frames))
                continue
            await self._accept_live(int.from_bytes(frames[1], "big"), frames[2])

    def _take_in_order(self, sub: TrioZmqSocket) -> list[bytes] | None:
        """Take the queued live batches that continue the watermark into the group, without awaiting.

        The common case of ``_accept_live`` and ``_deliver`` in one loop (a flood is read here): a batch
        that is ``last + 1`` is taken as ``_deliver`` would take it. Returns ``_GROUP_FULL`` once the group
        is full (the caller hands it on), None once nothing is queued, else the first message that needs
        the general path (malformed, out of order), unread by this loop.
        """
        status = self.status
        group = self._group
        last = -1 if status.last_seq is None else status.last_seq
        taken = 0
        group_bytes = self._group_bytes
        debug = log.isEnabledFor(logging.DEBUG)
        frames = None
        try:
            while len(group) < GROUP_MAX_BATCHES and group_bytes < GROUP_MAX_BYTES:
                frames = sub.try_recv_multipart()
                if frames is None or len(frames) != 3:
                    return frames
                _topic, seq_bytes, payload = frames
                if len(seq_bytes) != 8 or int.from_bytes(seq_bytes, "big") != last + 1:
                    return frames  # (the end marker is never last + 1: it would be a 2**64 gap)
                last += 1
                if debug:
                    log.debug("kv listener %s: batch %d, %d bytes", status.endpoint, last, len(payload))
                group.append((last, payload))
                group_bytes += len(payload)
                taken += 1
            return _GROUP_FULL
        finally:
            if taken:
                if self._restart_check == "start":
                    self._restart_check = None
                status.last_seq = last
                status.batches += taken
                self._group_bytes = group_bytes

    async def _accept_live(self, seq: int, payload: bytes) -> None:
        status = self.status
        last = -1 if status.last_seq is None else status.last_seq
        if seq == last + 1:  # the common case
            if self._restart_check == "start":
                self._restart_check = None
            await self._deliver(seq, payload, replayed=False)
            return
        if self._caught_up_through is not None:
            if seq <= min(last, self._caught_up_through):
                status.stale_dropped += 1
                log.debug("kv listener %s: batch %d already caught up, dropped", status.endpoint, seq)
                return
            self._caught_up_through = None
        check, self._restart_check = self._restart_check, None
        if seq <= last and (seq == 0 or check is not None):
            log.warning(
                "kv listener %s: publisher restarted (seq %d after %d); dropping what it published before",
                status.endpoint,
                seq,
                last,
            )
            status.restarts += 1
            await self._hand_on()  # the old stream's batches go first, then the restart
            status.last_seq, last = None, -1
            if self._on_restart is not None:
                await self._on_restart()
        if seq <= last:
            status.stale_dropped += 1
            log.debug("kv listener %s: stale batch %d (watermark %d) dropped", status.endpoint, seq, last)
            return
        if seq > last + 1:
            status.gaps += 1
            await self._fill_gap(last + 1, seq)
        await self._deliver(seq, payload, replayed=False)

    async def _deliver(self, seq: int, payload: bytes, *, replayed: bool) -> None:
        """Take the batch into the group (the watermark moves now); hand the group on once it is full."""
        log.debug("kv listener %s: batch %d, %d bytes%s", self.status.endpoint, seq, len(payload), _REPLAYED[replayed])
        self._group.append((seq, payload))
        self._group_bytes += len(payload)
        status = self.status
        status.last_seq = seq
        status.batches += 1
        if replayed:
            status.replayed_batches += 1
        if len(self._group) >= GROUP_MAX_BATCHES or self._group_bytes >= GROUP_MAX_BYTES:
            await self._hand_on()

    async def _hand_on(self) -> None:
        """Give the consumer the batches taken so far, in order (nothing when there are none)."""
        if self._group:
            group, self._group, self._group_bytes = self._group, [], 0
            await self._on_batches(group)
            await trio.lowlevel.checkpoint()  # a flood read without waiting must still let other tasks run

    async def _fill_gap(self, start: int, end: int | None) -> None:
        """Deliver what the replay endpoint has of ``[start, end)``; count and log the rest as lost.

        ``end=None`` is a catch-up after a (re)connection: take everything buffered from ``start``
        until the end marker; nothing is known to be missing, so nothing is counted as lost.
        """
        await self._hand_on()  # what came before the gap need not wait for the replay
        replay_endpoint = self.status.replay_endpoint
        wanted = f"{start}.." if end is None else f"{start}..{end - 1}"
        if replay_endpoint is None:
            if end is not None:
                self._lost(start, end, "no replay endpoint")
            return
        if end is None:
            log.info(
                "kv listener %s: catching up after seq %d from %s", self.status.endpoint, start - 1, replay_endpoint
            )
        else:
            log.info("kv listener %s: gap, replaying %s from %s", self.status.endpoint, wanted, replay_endpoint)
        try:
            resolved = await resolve(parse_connect_endpoint(replay_endpoint), self._resolver)
        except (EndpointError, ResolveError) as exc:
            if end is not None:
                self._lost(start, end, f"replay endpoint: {exc}")
            else:
                self._unrepaired(f"catch-up failed (replay endpoint: {exc})")
            return
        next_seq, problem = start, None
        async with replay_limiter():
            try:
                dealer = open_socket(
                    zmq.DEALER,
                    sndhwm=16,
                    rcvhwm=REPLAY_RCVHWM,
                    options={zmq.MAXMSGSIZE: self._max_message_bytes, zmq.IPV6: int(resolved.ipv6)},
                )
            except zmq.ZMQError as exc:
                if end is not None:
                    self._lost(start, end, f"cannot open a zmq socket for the replay: {exc}")
                return
            with dealer:
                try:
                    dealer.socket.connect(resolved.endpoint)
                except zmq.ZMQError as exc:
                    if end is not None:
                        self._lost(start, end, f"cannot connect to {replay_endpoint}: {exc}")
                    return
                next_seq, problem = await self._receive_replay(dealer, start, end)
            # Leaving the block closed the DEALER (linger 0): replies past ``end`` are simply dropped,
            # since the live socket is delivering those.
        if end is None:
            self._caught_up_through = next_seq - 1 if next_seq > start else None
        if end is not None and next_seq < end:
            self._lost(next_seq, end, f"replay incomplete ({problem or 'ended early'})")
        elif next_seq > start:
            log.info("kv listener %s: replayed %d..%d", self.status.endpoint, start, next_seq - 1)
        elif problem is not None:
            self._unrepaired(f"catch-up failed ({problem})")
        else:
            log.info("kv listener %s: caught up, nothing was missed", self.status.endpoint)

    async def _receive_replay(self, dealer: TrioZmqSocket, start: int, end: int | None) -> tuple[int, str | None]:
        """Ask the replay socket for batches from ``start`` and deliver them until ``end`` (or its end marker):
        the next sequence not delivered, and why the replay stopped short (None when it did not)."""
        next_seq, problem = start, None
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while end is None or next_seq < end:
            frames: list[bytes] | None = dealer.try_recv_multipart()
            if frames is None:
                await self._hand_on()  # before waiting for the next reply
                with trio.move_on_after(self._replay_timeout):
                    frames = await dealer.recv_multipart()
            if frames is None:
                problem = (
                    f"timed out: no reply for {self._replay_timeout}s; publisher gone, or a reply over "
                    f"{_size(self._max_message_bytes)}"
                )
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
        return next_seq, problem

    def _unrepaired(self, why: str) -> None:
        """Batches may have been missed and nothing can say how many: count it and show it."""
        last = self.status.last_seq
        self.status.unrepaired_outages += 1
        after = "" if last is None else f" after seq {last}"
        self.status.last_error = (
            f"{why}: batches published{after} while not connected may be lost; "
            "a later batch shows how many (counted in lost_batches)"
        )
        log.warning("kv listener %s: %s", self.status.endpoint, self.status.last_error)

    def _lost(self, start: int, end: int, why: str) -> None:
        self.status.lost_batches += end - start
        self.status.last_error = f"batches {start}..{end - 1} lost: {why}"
        log.warning("kv listener %s: %s", self.status.endpoint, self.status.last_error)


def _size(limit: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if limit % (1 << shift) == 0:
            return f"{limit >> shift} {unit}"
    return f"{limit} bytes"


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


def each_batch(on_batch: OnBatch) -> OnBatches:
    """An ``on_batches`` for a consumer that takes one batch at a time: awaits it for each batch of a group."""

    async def on_batches(group: list[tuple[int, bytes]]) -> None:
        for seq, payload in group:
            await on_batch(seq, payload)

    return on_batches
