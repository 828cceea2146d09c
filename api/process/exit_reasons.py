"""Why the service stopped, in one line for the operator, with the exit status that goes with it.

Everything that stops a service escapes ``trio.run`` as an exception, usually inside trio's nested
``ExceptionGroup``\\ s; printed raw that is a 30-75 line traceback that buries the one fact an operator needs.
:func:`explain` looks at every leaf of the group and turns the most telling one into a line saying what
happened and what to do:

* status 2 -- the service could not start with this configuration or environment (port in use, bad host,
  unusable or locked data directory, corrupt journal, replica-sync port in use);
* status 1 -- it stopped while running: the journal could not be written (nothing acknowledged is lost:
  kvrouter answers a write only once its journal record is written), or an unexpected error (a bug) whose
  traceback the caller records elsewhere;
* status 130 -- interrupted (Ctrl-C) before the signal handler was installed.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator
from pathlib import Path

import attrs
import trio
import zmq

from kvrouter.actors.cluster import ClusterMismatch, ClusterUnreachable
from kvrouter.api.process.data_dir import DataDirectoryOwned
from kvrouter.journal.store import CorruptJournal, DataDirectoryInUse, JournalUnreachable, JournalWriteFailed

BAD_CONFIGURATION = 2
STOPPED = 1
INTERRUPTED = 130

# A write that failed for want of room or a working disk: the journal stops (fail-stop), nothing acknowledged is lost.
_STORAGE_ADVICE = {
    errno.ENOSPC: "free space on its filesystem",
    errno.EDQUOT: "raise the disk quota or free space",
    errno.EFBIG: "raise the file-size limit (ulimit -f)",
    errno.EIO: "check the disk (an I/O error)",
    errno.EROFS: "remount its filesystem read-write",
}
_NOT_A_DIRECTORY = (errno.EEXIST, errno.ENOTDIR)
_NO_PERMISSION = (errno.EACCES, errno.EPERM, errno.EROFS)


@attrs.frozen
class ServiceContext:
    """What the operator asked for, to name it in the line."""

    host: str
    port: int
    data_dir: Path
    replica_sync_port: int | None = None


@attrs.frozen
class ExitReason:
    message: str  # one line
    status: int
    unexpected: bool = False  # a bug: the caller logs it with the exception, whose traceback goes to a file


def explain(exc: BaseException, context: ServiceContext, *, journal_open: bool) -> ExitReason:
    """The line and status for ``exc`` (an exception or group escaping ``trio.run``).

    ``journal_open``: the journal had been opened and recovered, so a file error now is a failed journal
    write at run time rather than an unusable data directory at startup.
    """
    explained = [reason for leaf in _leaves(exc) if (reason := _explain_leaf(leaf, context, journal_open))]
    if explained:
        return min(explained, key=lambda reason: _RANK[reason.status])
    return ExitReason("stopped by an unexpected error (a bug: please report it with its traceback)", STOPPED, True)


# Among several explained leaves (a bind error and the cancellations it caused), the most specific wins.
_RANK = {BAD_CONFIGURATION: 0, STOPPED: 1, INTERRUPTED: 2}


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def _explain_leaf(exc: BaseException, context: ServiceContext, journal_open: bool) -> ExitReason | None:
    if isinstance(
        exc,
        DataDirectoryInUse
        | DataDirectoryOwned
        | CorruptJournal
        | JournalUnreachable
        | ClusterUnreachable
        | ClusterMismatch,
    ):
        return ExitReason(f"cannot start: {_one_line(str(exc))}", BAD_CONFIGURATION)
    remote = exc.__cause__ if isinstance(exc, trio.BrokenResourceError) else exc
    if isinstance(remote, JournalWriteFailed):  # the JetStream journal: fenced, or its server failed a write
        return ExitReason(
            f"stopped: {_one_line(str(remote))}; nothing acknowledged was lost (a write is answered only once "
            "JetStream acknowledged it): restart recovers from the stream",
            STOPPED,
        )
    if isinstance(exc, KeyboardInterrupt):
        return ExitReason("interrupted (Ctrl-C) while starting", INTERRUPTED)
    if isinstance(exc, trio.BrokenResourceError) and isinstance(exc.__cause__, OSError):
        return _journal_failed(exc.__cause__, context)  # a waiter on a journal whose writer failed
    if isinstance(exc, zmq.ZMQError):
        return _replica_bind_failed(exc, context)
    if isinstance(exc, socket.gaierror):
        return ExitReason(
            f"cannot start: --host {context.host} does not resolve ({exc.strerror}); "
            "pass an IP address or a name this machine can resolve",
            BAD_CONFIGURATION,
        )
    if isinstance(exc, OverflowError) and "port" in str(exc):
        return ExitReason(f"cannot start: --port {context.port} is out of range; use 0-65535", BAD_CONFIGURATION)
    if isinstance(exc, OSError):
        if exc.filename is not None and _concerns(Path(exc.filename), context.data_dir):
            if journal_open:
                return _journal_failed(exc, context)
            return _data_dir_unusable(exc, context)
        if exc.filename is None:
            if exc.errno in _STORAGE_ADVICE and journal_open:
                return _journal_failed(exc, context)  # write(2) and fsync(2) errors carry no file name
            return _http_bind_failed(exc, context)
    return None


def _journal_failed(exc: OSError, context: ServiceContext) -> ExitReason:
    advice = _STORAGE_ADVICE.get(exc.errno or 0, "fix the cause")
    return ExitReason(
        f"stopped: writing the journal in {context.data_dir} failed ({_os_error(exc)}); nothing acknowledged "
        f"was lost (a write is answered only once it is journaled): {advice} and restart, recovery replays "
        "the journal",
        STOPPED,
    )


def _data_dir_unusable(exc: OSError, context: ServiceContext) -> ExitReason:
    where = f"the data directory {context.data_dir}"
    if exc.errno in _NOT_A_DIRECTORY:
        advice = f"{_first_non_directory(context.data_dir)} is not a directory; pass --data-dir a directory path"
    elif exc.errno in _NO_PERMISSION:
        advice = "pass a --data-dir this user can write, or fix its permissions"
    elif exc.errno in _STORAGE_ADVICE:
        advice = _STORAGE_ADVICE[exc.errno or 0] + " and start again"
    elif exc.errno == errno.ENOENT:
        advice = "its parent cannot hold new directories; pass a --data-dir on a writable filesystem"
    else:
        advice = "pass a --data-dir on a local writable filesystem"
    return ExitReason(f"cannot start: cannot use {where} ({_os_error(exc)}); {advice}", BAD_CONFIGURATION)


def _http_bind_failed(exc: OSError, context: ServiceContext) -> ExitReason | None:
    address = f"{context.host}:{context.port}"
    if exc.errno == errno.EADDRINUSE:
        line = f"port {context.port} is already in use on {context.host}; stop what holds it or pass another --port"
    elif exc.errno == errno.EADDRNOTAVAIL:
        line = f"{context.host} is not an address of this machine; pass --host a local address (0.0.0.0: all)"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        line = f"not allowed to listen on {address} (ports below 1024 need privileges); pass --port above 1023"
    else:
        return None
    return ExitReason(f"cannot start: {line}", BAD_CONFIGURATION)


def _replica_bind_failed(exc: zmq.ZMQError, context: ServiceContext) -> ExitReason | None:
    if context.replica_sync_port is None:
        return None
    if exc.errno == errno.EADDRINUSE:
        line = (
            f"replica-sync port {context.replica_sync_port} is already in use on {context.host}; "
            "stop what holds it or pass another --replica-sync-port"
        )
    elif exc.errno in (errno.ENODEV, errno.EADDRNOTAVAIL, errno.EINVAL):
        line = (
            f"cannot listen for replica sync on tcp://{context.host}:{context.replica_sync_port} ({exc.strerror}); "
            "pass --host a local IP address"
        )
    else:
        return None
    return ExitReason(f"cannot start: {line}", BAD_CONFIGURATION)


def _concerns(path: Path, data_dir: Path) -> bool:
    """``path`` is the data directory, in it, or one of the parents it needs."""
    path, data_dir = Path(path).absolute(), data_dir.absolute()
    return path == data_dir or data_dir in path.parents or path in data_dir.parents


def _first_non_directory(path: Path) -> Path:
    """The part of ``path`` that exists but is a file (what made mkdir fail), else ``path`` itself."""
    for part in reversed([path, *path.parents]):
        if part.exists() and not part.is_dir():
            return part
    return path


def _os_error(exc: OSError) -> str:
    text = exc.strerror or str(exc)
    return f"{text}: {exc.filename}" if exc.filename is not None else text


def _one_line(text: str) -> str:
    return " ".join(text.split())
