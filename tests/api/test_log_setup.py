"""The command line's log format: one line per record; a traceback goes to a file named in that line."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from kvrouter.api.process.log_setup import OneLineFormatter, TracebackFile, describe


def record_with(exc: BaseException, message: str = "request failed") -> logging.LogRecord:
    try:
        raise exc
    except BaseException:
        return logging.LogRecord("kvrouter.api", logging.ERROR, __file__, 1, message, None, sys.exc_info())


def test_an_exception_becomes_one_line_and_its_traceback_goes_to_a_file(tmp_path: Path) -> None:
    tracebacks = TracebackFile("select-service", directory=tmp_path)
    formatter = OneLineFormatter(tracebacks)

    line = formatter.format(record_with(ValueError("bad\nvalue")))

    assert "\n" not in line
    assert line.endswith(f"ERROR kvrouter.api: request failed [ValueError: bad value; traceback in {tracebacks.path}]")
    assert tracebacks.path is not None and tracebacks.path.parent == tmp_path
    assert tracebacks.path.name.startswith("kvrouter-select-service-")
    saved = tracebacks.path.read_text()
    assert "request failed" in saved and "Traceback (most recent call last)" in saved and "ValueError: bad" in saved


def test_later_tracebacks_are_appended_to_the_same_file(tmp_path: Path) -> None:
    tracebacks = TracebackFile("slot-tracker", directory=tmp_path)
    formatter = OneLineFormatter(tracebacks)
    formatter.format(record_with(ValueError("first")))
    formatter.format(record_with(KeyError("second")))
    assert list(tmp_path.iterdir()) == [tracebacks.path]
    assert "first" in tracebacks.path.read_text() and "second" in tracebacks.path.read_text()


def test_a_record_without_exception_is_unchanged(tmp_path: Path) -> None:
    tracebacks = TracebackFile("slot-tracker", directory=tmp_path)
    record = logging.LogRecord("kvrouter", logging.INFO, __file__, 1, "listening on %s", ("x",), None)
    assert OneLineFormatter(tracebacks).format(record).endswith("INFO kvrouter: listening on x")
    assert tracebacks.path is None and not list(tmp_path.iterdir())


def test_at_debug_level_the_traceback_is_printed_too(tmp_path: Path) -> None:
    text = OneLineFormatter(TracebackFile("s", directory=tmp_path), inline=True).format(record_with(ValueError("v")))
    first, rest = text.split("\n", 1)
    assert "traceback in" in first and rest.startswith("Traceback (most recent call last)")


def test_a_traceback_that_cannot_be_saved_says_so(tmp_path: Path) -> None:
    line = OneLineFormatter(TracebackFile("s", directory=tmp_path / "missing")).format(record_with(ValueError("v")))
    assert "traceback in nowhere (" in line and "--log-level debug" in line and "\n" not in line


def test_a_group_is_described_by_its_first_leaf() -> None:
    group = BaseExceptionGroup("nursery", [ExceptionGroup("inner", [RuntimeError("the cause")])])
    assert describe(group) == "RuntimeError: the cause"
    assert describe(KeyError()) == "KeyError"
