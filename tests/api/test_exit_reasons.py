"""explain(): the exception that escapes ``trio.run`` becomes one line for the operator and an exit status."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import pytest
import trio
import zmq

from kvrouter.api.process.exit_reasons import ServiceContext, explain
from kvrouter.journal.store import CorruptJournal, DataDirectoryInUse, JournalFenced, JournalUnreachable

CONTEXT = ServiceContext(host="127.0.0.1", port=8092, data_dir=Path("/srv/kvrouter"), replica_sync_port=9000)


def os_error(code: int, filename: str | None = None) -> OSError:
    return OSError(code, os.strerror(code), filename) if filename else OSError(code, os.strerror(code))


def nested(*leaves: BaseException) -> BaseExceptionGroup:
    """As trio nests them: the service's nursery inside run_until_signal's."""
    return BaseExceptionGroup("outer nursery", [BaseExceptionGroup("inner nursery", list(leaves))])


def test_a_port_in_use_deep_inside_nested_groups_is_found() -> None:
    reason = explain(nested(os_error(errno.EADDRINUSE), trio.Cancelled._create()), CONTEXT, journal_open=True)
    assert reason.status == 2 and not reason.unexpected
    assert reason.message == (
        "cannot start: port 8092 is already in use on 127.0.0.1; stop what holds it or pass another --port"
    )


def test_a_name_that_does_not_resolve() -> None:
    error = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    reason = explain(nested(error), CONTEXT, journal_open=True)
    assert reason.status == 2 and "--host 127.0.0.1 does not resolve (Name or service not known)" in reason.message


def test_a_privileged_port() -> None:
    reason = explain(nested(os_error(errno.EACCES)), CONTEXT, journal_open=True)
    assert reason.status == 2 and "ports below 1024 need privileges" in reason.message


def test_a_replica_sync_port_in_use() -> None:
    reason = explain(nested(zmq.ZMQError(errno.EADDRINUSE)), CONTEXT, journal_open=True)
    assert reason.status == 2 and "replica-sync port 9000 is already in use" in reason.message


@pytest.mark.parametrize(
    ("code", "advice"),
    [
        (errno.EACCES, "pass a --data-dir this user can write"),
        (errno.EROFS, "pass a --data-dir this user can write"),
        (errno.EPERM, "pass a --data-dir this user can write"),
        (errno.ENOSPC, "free space on its filesystem and start again"),
    ],
)
def test_an_unusable_data_dir_at_startup(code: int, advice: str) -> None:
    reason = explain(nested(os_error(code, "/srv/kvrouter/LOCK")), CONTEXT, journal_open=False)
    assert reason.status == 2
    assert reason.message.startswith("cannot start: cannot use the data directory /srv/kvrouter (")
    assert "/srv/kvrouter/LOCK" in reason.message and advice in reason.message


def test_a_parent_of_the_data_dir_counts_as_the_data_dir() -> None:
    reason = explain(nested(os_error(errno.EACCES, "/srv")), CONTEXT, journal_open=False)
    assert reason.status == 2 and "cannot use the data directory" in reason.message


def test_a_file_error_elsewhere_is_not_blamed_on_the_data_dir() -> None:
    reason = explain(nested(os_error(errno.EACCES, "/etc/somewhere")), CONTEXT, journal_open=False)
    assert reason.unexpected and reason.status == 1


@pytest.mark.parametrize(
    ("failure", "advice"),
    [
        (os_error(errno.ENOSPC), "free space on its filesystem"),
        (os_error(errno.EFBIG), "raise the file-size limit (ulimit -f)"),
        (os_error(errno.EIO), "check the disk"),
        (os_error(errno.EACCES, "/srv/kvrouter/journal-00000000000000000001.log"), "fix the cause"),
    ],
)
def test_a_journal_write_failing_while_serving(failure: OSError, advice: str) -> None:
    waiter = trio.BrokenResourceError("the journal writer failed")
    waiter.__cause__ = failure
    for exc in (nested(failure, waiter), nested(waiter)):
        reason = explain(exc, CONTEXT, journal_open=True)
        assert reason.status == 1 and not reason.unexpected
        assert reason.message.startswith("stopped: writing the journal in /srv/kvrouter failed (")
        assert "nothing acknowledged was lost" in reason.message and advice in reason.message
        assert "restart" in reason.message


def test_known_startup_refusals_keep_their_own_words() -> None:
    in_use = DataDirectoryInUse("the data directory x is in use by another kvrouter process; stop it")
    assert explain(nested(in_use), CONTEXT, journal_open=False).message == f"cannot start: {in_use}"
    corrupt = CorruptJournal("journal corrupt: f at byte offset 3 (lsn 1): bad crc.\nRestore it.")
    reason = explain(nested(corrupt), CONTEXT, journal_open=False)
    assert (
        reason.status == 2
        and reason.message == "cannot start: journal corrupt: f at byte offset 3 (lsn 1): bad crc. Restore it."
    )


def test_a_configuration_failure_wins_over_what_it_caused() -> None:
    runtime = trio.BrokenResourceError("closed")
    reason = explain(nested(runtime, os_error(errno.EADDRINUSE)), CONTEXT, journal_open=True)
    assert reason.status == 2 and "already in use" in reason.message


def test_anything_else_is_unexpected() -> None:
    reason = explain(nested(KeyError("scope")), CONTEXT, journal_open=True)
    assert reason.unexpected and reason.status == 1
    assert reason.message.startswith("stopped by an unexpected error")


def test_an_interrupt_before_the_signal_handler() -> None:
    reason = explain(KeyboardInterrupt(), CONTEXT, journal_open=False)
    assert reason.status == 130 and "\n" not in reason.message


def test_a_jetstream_journal_out_of_reach_at_start_is_bad_configuration() -> None:
    error = JournalUnreachable("cannot reach NATS at nats://n1:4222 for the JetStream journal (TimeoutError)")
    reason = explain(nested(error), CONTEXT, journal_open=False)
    assert reason.status == 2 and not reason.unexpected
    assert reason.message == "cannot start: " + str(error)


def test_a_fenced_append_stops_the_service_naming_the_cause() -> None:
    fenced = JournalFenced("JetStream refused the append to kvrouter.journal.S.log in stream S: another writer ...")
    waiter = trio.BrokenResourceError("the journal writer failed")
    waiter.__cause__ = fenced
    for leaf in (fenced, waiter):
        reason = explain(nested(leaf, trio.Cancelled._create()), CONTEXT, journal_open=True)
        assert reason.status == 1 and not reason.unexpected
        assert reason.message.startswith("stopped: JetStream refused the append") and "\n" not in reason.message
