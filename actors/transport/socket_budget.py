"""How many KV listeners this process can afford: zmq sockets, file descriptors, listener slots.

Each worker rank with a KV-events endpoint gets one listener for the life of its registration, so
the cluster size is bounded by two per-process resources, sized here for the largest cluster we
support (``SUPPORTED_RANKS``):

* zmq sockets. A listener holds ``SOCKETS_PER_LISTENER`` (its SUB, plus the monitor's inproc PAIR
  pair: libzmq reports "connection lost for good" only through a monitor, see kv_listener), and one
  replay DEALER while it repairs a gap (at most ``MAX_CONCURRENT_REPLAYS`` at once, process-wide).
  libzmq's default context allows 1,023 sockets, which ran out at ~340 ranks; the process-wide
  context is created with ``ZMQ_MAX_SOCKETS`` instead (16,384 >= 4,096 x 3 + 128 + 256 = 12,672).
* file descriptors. Every zmq socket owns an eventfd, and every TCP connection one more, so a
  connected listener takes ``FDS_PER_LISTENER`` (4) and a replay 2. 4,096 ranks need 4,096 x 4 +
  128 x 2 + ``FD_RESERVE`` (512) = 17,152. The usual soft RLIMIT_NOFILE of 1,024 affords 64
  listeners, so ``raise_open_files_limit`` lifts the soft limit toward the hard one at startup.

A registration beyond ``listener_capacity`` must be refused (``ListenerSlots.reserve`` raises
``ListenerCapacityError`` with a one-line reason) instead of letting socket creation fail later.
"""

from __future__ import annotations

import logging
import resource
from collections.abc import Hashable, Iterable
from typing import Final

import attrs
import trio

# The largest cluster we size for: worker ranks, each with its own KV listener.
SUPPORTED_RANKS: Final = 4_096
# SUB + the monitor's two PAIR sockets (one inside libzmq, one we read).
SOCKETS_PER_LISTENER: Final = 3
# One eventfd per socket (3) + the SUB's TCP connection; measured by tests/transport/test_socket_budget.py.
FDS_PER_LISTENER: Final = 4
# Replay DEALERs open at once, process-wide. A mass reconnect (service restart) asks every rank for a
# catch-up; they take turns instead of opening 4,096 DEALERs at once. Each replay takes one permit
# for its whole exchange (a silent replay endpoint holds it for the idle timeout, ~1 s).
MAX_CONCURRENT_REPLAYS: Final = 128
SOCKETS_PER_REPLAY: Final = 1
FDS_PER_REPLAY: Final = 2  # the DEALER's eventfd and its TCP connection
# zmq sockets that are not listeners: replica sync (one PUB, one SUB per peer replica) and spares.
OTHER_ZMQ_SOCKETS: Final = 256
ZMQ_MAX_SOCKETS: Final = 16_384
# Descriptors that are not listeners': HTTP clients (hypercorn holds one per connection), journal
# segment and snapshot files, the data-directory lock, trio's epoll and wakeup pipe, zmq's I/O and
# reaper threads, replica sync, log files. 512 leaves room for ~450 concurrent HTTP connections.
FD_RESERVE: Final = 512
# The soft RLIMIT_NOFILE we ask for (capped by the hard limit): enough for SUPPORTED_RANKS with room
# to spare, without handing the process the million descriptors some hosts allow.
FD_TARGET: Final = 65_536

log = logging.getLogger("kvrouter.socket_budget")

_REPLAY_LIMITER: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("kv_replay_limiter")


@attrs.frozen
class OpenFilesLimit:
    soft_before: int
    soft: int
    hard: int


