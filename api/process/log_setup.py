"""The command line's logging: one line per event on stderr; tracebacks go to a file named in that line.

An operator reads the log to learn what happened and what to do; a 40-line traceback there hides it, and
the only reader who needs one is whoever fixes the bug. So a record that carries an exception is printed as
its message plus ``[<type>: <text>; traceback in <file>]``, and the traceback is appended to one file per
process in the system's temporary directory, created on first use. A file, not a debug-level record: a crash
seldom repeats on demand, so the traceback must be kept the first time, without a restart at debug level.
At ``--log-level debug`` the traceback is printed inline as well.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class TracebackFile:
    """Appends tracebacks to ``kvrouter-<service>-<time>-<pid>-*.traceback.log``, made on the first one."""

    def __init__(self, service: str, directory: Path | None = None) -> None:
        self._service = service
        self._directory = directory
        self.path: Path | None = None

    def write(self, header: str, traceback_text: str) -> str:
        """Append one traceback; returns where it went (or why it could not be kept)."""
        try:
            if self.path is None:
                prefix = f"kvrouter-{self._service}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-"
                fd, name = tempfile.mkstemp(suffix=".traceback.log", prefix=prefix, dir=self._directory)
                os.close(fd)
                self.path = Path(name)
            with self.path.open("a", encoding="utf-8") as out:
                out.write(f"{header}\n{traceback_text}\n\n")
        except OSError as exc:
            return f"nowhere ({exc.strerror or exc}); rerun with --log-level debug to print it"
        return str(self.path)


class OneLineFormatter(logging.Formatter):
    """A record with an exception becomes one line; its traceback goes to a :class:`TracebackFile`."""

    def __init__(self, tracebacks: TracebackFile, *, inline: bool = False) -> None:
        super().__init__(FORMAT)
        self._tracebacks = tracebacks
        self._inline = inline

    def format(self, record: logging.LogRecord) -> str:
        if not record.exc_info or record.exc_info[1] is None:
            return super().format(record)
        exc_info, exc_text = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None
        try:
            line = super().format(record)
        finally:
            record.exc_info, record.exc_text = exc_info, exc_text
        traceback_text = self.formatException(exc_info)
        summary = describe(exc_info[1])
        line = f"{line} [{summary}; traceback in {self._tracebacks.write(line, traceback_text)}]"
        return f"{line}\n{traceback_text}" if self._inline else line


def describe(exc: BaseException) -> str:
    """``Type: text`` of the exception, or of the first one inside a group (the group's own text says nothing)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def configure(level: str, service: str) -> None:
    """Log to stderr at ``level`` (a no-op when the host program, e.g. pytest, already configured logging)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter(TracebackFile(service), inline=level.lower() == "debug"))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    if level.lower() != "debug":
        # httpx logs every request at info: the frontend's to its workers, discovery's probes of etcd every 2 s
        for library in QUIET_LIBRARIES:
            logging.getLogger(library).setLevel(logging.WARNING)


QUIET_LIBRARIES = ("httpx", "httpcore")
