"""A stand-in for a vLLM/SGLang KV-event publisher (``ZmqEventPublisher``), for listener tests.

Wire (behaviour.md#kv-events): live messages are ``[topic, seq (8 bytes BE), payload]`` on a PUB-compatible socket;
seq starts at 0 and grows by one per batch. An optional replay ROUTER answers ``[identity, b"",
start (8 BE)]`` with one reply per buffered batch whose seq >= start, either 3-frame ``[b"", seq,
payload]`` (SGLang, older vLLM) or 4-frame ``[b"", topic, seq, payload]`` (newer vLLM), then an end
marker with seq 0xFFFF_FFFF_FFFF_FFFF and an empty payload.

Test knobs a real engine does not have: ``drop_live`` seqs are buffered (replayable) but never sent
live, which makes gaps on demand; ``publish`` works before anyone subscribed (or even before the
socket is bound), so those batches are recoverable only by replay; ``resend`` and ``send_live_raw``
produce stale and malformed traffic.

The live socket is an XPUB rather than a PUB: identical on the wire for SUB peers, but it reports
subscriptions, so ``wait_for_subscribers`` replaces sleep-and-hope around the slow-joiner problem.
Use ``publish``/``wait_for_subscribers`` from one task (the XPUB's single owner); the replay ROUTER
is owned by the ``run`` task.
"""

from __future__ import annotations

import socket
from collections import deque
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal

import msgpack
import trio
import zmq

from kvrouter.actors.transport.zmq_socket import TrioZmqSocket, open_socket

END_SEQ = 0xFFFF_FFFF_FFFF_FFFF

# vLLM's publisher HWM. Live sends beyond it are dropped by zmq (PUB semantics), as in production.
PUBLISHER_HWM = 100_000


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago, for tests that must know the address before binding."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port


def sample_payload(seq: int, *, block_size: int = 4) -> bytes:
    """A msgpack batch ``[ts, [BlockStored...], dp_rank]`` whose content identifies ``seq``."""
    tokens = list(range(seq * block_size, (seq + 1) * block_size))
    event: list[Any] = ["BlockStored", [seq + 1], seq or None, tokens, block_size, None, None]
    return msgpack.packb([1_700_000_000.0 + seq, [event], None])


def _u64(value: int) -> bytes:
    return value.to_bytes(8, "big")


