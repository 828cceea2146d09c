"""KV events out, as vLLM's ``ZmqEventPublisher`` sends them: a PUB socket and an optional replay ROUTER.

Live messages are ``[topic, seq (8 bytes, big-endian), payload]``; seq starts at 0 and grows by one per
batch; the payload is a msgpack ``[ts, [event, ...], data_parallel_rank]`` with vLLM's tagged-array events
(``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]``,
``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``), written by
``kvrouter.actors.core.kv_wire.encode_batch``. Every batch is also kept in a ring buffer; the replay ROUTER
answers ``[identity, b"", start (8 BE)]`` with ``[identity, b"", seq, payload]`` for each buffered batch whose
seq >= start, then the end marker ``[identity, b"", 0xFFFF_FFFF_FFFF_FFFF, b""]``. A request of any other
shape is ignored (and counted).

Bounds (overflow policy *drop oldest*): the buffer keeps at most ``buffer_batches`` batches and
``buffer_bytes`` bytes of payload; a listener asking for an evicted seq gets what is left, from the oldest
kept, and sees the hole. The PUB's send high-water mark is vLLM's 100,000 messages per subscriber; past it
zmq drops live messages for that subscriber (a gap its replay repairs).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Final

import zmq

from kvrouter.actors.core.kv_wire import KvEvent, encode_batch
from kvrouter.actors.transport.zmq_socket import TrioZmqSocket, open_socket

log = logging.getLogger("kvrouter.mock_worker.kv")

END_SEQ: Final = b"\xff" * 8
PUBLISHER_HWM: Final = 100_000  # vLLM's
REPLAY_RCVHWM: Final = 100  # replay requests queued while one is being answered (the ROUTER then drops)
DEFAULT_BUFFER_BATCHES: Final = 10_000  # vLLM's buffer_steps
DEFAULT_BUFFER_BYTES: Final = 64 * 1024 * 1024


class KvEventPublisher:
    """Owns the PUB socket (``publish`` is synchronous: PUB never blocks) and the replay ROUTER (``serve_replay``)."""

    def __init__(
        self,
        *,
        topic: bytes = b"",
        dp_rank: int = 0,
        buffer_batches: int = DEFAULT_BUFFER_BATCHES,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    ) -> None:
        if buffer_batches <= 0 or buffer_bytes <= 0:
            raise ValueError("the replay buffer must hold at least one batch and one byte")
        self.topic = topic
        self.dp_rank = dp_rank
        self.buffer_batches = buffer_batches
        self.buffer_bytes = buffer_bytes
        self.next_seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque()
        self.buffered_bytes = 0
        self.replay_requests = 0
        self.replayed_batches = 0
        self.ignored_requests = 0
        self._pub: TrioZmqSocket | None = None
        self._router: TrioZmqSocket | None = None
        self.port: int | None = None
        self.replay_port: int | None = None

    def bind(self, host: str, port: int, replay_port: int | None) -> None:
        """Open and bind the sockets (port 0: any free one); ``replay_port`` None: no replay endpoint."""
        ipv6: dict[int, int | bytes] = {zmq.IPV6: 1} if ":" in host else {}
        pub = open_socket(zmq.PUB, sndhwm=PUBLISHER_HWM, rcvhwm=100, options=ipv6)
        try:
            self.port = _bind(pub, host, port)
            if replay_port is not None:
                # ROUTER_MANDATORY: at the high-water mark a reply waits instead of vanishing; a requester
                # that went away raises EHOSTUNREACH, which ends its reply stream.
                router = open_socket(
                    zmq.ROUTER, sndhwm=1000, rcvhwm=REPLAY_RCVHWM, options={zmq.ROUTER_MANDATORY: 1, **ipv6}
                )
                try:
                    self.replay_port = _bind(router, host, replay_port)
                except BaseException:
                    router.close()
                    raise
                self._router = router
        except BaseException:
            pub.close()
            raise
        self._pub = pub

    def close(self) -> None:
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close()

    def publish(self, events: Sequence[KvEvent]) -> int:
        """Send one batch live and keep it for replay; returns its seq."""
        payload = encode_batch(events, ts=time.time(), dp_rank=self.dp_rank)
        seq = self.next_seq
        self.next_seq += 1
        self.buffer.append((seq, payload))
        self.buffered_bytes += len(payload)
        while len(self.buffer) > self.buffer_batches or (self.buffered_bytes > self.buffer_bytes and self.buffer):
            self.buffered_bytes -= len(self.buffer.popleft()[1])
        if self._pub is not None:
            self._pub.try_send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    async def serve_replay(self) -> None:
        """Answer replay requests, one at a time, until cancelled (returns at once without a replay socket)."""
        router = self._router
        if router is None:
            return
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self.ignored_requests += 1
                log.warning("ignored a malformed replay request (%d frames)", len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            self.replay_requests += 1
            try:
                for seq, payload in list(self.buffer):  # a copy: batches published meanwhile come live
                    if seq >= start:
                        await router.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
                        self.replayed_batches += 1
                await router.send_multipart([identity, b"", END_SEQ, b""])
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                log.debug("replay requester went away before its answer ended")


def _bind(sock: TrioZmqSocket, host: str, port: int) -> int:
    if port == 0:
        bound: int = sock.socket.bind_to_random_port(f"tcp://{_zmq_host(host)}")
        return bound
    sock.socket.bind(f"tcp://{_zmq_host(host)}:{port}")
    return port


def _zmq_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "*"
    return f"[{host}]" if ":" in host else host
