"""Taking a snapshot without stopping the service, and the policy that keeps snapshots apart.

A snapshot must show every scope exactly at one LSN, but the actors keep mutating their states. Three
ways to get that consistent view, chosen per ``ActorSystem``:

* ``FORK`` (production: a journal with ``SnapshotStaging`` on a POSIX system). ``os.fork()`` gives a
  child process a copy-on-write image of the whole heap as of that instant, as Redis's BGSAVE does. The
  event loop pauses only for the fork call itself (copying page tables: ~10-30 ms for a 1M-block
  index, against ~0.75-1.7 s for copying the state); the child serialises the states, stages the file
  (written and fsynced, not yet visible) and exits. The parent waits for it without blocking the loop,
  then the journal installs the file (durability wait, rename, compaction). The child runs on another
  core and holds no GIL of the parent's, so the service loses no CPU time to encoding either.
* ``THREAD`` (the fallback where fork is unavailable or fails): the state is copied to plain lists on
  the loop (the pause the issue complains about), then hashed and encoded in a thread.
* ``INLINE`` (simulations): copy and encode on the loop, so a snapshot lands at a deterministic
  point of virtual time.

The forked child's rules (the parent is a multi-threaded trio process): it never touches trio, zmq,
logging or any lock; signals are blocked across the fork and the child resets every Python handler
and trio's wakeup fd before unblocking; the cyclic GC stays off (a collection would touch, and so copy,
every tracked object); it closes every inherited descriptor but its report pipe (the data-directory
flock, the listening socket, client connections), asks the kernel to kill it if the parent dies
(Linux), and reports through its exit status plus one line on the pipe. Everything it runs is imported
before the fork. A child that outlives ``child_timeout`` is killed. Failure of any kind leaves the
previous snapshot in place; the next attempt is paced (see ``SnapshotPacing``).

Costs, measured by ``benchmarks/snapshot_pause_bench.py``: transient memory is the pages the child
copies (every object it serialises has its refcount written, so up to the size of the state, ~40% of
the parent's RSS measured for a 1M-block index) plus the pages the parent dirties meanwhile; each first
write by the parent to a shared page costs it a page fault and a 4 KiB copy. With transparent huge
pages set to ``always`` a fault copies 2 MiB instead: prefer ``madvise`` or ``never``, as for Redis.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import enum
import gc
import logging
import os
import resource
import signal
import sys
import time
import warnings
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Final, NoReturn

import attrs
import trio

from kvrouter.actors.core.state import ScopeState
from kvrouter.actors.persistence.snapshots import encode_snapshot
from kvrouter.journal.store import Journal, Snapshot, SnapshotStaging

log = logging.getLogger("kvrouter.actors")

# Pacing (see SnapshotPacing): after a snapshot that took D seconds, the next starts no sooner than
# SNAPSHOT_PACING_FACTOR * D after it ended, so snapshotting occupies at most 1 / (1 + factor) of the
# time (20%); after a failure, no sooner than SNAPSHOT_RETRY_SECONDS either.
SNAPSHOT_PACING_FACTOR: Final = 4.0
SNAPSHOT_RETRY_SECONDS: Final = 30.0
# A child still running after this long is presumed stuck (it is killed, the attempt counts as failed).
# Generous: a 1M-block snapshot takes a few seconds; a stuck child only delays snapshots, never requests.
SNAPSHOT_CHILD_TIMEOUT: Final = 600.0
CHILD_REPORT_LIMIT: Final = 4096  # bytes of the child's one-line report that are read (the rest is dropped)
_CHILD_CRASHED: Final = 70  # exit status when even reporting failed


class SnapshotMethod(enum.Enum):
    FORK = "fork"
    THREAD = "thread"
    INLINE = "inline"


class SnapshotFailed(Exception):
    """The attempt produced no snapshot (the previous one stays); the message is one line for the log."""


@attrs.frozen
class SnapshotReport:
    lsn: int
    method: SnapshotMethod
    scopes: int
    payload_bytes: int
    loop_pause: float  # seconds the event loop was held: the fork call, or the copy (real time)
    started: float  # trio clock
    finished: float  # trio clock, once installed
    child_private_bytes: int | None = None  # FORK on Linux: what the child copied or allocated

    @property
    def duration(self) -> float:
        return self.finished - self.started


Serialize = Callable[[int, list[ScopeState]], bytes]


def serialize_states(lsn: int, states: list[ScopeState]) -> bytes:
    """The snapshot payload of ``states`` (sorted by scope) at ``lsn``."""
    return encode_snapshot(lsn, [state.to_snapshot() for state in states])


def fork_available() -> bool:
    return hasattr(os, "fork") and sys.platform not in ("emscripten", "wasi", "ios")


def choose_method(journal: Journal, *, off_loop: bool) -> SnapshotMethod:
    """``FORK`` where the journal can install a file written elsewhere and fork exists, else ``THREAD``;
    ``INLINE`` when the caller wants snapshots on the loop (deterministic simulations)."""
    if not off_loop:
        return SnapshotMethod.INLINE
    if isinstance(journal, SnapshotStaging) and fork_available():
        return SnapshotMethod.FORK
    return SnapshotMethod.THREAD


class SnapshotPacing:
    """Named policy "pace by duration": large snapshots are never taken back to back.

    At most one snapshot is in flight (``ActorSystem`` holds a lock around each). After one that
    started at S and finished at E, the next may start at ``E + factor * (E - S)``, so a snapshot that
    takes longer (a bigger state) is followed by a proportionally longer quiet period; after a failed
    attempt, no sooner than ``E + retry_seconds`` as well (a full disk should not be hammered). Times
    are trio's clock, so simulations under a MockClock stay deterministic (inline snapshots take no
    virtual time and are never delayed).
    """

    def __init__(self, factor: float = SNAPSHOT_PACING_FACTOR, retry_seconds: float = SNAPSHOT_RETRY_SECONDS) -> None:
        if factor < 0 or retry_seconds < 0:
            raise ValueError("factor and retry_seconds must be >= 0")
        self.factor = factor
        self.retry_seconds = retry_seconds
        self._earliest = float("-inf")

    def earliest_start(self) -> float:
        return self._earliest

    def record(self, started: float, finished: float, *, succeeded: bool) -> None:
        earliest = finished + self.factor * max(0.0, finished - started)
        if not succeeded:
            earliest = max(earliest, finished + self.retry_seconds)
        self._earliest = earliest


class Snapshotter:
    """Takes one snapshot at a time of the states ``capture`` returns, with ``method``."""

    def __init__(
        self,
        journal: Journal,
        method: SnapshotMethod,
        *,
        serialize: Serialize = serialize_states,
        child_timeout: float = SNAPSHOT_CHILD_TIMEOUT,
    ) -> None:
        if method is SnapshotMethod.FORK and not (isinstance(journal, SnapshotStaging) and fork_available()):
            raise ValueError("FORK needs os.fork and a journal with SnapshotStaging (FileJournal)")
        self.journal = journal
        self.method = method
        self._serialize = serialize  # what the forked child runs (tests inject failures through it)
        self._child_timeout = child_timeout

    async def take(self, capture: Callable[[], tuple[int, list[ScopeState]]]) -> SnapshotReport:
        """Snapshot the states ``capture`` returns with the LSN they are at; install it in the journal.

        ``capture`` runs synchronously right before the copy (or fork), with no await in between.
        Raises ``SnapshotFailed`` (or the journal's ``OSError``) when nothing was installed.
        """
        if self.method is SnapshotMethod.FORK:
            try:
                return await self._take_forked(capture)
            except _ForkRefused as exc:
                log.warning("snapshot: fork failed (%s); copying on the event loop this time", exc)
        return await self._take_copied(capture, in_thread=self.method is not SnapshotMethod.INLINE)

    # -- copy on the loop (THREAD, INLINE) ----------------------------------------------------------

    async def _take_copied(
        self, capture: Callable[[], tuple[int, list[ScopeState]]], *, in_thread: bool
    ) -> SnapshotReport:
        started = trio.current_time()
        clock = time.perf_counter()
        lsn, states = capture()
        scopes = [state.to_snapshot() for state in states]
        if in_thread:
            pause = time.perf_counter() - clock
            payload = await trio.to_thread.run_sync(encode_snapshot, lsn, scopes)
        else:
            payload = encode_snapshot(lsn, scopes)
            pause = time.perf_counter() - clock
        await self.journal.write_snapshot(Snapshot(lsn, payload))
        method = SnapshotMethod.THREAD if in_thread else SnapshotMethod.INLINE
        return SnapshotReport(lsn, method, len(states), len(payload), pause, started, trio.current_time())

    # -- copy-on-write child (FORK) -----------------------------------------------------------------

    async def _take_forked(self, capture: Callable[[], tuple[int, list[ScopeState]]]) -> SnapshotReport:
        journal = self.journal
        assert isinstance(journal, SnapshotStaging)
        stage = journal.snapshot_stager()
        started = trio.current_time()
        read_fd, write_fd = os.pipe()
        try:
            clock = time.perf_counter()
            lsn, states = capture()
            pid = _fork_child(lambda mask: _child_main(lsn, states, self._serialize, stage, write_fd, mask))
            pause = time.perf_counter() - clock
        except _ForkRefused:
            os.close(read_fd)
            os.close(write_fd)
            raise
        os.close(write_fd)
        try:
            report, status = await self._wait_for_child(pid, read_fd)
        except BaseException:
            with trio.CancelScope(shield=True):  # cancelled (shutdown): leave no child and no file behind
                await _kill_and_reap(pid)
                await journal.discard_staged_snapshot(lsn)
            raise
        finally:
            os.close(read_fd)
        if status != 0:
            with trio.CancelScope(shield=True):
                await journal.discard_staged_snapshot(lsn)
            raise SnapshotFailed(f"the snapshot child {_describe_status(status)}: {report or 'no report'}")
        payload_bytes, private_bytes = _parse_success(report)
        await journal.install_staged_snapshot(lsn)
        finished = trio.current_time()
        return SnapshotReport(
            lsn, SnapshotMethod.FORK, len(states), payload_bytes, pause, started, finished, private_bytes
        )

    async def _wait_for_child(self, pid: int, read_fd: int) -> tuple[str, int]:
        """The child's report and its wait status (0 = success); kills it past ``child_timeout``."""
        with trio.move_on_after(self._child_timeout) as waited:
            report = await _read_to_eof(read_fd)
        if waited.cancelled_caught:
            status = await _kill_and_reap(pid)
            return f"killed after {self._child_timeout:g} s (stuck?)", status or 1
        return report, await _reap(pid)


# -- the parent's side of the fork ----------------------------------------------------------------


class _ForkRefused(Exception):
    """os.fork raised (out of memory, process limit): nothing was started."""


def _fork_child(child: Callable[[AbstractSet[int]], NoReturn]) -> int:
    """Fork; the child runs ``child(signal mask to restore)``, which never returns.

    Signals are blocked and the GC is off across the fork, so that neither can run a Python handler or
    a collection in the child before it has reset them."""
    gc_enabled = gc.isenabled()
    gc.disable()
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: "multi-threaded, fork() may deadlock"
            pid = os.fork()
    except OSError as exc:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        if gc_enabled:
            gc.enable()
        raise _ForkRefused(str(exc)) from exc
    if pid == 0:
        try:
            child(old_mask)
        finally:
            os._exit(_CHILD_CRASHED)
    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    if gc_enabled:
        gc.enable()
    return pid


async def _read_to_eof(fd: int) -> str:
    """Everything the child writes until it exits (its copy of the write end closes), bounded."""
    os.set_blocking(fd, False)
    chunks: list[bytes] = []
    kept = 0
    while True:
        try:
            chunk = os.read(fd, CHILD_REPORT_LIMIT)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(fd)
            continue
        if not chunk:
            return b"".join(chunks).decode("utf-8", "replace").strip()
        if kept < CHILD_REPORT_LIMIT:  # policy: keep the first CHILD_REPORT_LIMIT bytes, drop the rest
            chunks.append(chunk[: CHILD_REPORT_LIMIT - kept])
            kept += len(chunks[-1])


async def _reap(pid: int) -> int:
    """The child's wait status as an exit code (negative: killed by that signal), without blocking.

    Called once its pipe reached EOF, i.e. while it is exiting: the first polls almost always succeed.
    """
    delay = 0.0005
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 - WNOHANG never blocks
        if done:
            return os.waitstatus_to_exitcode(status)
        await trio.sleep(delay)
        delay = min(delay * 2, 0.05)


async def _kill_and_reap(pid: int) -> int:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return await _reap(pid)


def _describe_status(status: int) -> str:
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return f"was killed by {name}"
    return f"exited with status {status}"


def _parse_success(report: str) -> tuple[int, int | None]:
    """``ok <payload bytes> <private bytes or ->``, as ``_child_main`` writes it."""
    parts = report.split()
    if len(parts) != 3 or parts[0] != "ok" or not parts[1].isdigit():
        raise SnapshotFailed(f"the snapshot child exited 0 but reported {report!r}")
    return int(parts[1]), int(parts[2]) if parts[2].isdigit() else None


# -- the child ------------------------------------------------------------------------------------


_PR_SET_PDEATHSIG: Final = 1


def _load_prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up before any fork (the child must not load libraries)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL: Final = _load_prctl()


def _child_main(
    lsn: int,
    states: list[ScopeState],
    serialize: Serialize,
    stage: Callable[[Snapshot], None],
    report_fd: int,
    old_mask: AbstractSet[int],
) -> NoReturn:
    """Serialise, stage, report, exit. Never returns, never raises."""
    status, message = 1, "unknown failure"
    try:
        _detach_from_parent(report_fd, old_mask)
        payload = serialize(lsn, states)
        stage(Snapshot(lsn, payload))
        private = _private_bytes()
        status, message = 0, f"ok {len(payload)} {private if private is not None else '-'}"
    except BaseException as exc:  # everything becomes the exit status and one line
        status, message = 1, f"{type(exc).__name__}: {exc}".replace("\n", " ")
    with contextlib.suppress(BaseException):
        os.write(report_fd, message.encode("utf-8", "replace")[:CHILD_REPORT_LIMIT])
    os._exit(status)


def _detach_from_parent(report_fd: int, old_mask: AbstractSet[int]) -> None:
    """Drop everything the child shares with the running service but must not use or keep."""
    parent = os.getppid()
    signal.set_wakeup_fd(-1)  # trio's: a signal here must not wake the parent's loop
    for signum in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError, TypeError):
            if callable(signal.getsignal(signum)):
                signal.signal(signum, signal.SIG_DFL)  # SIGINT/SIGTERM now simply end the child
    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)  # die with the parent (as soon as it is gone)
        if os.getppid() != parent:  # it died before the prctl took effect
            os._exit(1)
    # Inherited descriptors: the data-directory lock (a dead parent's child must not keep it), the
    # HTTP and ZMQ sockets, trio's epoll and wakeup socket. Closing our copies leaves the parent's open.
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if limit == resource.RLIM_INFINITY or limit <= 0:
        limit = os.sysconf("SC_OPEN_MAX")
    os.closerange(3, report_fd)
    os.closerange(report_fd + 1, max(limit, report_fd + 1))


def _private_bytes() -> int | None:
    """Memory the child holds alone (pages it copied on write, plus its own allocations); Linux only."""
    private = (b"Private_Dirty:", b"Private_Clean:")
    try:
        with open("/proc/self/smaps_rollup", "rb") as rollup:
            return 1024 * sum(int(line.split()[1]) for line in rollup if line.startswith(private))
    except (OSError, ValueError, IndexError):
        return None