class KvPublisher:
    """One worker rank's KV-event publisher: live XPUB, ring buffer, optional replay ROUTER."""

    def __init__(
        self,
        *,
        port: int | None = None,
        replay: bool = True,
        replay_port: int | None = None,
        topic: bytes = b"",
        reply_frames: Literal[3, 4] = 3,
        buffer_steps: int = 10_000,
        drop_live: Iterable[int] = (),
        answer_replays: bool = True,
        host: str = "127.0.0.1",
    ) -> None:
        self.host = host
        self.port = port
        self.replay = replay
        self.replay_port = replay_port
        self.topic = topic
        self.reply_frames = reply_frames
        self.drop_live = set(drop_live)
        self.answer_replays = answer_replays
        self.next_seq = 0
        # The replay ring, as vLLM's ``buffer_steps``: the oldest batches fall off silently.
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._pub: TrioZmqSocket | None = None
        self.live_sent: list[int] = []  # seqs actually sent live, in order
        self.replay_requests: list[int] = []  # start seq of every replay request received
        self.subscriptions_seen = 0

    @property
    def endpoint(self) -> str:
        assert self.port is not None, "not bound yet"
        return f"tcp://{self.host}:{self.port}"

    @property
    def replay_endpoint(self) -> str | None:
        if not self.replay:
            return None
        assert self.replay_port is not None, "not bound yet"
        return f"tcp://{self.host}:{self.replay_port}"

    async def run(self, *, task_status: trio.TaskStatus[KvPublisher] = trio.TASK_STATUS_IGNORED) -> None:
        """Bind (replay ROUTER first, so a listener hearing live traffic can always ask), then serve
        replay requests until cancelled. Sockets close on the way out, like a process exiting."""
        pub = open_socket(zmq.XPUB, sndhwm=PUBLISHER_HWM, rcvhwm=1000, options={zmq.XPUB_VERBOSE: 1})
        # ROUTER_MANDATORY: at HWM wait instead of silently dropping replies; a vanished requester
        # raises EHOSTUNREACH and ends that reply stream.
        router = open_socket(zmq.ROUTER, sndhwm=PUBLISHER_HWM, rcvhwm=100, options={zmq.ROUTER_MANDATORY: 1})
        with pub, router:
            if self.replay:
                self.replay_port = await _bind(router, self.host, self.replay_port)
            self.port = await _bind(pub, self.host, self.port)
            self._pub = pub
            try:
                task_status.started(self)
                if self.replay:
                    await self._serve_replay(router)
                else:
                    await trio.sleep_forever()
            finally:
                self._pub = None

    def publish(self, payload: bytes, *, live: bool = True) -> int:
        """Assign the next seq, buffer the batch for replay, and send it live unless told not to."""
        seq = self.next_seq
        self.next_seq += 1
        self._buffer.append((seq, payload))
        if live and seq not in self.drop_live and self._pub is not None:
            self.send_live_raw([self.topic, _u64(seq), payload])
            self.live_sent.append(seq)
        return seq

    def resend(self, seq: int) -> None:
        """Send an already-buffered batch live again: a stale duplicate for the listener."""
        payload = next(p for s, p in self._buffer if s == seq)
        self.send_live_raw([self.topic, _u64(seq), payload])

    def send_live_raw(self, frames: Sequence[bytes]) -> None:
        """Put arbitrary frames on the live socket (malformed-message tests)."""
        assert self._pub is not None, "publisher is not running"
        sent = self._pub.try_send_multipart(frames)
        assert sent, "XPUB never blocks; it drops at HWM"

    async def wait_for_subscribers(self, count: int = 1) -> None:
        """Return once ``count`` subscriptions have reached the publisher (from any subscribers)."""
        assert self._pub is not None, "publisher is not running"
        while self.subscriptions_seen < count:
            frames = await self._pub.recv_multipart()
            if frames and frames[0][:1] == b"\x01":
                self.subscriptions_seen += 1

    async def _serve_replay(self, router: TrioZmqSocket) -> None:
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                continue  # not a replay request; the real publisher ignores these too
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            self.replay_requests.append(start)
            if not self.answer_replays:
                continue
            try:
                for seq, payload in list(self._buffer):  # copy: publish() may append while we wait
                    if seq >= start:
                        await self._reply(router, identity, seq, payload)
                await self._reply(router, identity, END_SEQ, b"")
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                # The requester closed its DEALER (it had what it needed): stop this stream.

    async def _reply(self, router: TrioZmqSocket, identity: bytes, seq: int, payload: bytes) -> None:
        if self.reply_frames == 4:
            await router.send_multipart([identity, b"", self.topic, _u64(seq), payload])
        else:
            await router.send_multipart([identity, b"", _u64(seq), payload])


async def _bind(sock: TrioZmqSocket, host: str, port: int | None) -> int:
    """Bind to ``port`` (or a random one). A fixed port is retried briefly: a publisher restarting on
    the same port may find the old listening socket still being torn down by zmq's I/O thread."""
    if port is None:
        bound: int = sock.socket.bind_to_random_port(f"tcp://{host}")
        return bound
    with trio.fail_after(2):
        while True:
            try:
                sock.socket.bind(f"tcp://{host}:{port}")
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE:
                    raise
                await trio.sleep(0.01)
            else:
                return port


@asynccontextmanager
async def open_kv_publisher(**options: Any) -> AsyncIterator[KvPublisher]:
    """Run a KvPublisher for the duration of the block; leaving it is a publisher process exit."""
    async with trio.open_nursery() as nursery:
        publisher: KvPublisher = await nursery.start(KvPublisher(**options).run)
        try:
            yield publisher
        finally:
            nursery.cancel_scope.cancel()