def raise_open_files_limit(target: int = FD_TARGET) -> OpenFilesLimit:
    """Raise the soft RLIMIT_NOFILE to ``min(target, hard)`` (never lowers it). Call once at startup.

    An unprivileged process may raise its soft limit up to the hard one; if the kernel still refuses
    (e.g. a hard limit above ``fs.nr_open``), the limit stays where it was.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):
            wanted = soft
        return OpenFilesLimit(soft_before=soft, soft=wanted, hard=hard)
    return OpenFilesLimit(soft_before=soft, soft=soft, hard=hard)


def listener_capacity(open_files: int, zmq_max_sockets: int = ZMQ_MAX_SOCKETS) -> int:
    """Listeners affordable with ``open_files`` descriptors and ``zmq_max_sockets`` zmq sockets.

    Replays and the rest of the process are reserved for first. With a soft limit of 1,024 that is
    (1,024 - 512 - 256) // 4 = 64; with 20,000, 4,808; the socket bound is (16,384 - 256 - 128) // 3
    = 5,333.
    """
    by_fds = (open_files - FD_RESERVE - MAX_CONCURRENT_REPLAYS * FDS_PER_REPLAY) // FDS_PER_LISTENER
    by_sockets = (zmq_max_sockets - OTHER_ZMQ_SOCKETS - MAX_CONCURRENT_REPLAYS * SOCKETS_PER_REPLAY) // (
        SOCKETS_PER_LISTENER
    )
    return max(0, min(by_fds, by_sockets))


def replay_limiter() -> trio.CapacityLimiter:
    """The process-wide limit on replay DEALERs open at once (one per trio run, created on first use)."""
    try:
        return _REPLAY_LIMITER.get()
    except LookupError:
        limiter = trio.CapacityLimiter(MAX_CONCURRENT_REPLAYS)
        _REPLAY_LIMITER.set(limiter)
        return limiter


class ListenerCapacityError(Exception):
    """A registration would need more KV listeners than the process can afford; ``str`` says why
    and what to do, in one line (for a 4xx body)."""


class ListenerSlots:
    """Reserve a listener slot per worker rank before accepting a registration; release it when the
    listener stops for good. Keys are whatever identifies a rank (e.g. ``(worker_id, dp_rank)``).

    Synchronous and trio-free: the API can reserve before journaling (and release if journaling
    fails), and the ingest can reserve again when it starts the listener (idempotent per key), so two
    registrations racing for the last slot cannot both be accepted.
    """

    def __init__(self, capacity: int, limited_by: str) -> None:
        self.capacity = capacity
        # What sets the capacity and what to do about it, for messages: "limited by ...; raise ...".
        self.limited_by = limited_by
        self._held: set[Hashable] = set()

    @classmethod
    def for_this_process(cls) -> ListenerSlots:
        """Raise RLIMIT_NOFILE toward the hard limit and size the slots by what it then allows.

        Call once at startup, before the first listener; logs the outcome in one line.
        """
        limit = raise_open_files_limit()
        capacity = listener_capacity(limit.soft)
        by_sockets = listener_capacity(1 << 62)
        if capacity < by_sockets:
            limited_by = (
                f"limited by the open-files limit {limit.soft} (hard {limit.hard}, {FDS_PER_LISTENER} per listener); "
                "raise it (ulimit -n, systemd LimitNOFILE=) and restart the service"
            )
        else:
            limited_by = (
                f"limited by ZMQ_MAX_SOCKETS {ZMQ_MAX_SOCKETS} ({SOCKETS_PER_LISTENER} per listener); "
                "split the cluster across more services"
            )
        log.info(
            "KV listener capacity %d worker ranks (open-files limit %d, was %d, hard %d; %s)",
            capacity,
            limit.soft,
            limit.soft_before,
            limit.hard,
            limited_by.partition(";")[0],
        )
        return cls(capacity, limited_by)

    @property
    def in_use(self) -> int:
        return len(self._held)

    @property
    def available(self) -> int:
        return max(0, self.capacity - len(self._held))

    def holds(self, key: Hashable) -> bool:
        return key in self._held

    def reserve(self, keys: Iterable[Hashable]) -> list[Hashable]:
        """Take a slot for every key not already holding one, all or none; returns the keys newly
        reserved (release exactly those if the registration is then abandoned).

        Raises ListenerCapacityError, changing nothing, when the new keys do not fit.
        """
        new = list(dict.fromkeys(key for key in keys if key not in self._held))
        if len(self._held) + len(new) > self.capacity:
            raise ListenerCapacityError(
                f"cannot listen to {len(new)} more KV event stream(s): {len(self._held)} of {self.capacity} "
                f"KV listener slots are in use, {self.limited_by}"
            )
        self._held.update(new)
        return new

    def release(self, keys: Iterable[Hashable]) -> None:
        """Give slots back (unknown keys are ignored, so releasing twice is harmless)."""
        self._held.difference_update(keys)
