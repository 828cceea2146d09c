"""What one replica peer may inflict: how many peers, how large a message, how many messages a second.

Pure (no I/O, no clock of its own): callers pass the time.

* Peers: at most ``max_peers`` (default 64). Each costs 3 zmq sockets (SUB and its monitor's pair) out of
  the ``OTHER_ZMQ_SOCKETS`` the socket budget keeps for replica sync; a registration beyond the cap is
  refused (409), a startup list beyond it stops startup.
* Size: ``max_message_bytes`` (default 1 MiB) is the SUB's ZMQ_MAXMSGSIZE, so libzmq refuses a larger frame
  before buffering it and drops that connection (the peer link reconnects after a pause). A legitimate
  message is an admission with one sequence hash per block: ~9 bytes a block, so 1 MiB carries a
  ~110,000-block (1.8M-token at block size 16) prompt.
* Rate: a token bucket per peer, ``rate`` messages a second with bursts of ``burst``. Overflow policy
  "drop and slow down": a message that finds the bucket empty is dropped (counted) and that peer's reader
  pauses until the next token is due, so a flooding peer costs at most about two reads per token; what it
  sends meanwhile waits in zmq's pipe (RCVHWM), beyond which zmq drops it at the publisher. Legitimate
  load is ~3 messages per request (add, prefill complete, free): 10,000 a second is ~3,300 requests a
  second on one peer, above what one kvrouter replica serves.
"""

from __future__ import annotations

from typing import Final

import attrs

MAX_PEERS: Final = 64
MAX_PEERS_LIMIT: Final = 80  # (OTHER_ZMQ_SOCKETS 256 - our PUB - spares) // 3 sockets per peer
MAX_MESSAGE_BYTES: Final = 1024 * 1024
MESSAGE_BYTES_BOUNDS: Final = (1024, 64 * 1024 * 1024)
PEER_RATE: Final = 10_000.0  # messages per second per peer
PEER_RATE_BOUNDS: Final = (1.0, 10_000_000.0)


@attrs.frozen
class PeerLimits:
    max_peers: int = MAX_PEERS
    max_message_bytes: int = MAX_MESSAGE_BYTES
    rate: float = PEER_RATE
    burst: float | None = None  # None: one second's worth of ``rate``

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.max_peers <= MAX_PEERS_LIMIT:
            raise ValueError(f"max_peers must be within 0..{MAX_PEERS_LIMIT}")
        if not MESSAGE_BYTES_BOUNDS[0] <= self.max_message_bytes <= MESSAGE_BYTES_BOUNDS[1]:
            raise ValueError(f"max_message_bytes must be within {MESSAGE_BYTES_BOUNDS}")
        if not PEER_RATE_BOUNDS[0] <= self.rate <= PEER_RATE_BOUNDS[1]:
            raise ValueError(f"rate must be within {PEER_RATE_BOUNDS}")
        if self.burst is not None and not self.burst >= 1:
            raise ValueError("burst must be at least 1")

    @property
    def bucket_size(self) -> float:
        return self.burst if self.burst is not None else max(1.0, self.rate)


class TokenBucket:
    """``rate`` tokens a second, holding at most ``size``; starts full."""

    __slots__ = ("_tokens", "_updated", "rate", "size")

    def __init__(self, rate: float, size: float, now: float) -> None:
        self.rate = rate
        self.size = size
        self._tokens = size
        self._updated = now

    def take(self, now: float) -> bool:
        """Spend one token if there is one."""
        self._refill(now)
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    def wait_time(self, now: float) -> float:
        """Seconds until a token is available (0 if one is)."""
        self._refill(now)
        return max(0.0, (1.0 - self._tokens) / self.rate)

    def _refill(self, now: float) -> None:
        if now > self._updated:
            self._tokens = min(self.size, self._tokens + (now - self._updated) * self.rate)
            self._updated = now
